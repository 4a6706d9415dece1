"""The `rlhf` command line: `crd` and `validate` call rlhf_api; `operator`, `run` and `make-tiny-model`
are forwarded to the operator's and the trainer's own entry points, imported by module name only when
chosen. Owns argument routing and `--version`; must not import rlhf_operator or rlhf_trainer at the top
(they pull in kopf, torch and Ray, and would tie the two sides together).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from rlhf_api.crd import crd_yaml
from rlhf_api.validate import format_issues, load_runtime, validate_file

Command = Callable[[argparse.Namespace], int]
DISTRIBUTION = "rlhf-operator"


def _crd(args: argparse.Namespace) -> int:
    """Print the generated CustomResourceDefinition."""
    sys.stdout.write(crd_yaml())
    return 0


def _validate(args: argparse.Namespace) -> int:
    """Validate manifests offline: one `FILE: path: message` line per problem; exit 1 on any. With
    `--runtime`, the runtime file first, then each job merged over it as the operator will merge it."""
    runtime = None
    if args.runtime:
        runtime, issues = load_runtime(args.runtime)
        for line in format_issues(args.runtime, issues) if issues else [f"{args.runtime}: valid"]:
            print(line)
        if runtime is None:
            print(f"rlhf validate: {args.runtime} is invalid; no job was checked on it", file=sys.stderr)
            return 1
    failed = False
    for name in args.files:
        issues = validate_file(name, runtime)
        failed = failed or bool(issues)
        lines = format_issues(name, issues) if issues else [f"{name}: valid"]
        for line in lines:
            print(line)
    return 1 if failed else 0


@dataclass(frozen=True)
class Forwarded:
    """A subcommand owned by another package: `module.function(argv) -> exit status`, needing `extra`."""

    help: str
    module: str
    function: str
    extra: str

    def __call__(self, command: str, argv: list[str]) -> int:
        try:
            target = getattr(importlib.import_module(self.module), self.function)
        except ModuleNotFoundError as error:
            # The target (or one of its dependencies) is not installed, e.g. kopf in the trainer image.
            print(
                f"rlhf {command}: cannot import {error.name!r}; install the [{self.extra}] extra",
                file=sys.stderr,
            )
            return 2
        return int(target(argv))


# These take the raw remaining arguments: the target owns its options (and its --help).
FORWARDED: dict[str, Forwarded] = {
    "run": Forwarded("run the trainer (the Ray job entrypoint)", "rlhf_trainer.cli", "run_main", "trainer"),
    "export": Forwarded(
        "export a checkpoint's actor as a Hugging Face model directory",
        "rlhf_trainer.export",
        "main",
        "trainer",
    ),
    "plan": Forwarded(
        "print a job's device map (ranks, reward model, engines -> pod and GPU) on a local Ray",
        "rlhf_trainer.device_map",
        "main",
        "trainer",
    ),
    "make-tiny-model": Forwarded(
        "build the offline tiny model, tokenizer and prompt dataset",
        "rlhf_trainer.cli",
        "make_tiny_model_main",
        "trainer",
    ),
    "diagnose": Forwarded(
        "print the stack snapshot of a job's latest stall (who is stuck where)",
        "rlhf_operator.diagnose_cli",
        "main",
        "operator",
    ),
    "operator": Forwarded("run the operator", "rlhf_operator.main", "main", "operator"),
}


def package_version() -> str:
    """The installed distribution's version (pyproject's `version`)."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The `rlhf` argument parser (forwarded commands appear in its help; main() dispatches them)."""
    parser = argparse.ArgumentParser(
        prog="rlhf", description="RLHFJob tools: CRD, validation, trainer, operator."
    )
    parser.add_argument("--version", action="version", version=f"rlhf {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crd = commands.add_parser("crd", help="print the RLHFJob CustomResourceDefinition (YAML)")
    crd.set_defaults(func=_crd)

    validate = commands.add_parser(
        "validate", help="validate RLHFJob manifests offline, as the API server would"
    )
    validate.add_argument("files", nargs="+", metavar="FILE", help="YAML manifests ('-' for standard input)")
    validate.add_argument(
        "--runtime",
        metavar="FILE",
        help="a ClusterRLHFRuntime or RLHFRuntime manifest: validate it, then each job merged over it "
        "(the fields it keeps, its runtimeRef, the merged spec), as the operator will (docs/runtimes.md)",
    )
    validate.set_defaults(func=_validate)

    for name, forwarded in FORWARDED.items():
        commands.add_parser(name, help=forwarded.help + " (options are the target's own)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rlhf` console script; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] in FORWARDED:
        return FORWARDED[arguments[0]](arguments[0], arguments[1:])
    args = build_parser().parse_args(arguments)
    func: Command = args.func
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
