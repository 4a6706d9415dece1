"""The `rlhf` command line: `crd` and `validate` here; `run`, `make-tiny-model` and `operator` dispatch to
modules imported only when chosen, so `rlhf validate` and `rlhf crd` never import torch, Ray or kopf.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Command = Callable[[argparse.Namespace], int]


def _crd(args: argparse.Namespace) -> int:
    """Print the generated CustomResourceDefinition."""
    from rlhf_api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _validate(args: argparse.Namespace) -> int:
    """Validate manifests offline: one `FILE: path: message` line per problem; exit 1 on any."""
    from rlhf_api.validate import format_issues, validate_file

    failed = False
    for name in args.files:
        issues = validate_file(name)
        failed = failed or bool(issues)
        lines = format_issues(name, issues) if issues else [f"{name}: valid"]
        for line in lines:
            print(line)
    return 1 if failed else 0


# ---- dispatch to other packages, imported only when chosen (each pulls in heavy dependencies) ------
# These take the raw remaining arguments: the target owns its options (and its --help).


def _missing(command: str, error: ModuleNotFoundError, extra: str) -> int:
    """A forwarded command whose implementation (or one of its dependencies) is not installed."""
    print(f"rlhf {command}: cannot import {error.name!r}; install the [{extra}] extra", file=sys.stderr)
    return 2


def _run(argv: list[str]) -> int:
    """The trainer entrypoint (Ray driver): rlhf_trainer.cli.run_main(argv) -> exit status."""
    try:
        from rlhf_trainer.cli import run_main
    except ModuleNotFoundError as error:
        return _missing("run", error, "trainer")
    return int(run_main(argv))


def _make_tiny_model(argv: list[str]) -> int:
    """The offline tiny model, tokenizer and dataset: rlhf_trainer.cli.make_tiny_model_main(argv)."""
    try:
        from rlhf_trainer.cli import make_tiny_model_main
    except ModuleNotFoundError as error:
        return _missing("make-tiny-model", error, "trainer")
    return int(make_tiny_model_main(argv))


def _operator(argv: list[str]) -> int:
    """The operator (kopf): rlhf_operator.main.main(argv) -> exit status."""
    try:
        from rlhf_operator.main import main as operator_main
    except ModuleNotFoundError as error:
        return _missing("operator", error, "operator")
    return int(operator_main(argv))


FORWARDED: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "run": ("run the trainer (the Ray job entrypoint)", _run),
    "make-tiny-model": ("build the offline tiny model, tokenizer and prompt dataset", _make_tiny_model),
    "operator": ("run the operator", _operator),
}


def build_parser() -> argparse.ArgumentParser:
    """The `rlhf` argument parser (forwarded commands appear in its help; main() dispatches them)."""
    parser = argparse.ArgumentParser(
        prog="rlhf", description="RLHFJob tools: CRD, validation, trainer, operator."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crd = commands.add_parser("crd", help="print the RLHFJob CustomResourceDefinition (YAML)")
    crd.set_defaults(func=_crd)

    validate = commands.add_parser(
        "validate", help="validate RLHFJob manifests offline, as the API server would"
    )
    validate.add_argument("files", nargs="+", metavar="FILE", help="YAML manifests ('-' for standard input)")
    validate.set_defaults(func=_validate)

    for name, (help_text, _) in FORWARDED.items():
        commands.add_parser(name, help=help_text + " (options are the target's own)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rlhf` console script; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] in FORWARDED:
        _, target = FORWARDED[arguments[0]]
        return target(arguments[1:])
    args = build_parser().parse_args(arguments)
    func: Command = args.func
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
