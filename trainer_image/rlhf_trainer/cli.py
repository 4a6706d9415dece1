"""`rlhf run` and `rlhf make-tiny-model`: the local front door to the driver and the tiny-model factory.

Owns argument parsing, `--set path=value` overrides, the rich progress bar and phase table, and the
summary JSON. Validation and training are the driver's; this module only presents them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.markup import escape
from rlhf_api.constants import PREEMPTED_EXIT_CODE


def apply_overrides(manifest: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """`--set algorithm.totalSteps=3` (relative to spec) or `spec.x.y=v` / `metadata.name=v`; values are YAML."""
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected path.to.field=value")
        path, _, raw = item.partition("=")
        keys = path.strip().split(".")
        if keys[0] not in ("spec", "metadata", "apiVersion", "kind"):
            keys = ["spec", *keys]
        node: Any = manifest
        for depth, k in enumerate(keys[:-1]):
            if node.get(k) is None:  # absent or null: the override creates the mapping
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                where = ".".join(keys[: depth + 1])
                raise ValueError(f"--set {path}: {where} is {node!r}, not a mapping")
        try:
            node[keys[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {path}: the value {raw!r} is not valid YAML (quote it): {e}") from e
    return manifest


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlhf run", description="Run an RLHFJob spec locally on an embedded Ray."
    )
    p.add_argument("file", help="RLHFJob YAML manifest")
    p.add_argument("--steps", type=int, help="run at most this many steps (from the resume point)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a spec field, e.g. --set algorithm.totalSteps=5 (repeatable)",
    )
    p.add_argument(
        "--resume",
        choices=["auto", "never", "force"],
        help="override checkpoint.resume: auto resumes this job's own checkpoint (the default), never "
        "starts fresh, force resumes another run's checkpoint anyway",
    )
    p.add_argument("--summary-json", help="write the run summary (per-step rewards and phase seconds) here")
    p.add_argument("--metrics-port", type=int, help="override monitoring.metricsPort (0 disables /metrics)")
    p.add_argument("--job-name", help="the rlhfjob label (default: metadata.name)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")
    return p


def run_main(argv: list[str] | argparse.Namespace) -> int:
    args = argv if isinstance(argv, argparse.Namespace) else _parser().parse_args(list(argv))
    from rich.console import Console

    console = Console(stderr=True)
    from rlhf_trainer.startup_imports import gc_paused

    with gc_paused():  # the driver's stack: long-lived objects only (startup_imports.py)
        from rlhf_trainer.config import InputError, parse_spec
        from rlhf_trainer.driver import run
        from rlhf_trainer.loop import RewardFailure
        from rlhf_trainer.stop import StopRequest

    try:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except OSError as e:
            raise InputError(f"{args.file}: cannot read: {e.strerror or e}") from e
        try:
            manifest = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise InputError(f"{args.file}: malformed YAML: {e}") from e
        if not isinstance(manifest, dict):
            raise InputError(f"{args.file}: not an RLHFJob manifest")
        try:
            sets = list(getattr(args, "sets", []) or [])
            if getattr(args, "resume", None):
                sets.append(f"checkpoint.resume={args.resume}")
            manifest = apply_overrides(manifest, sets)
        except ValueError as e:
            raise InputError(str(e)) from e
        spec = parse_spec(manifest)
        job = getattr(args, "job_name", None) or str((manifest.get("metadata") or {}).get("name") or "local")
    except InputError as e:
        _error(console, str(e))
        return 2

    quiet = bool(getattr(args, "quiet", False))
    total = spec.algorithm.total_steps if args.steps is None else args.steps
    rows: list[Any] = []
    progress, task = _progress(console, total, quiet)

    def on_step(report: Any) -> None:
        rows.append(report)
        if progress is not None:
            progress.update(
                task, advance=1, description=f"step {report.step} reward {report.reward_mean:.3f}"
            )
        if not quiet:
            if len(rows) == 1:
                console.print(_step_header(), highlight=False, markup=False, soft_wrap=True)
            console.print(_step_row(report), highlight=False, markup=False, soft_wrap=True)

    stop = StopRequest().install()  # SIGTERM: stop at a step boundary, as the operator's driver does
    try:
        if progress is not None:
            progress.start()
        summary = run(
            spec,
            job,
            steps=args.steps,
            metrics_port=getattr(args, "metrics_port", None),
            on_step=on_step,
            log=(lambda m: None)
            if quiet
            else (lambda m: console.print(f"[dim]{escape(m)}[/dim]", highlight=False, soft_wrap=True)),
            stop=stop,
        )
    except InputError as e:
        _stop(progress)
        _error(console, str(e))
        return 2
    except RewardFailure as e:
        _stop(progress)
        _error(console, str(e))
        return 3
    except KeyboardInterrupt:
        _stop(progress)
        return 130
    except Exception as e:
        _stop(progress)
        _error(console, f"{type(e).__name__}: {e}")
        return 1
    finally:
        stop.restore()
    _stop(progress)
    if quiet and summary.get("message"):  # else the driver's log has said it
        console.print(escape(str(summary["message"])), highlight=False, soft_wrap=True)
    if not quiet and rows:
        console.print(_phase_table(rows))
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=1))
    if "preempted" in summary:
        if quiet:  # else the driver's log has said it
            console.print(escape(str(summary["preempted"]["line"])), highlight=False, soft_wrap=True)
        return PREEMPTED_EXIT_CODE
    return 0


def _error(console: Any, message: str) -> None:
    """One error, never wrapped (tests and users grep for the field or path it names), never parsed as markup."""
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)


def _progress(console: Any, total: int, quiet: bool) -> tuple[Any, Any]:
    if quiet:
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task("starting", total=total)
    return progress, task


def _stop(progress: Any) -> None:
    if progress is not None:
        progress.stop()


# The per-step table: one aligned row per step, a column per phase (seconds; "-" if it did not run).
_PHASE_COLUMNS = {
    "generation": "gen",
    "reward": "reward",
    "reference": "ref",
    "critic_values": "values",
    "old_logprobs": "oldlp",
    "advantages": "adv",
    "actor_train": "actor",
    "critic_train": "critic",
    "weight_sync": "sync",
    "checkpoint": "ckpt",
    "eval": "eval",
    "tool": "tool",  # rollout.agent: while tool calls ran (within gen)
}


def _step_header() -> str:
    phases = "".join(f"{c:>7}" for c in _PHASE_COLUMNS.values())
    return f"{'step':>5} {'reward':>7} {'kl':>7} {'tok/s':>6} {'errors':>6} |{phases} {'total':>7}"


def _step_row(r: Any) -> str:
    cells = "".join(
        f"{r.phase_seconds[p]:>7.2f}" if p in r.phase_seconds else f"{'-':>7}" for p in _PHASE_COLUMNS
    )
    return (
        f"{r.step:>5} {r.reward_mean:>7.3f} {r.kl:>7.4f} {r.tokens_per_second:>6.0f} {r.reward_errors:>6} |"
        f"{cells} {r.step_seconds:>7.2f}"
    )


def _phase_table(rows: list[Any]) -> Any:
    """Phases as rows (the table stays narrow however many steps ran): last step, mean, share of the steps'
    wall time (phases that ran at the same time each count their own, so the shares may sum past 100 %)."""
    from rich.table import Table

    from rlhf_trainer.metrics import PHASES

    used = [p for p in PHASES if any(p in r.phase_seconds for r in rows)]
    totals = {p: sum(r.phase_seconds.get(p, 0.0) for r in rows) for p in used}
    grand = sum(r.step_seconds for r in rows) or 1.0
    last = rows[-1]
    table = Table(
        title=f"phases over {len(rows)} step(s); last step {last.step}, reward {last.reward_mean:.3f}, "
        f"{last.tokens_per_second:.0f} generated tok/s"
    )
    for col in ("phase", "last s", "mean s", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for p in used:
        table.add_row(
            p,
            f"{last.phase_seconds.get(p, 0.0):.2f}",
            f"{totals[p] / len(rows):.2f}",
            f"{100 * totals[p] / grand:.0f}%",
        )
    table.add_row("step", f"{last.step_seconds:.2f}", f"{grand / len(rows):.2f}", "100%")
    return table


def make_tiny_model_main(argv: list[str] | argparse.Namespace) -> int:
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        p = argparse.ArgumentParser(
            prog="rlhf make-tiny-model",
            description="Build the offline tiny Llama, its BPE tokenizer, a prompt set and an eval split.",
        )
        p.add_argument(
            "dir", help="output directory (model/, prompts.jsonl and eval.jsonl are written inside)"
        )
        p.add_argument("--prompts", type=int, default=2048, help="number of prompts")
        p.add_argument("--seed", type=int, default=0)
        args = p.parse_args(list(argv))
    from rlhf_trainer.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, num_prompts=getattr(args, "prompts", 2048), seed=getattr(args, "seed", 0))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(sys.argv[1:]))
