"""The Ray driver (job entrypoint): checks the input, places the groups, runs the steps, serves /metrics.

Owns the run's order: parse and check the spec, announce the resume step, connect to Ray, place and start
the groups, resume, then `loop.run_step` for each step, and shut everything down; told to stop (SIGTERM),
it saves or keeps a checkpoint at the next step boundary (`stop.decide_stop`), or ends a start-up at once,
and exits 143. How each part is done lives in config, placement, loop, checkpoint, stop and
weight_sync.manager. Never touches token arrays.
Run as `python -m rlhf_trainer.driver --job-name NAME --spec-env RLHF_SPEC_JSON` (the operator) or via
`rlhf run FILE` (cli.py).
"""

from __future__ import annotations

if __name__ == "__main__":  # `start@0` fails the attempt before torch and Ray load (3.6 s of imports)
    import gc

    from rlhf_trainer.fault_env import crash_if_start_armed

    crash_if_start_armed()
    gc.disable()  # while the imports below run: long-lived objects only (startup_imports.py); enabled in __main__

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import ray
from rlhf_api.constants import INPUT_ERROR_EXIT_CODE, JOB_NAME_ENV, METRICS_PORT_ENV, PREEMPTED_EXIT_CODE
from rlhf_api.spec import RLHFJobSpec

from rlhf_trainer import container_log, device, device_plan
from rlhf_trainer.checkpoint import Checkpointer, resume_point
from rlhf_trainer.config import InputError, load_spec_arg, localized, preflight
from rlhf_trainer.data import PromptDataset
from rlhf_trainer.export import EXPORT_INFO, export_on_trainer, upload_on_trainer
from rlhf_trainer.faults import FaultInjector, fail_at_start
from rlhf_trainer.loop import ObjectiveState, StepContext, StepReport, abandon, run_step
from rlhf_trainer.metrics import PhaseTimer, TrainerExporter
from rlhf_trainer.placement import Placed, place, process_count, start
from rlhf_trainer.stacks import dump as stacks_dump
from rlhf_trainer.stacks.collect import snapshot
from rlhf_trainer.stacks.summary import annotate
from rlhf_trainer.stacks.watchdog import PhaseWatchdog
from rlhf_trainer.stop import (
    StopRequest,
    decide_stop,
    estimate_save_seconds,
    kept_line,
    saved_line,
    stop_budget,
)
from rlhf_trainer.tracking.tracker import Tracker
from rlhf_trainer.weight_sync.manager import WeightSyncManager, choose_backend

# ---------------------------------------------------------------------------------------------- ray


def connect_ray(processes: int, standin_gpus: int = 0) -> bool:
    """Connect to RAY_ADDRESS or a running local cluster, else start one; True if we started it.

    A local Ray started under the CPU stand-in advertises `standin_gpus` logical GPUs (the job's), so
    the plan is placed as it would be on GPUs; on real GPUs Ray detects them."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    address = os.environ.get("RAY_ADDRESS", "")
    if address and address != "local":
        ray.init(address=address, log_to_driver=_log_workers())
        return False
    if not address:
        try:
            ray.init(address="auto", log_to_driver=_log_workers())
            return False
        except (ConnectionError, RuntimeError):
            pass
    cores = os.cpu_count() or 1
    gpus: dict[str, Any] = {"num_gpus": standin_gpus} if standin_gpus else {}
    ray.init(
        address="local",
        num_cpus=max(cores, processes),
        **gpus,
        include_dashboard=False,
        log_to_driver=_log_workers(),
        runtime_env={"env_vars": {"RLHF_DEVICE": os.environ.get("RLHF_DEVICE", "")}}
        if os.environ.get("RLHF_DEVICE")
        else None,
    )
    return True


def _log_workers() -> bool:
    return os.environ.get("RLHF_WORKER_LOGS", "1") != "0"


def run(
    spec: RLHFJobSpec,
    job: str,
    *,
    steps: int | None = None,
    metrics_port: int | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    log: Callable[[str], None] = print,
    data: PromptDataset | None = None,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """Run the job's steps; returns the summary. Raises InputError / RewardFailure / RuntimeError.

    With `stop` (installed by the front door), a SIGTERM ends the run at the next step boundary, and the
    summary then holds `preempted` (its `line` is what the front door prints; the exit is 143)."""
    submitted = spec  # what the run's tracked config shows (model.actor: s3://..., not the cache path)
    spec = localized(spec)  # hf:// and s3:// models load from the cache the fetch step filled
    data = data or preflight(spec)
    try:
        info = device.for_job(os.environ)  # the job's pods asked for GPUs; never the head's hardware
    except device.DeviceError as e:
        raise InputError(str(e)) from e
    try:  # a GPU-only backend under the CPU stand-in fails before Ray, as bad input (no restart)
        choose_backend(spec.weight_sync.backend, info)
    except ValueError as e:
        raise InputError(str(e)) from e
    metrics = TrainerExporter(job)
    # The stall clock runs from here, at the start-up timeout until the first step completes.
    metrics.driver_started(spec.monitoring)
    metrics.total_steps.labels(job).set(spec.algorithm.total_steps)
    if spec.rollout.agent is not None:
        metrics.agentic()
    port = (
        metrics_port
        if metrics_port is not None
        else int(os.environ.get(METRICS_PORT_ENV) or spec.monitoring.metrics_port)
    )
    # Before /metrics is served: a restarted attempt reports the step it will resume from, not 0, for
    # the minute its start-up takes (`kubectl get rlhf` never shows 0/N mid-run).
    announced = resume_point(spec, job)
    if announced >= spec.algorithm.total_steps:
        done = (
            f"nothing to do: {spec.checkpoint.path} already holds step {announced}, the last of "
            f"algorithm.totalSteps {spec.algorithm.total_steps} (raise totalSteps to train on)"
        )
        log(done)
        nothing: dict[str, Any] = {"job": job, "steps": [], "checkpoints": [], "resumed_from": announced}
        exported = _export_if_stale(spec, announced, log, metrics)  # a run killed mid-export finishes it here
        return {**nothing, "message": done, **({"export": exported} if exported else {})}
    metrics.resumed(announced)
    if announced:
        metrics.checkpointed(announced)
    if port:
        metrics.serve(port)
        log(f"metrics on :{port}/metrics")
    budget = stop_budget(os.environ, spec.run_policy.termination_grace_period_seconds)
    if stop is not None and stop.requested:  # before anything slow starts
        return _stopped_before_training(job, announced, log)
    log(device.describe(info))
    started = connect_ray(process_count(spec) + 1, device_plan.most_gpus(spec) if info.is_cpu else 0)
    if stop is not None:
        stop.install()  # ray.init replaced it with Ray's own (which exits at once)
    stacks_dump.arm("driver", "driver")
    watch: PhaseWatchdog | None = None
    tracker = Tracker.start(submitted, job, metrics.tracking)  # its threads only; a sink connects in its own
    if tracker is not None:
        log(f"tracking to {', '.join(spec.tracking.sinks()) if spec.tracking else ''}")
    placed: Placed | None = None
    sync: WeightSyncManager | None = None
    ctx: StepContext | None = None
    try:
        try:  # a SIGTERM ends the start-up at once: nothing is trained or written yet
            with stop.interruptible() if stop is not None else nullcontext():
                placed = place(spec, info, log)
                start(placed, spec, metrics, log)
        except KeyboardInterrupt:  # what Ray's blocking calls make of StopDuringStartUp
            if stop is None or not stop.requested:
                raise
            log(
                f"stop requested {stop.elapsed():.1f} s ago (SIGTERM x{stop.signals}) during start-up: "
                "nothing of this attempt is trained, so it stops now"
            )
            return _stopped_before_training(job, announced, log)
        root = Path(spec.checkpoint.path) if spec.checkpoint.path else None
        faults = FaultInjector.from_env(placed.victim, root)
        on_written = faults.checkpoint_written if faults else None
        checkpointer = Checkpointer(spec, job, data, placed.groups, metrics, log, on_written)
        first = checkpointer.resume()
        metrics.resumed(first - 1 - announced)  # the counter continues from the checkpoint's step
        resumed = bool(checkpointer.resume_info)
        sync = WeightSyncManager(spec, job, info, placed.actor, placed.pool, metrics, log, resumed=resumed)
        sync.while_sending = faults.weights_sending if faults else None
        sync.drop_delta = faults.delta_dropped if faults else None
        watch = hang_watch(spec, log).start()
        ctx = StepContext(
            spec, job, data, placed, sync, checkpointer, metrics, faults, watch, tracker=tracker
        )
        ctx.objective = ObjectiveState.restore(spec, checkpointer.algorithm_state)
        last = (
            spec.algorithm.total_steps
            if steps is None
            else min(spec.algorithm.total_steps, first + steps - 1)
        )
        ctx.last_step = last
        summary: dict[str, Any] = {
            "job": job,
            "steps": [],
            "checkpoints": checkpointer.written,
            "resumed_from": checkpointer.resume_info.get("from_step"),
            "resume": checkpointer.resume_info,
            "engines": [s.info for s in placed.pool.ready()],
        }
        completed = first - 1
        for step in range(first, last + 1):
            if stop is not None and stop.requested:  # it came during start-up: no step to finish
                break
            report = run_step(ctx, step)
            if completed == first - 1 and not info.is_cpu:
                report_fabric(placed, metrics, job, log)  # once, after the first collectives ran
            completed = step
            summary["steps"].append(step_summary(report))
            if report.checkpoint and spec.checkpoint.export == "everyCheckpoint":
                summary["export"] = _export(spec, log, metrics)
            if on_step is not None:
                on_step(report)
            if stop is not None and stop.requested:
                break
        if stop is not None and stop.requested and completed < spec.algorithm.total_steps:
            abandon(ctx)  # the batch generated ahead (async) is not trained: its prompts come again
            summary["preempted"] = stop_at_boundary(ctx, stop, budget, completed, log)
            summary["data_position"] = checkpointer.trained_position or data.position.to_dict()
            return summary
        if last == spec.algorithm.total_steps and spec.checkpoint.export == "onFinish":
            summary["export"] = _export(spec, log, metrics)
        summary["data_position"] = checkpointer.trained_position or data.position.to_dict()
        return summary
    finally:
        if watch is not None:
            watch.close()
        if ctx is not None:
            abandon(ctx)
        if sync is not None:
            sync.close()
        if placed is not None:
            placed.shutdown()
        if started:
            ray.shutdown()
        if tracker is not None:
            tracker.close()  # what is queued, within tracker.CLOSE_SECONDS


def _stopped_before_training(job: str, announced: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The summary of an attempt told to stop before its first step: it keeps the checkpoint it would
    have resumed from (step `announced`, 0: none) and redoes nothing of its own."""
    line = kept_line(announced, announced)
    log(line)
    preempted = {"line": line, "step": announced, "checkpoint_step": announced, "saved": False}
    return {"job": job, "steps": [], "checkpoints": [], "resumed_from": announced, "preempted": preempted}


def stop_at_boundary(
    ctx: StepContext, stop: StopRequest, budget: float, completed: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Told to stop after step `completed`: save its checkpoint if `decide_stop` says it fits, else keep
    the last one. Returns the summary's `preempted` entry; logs its `line`."""
    checkpointer = ctx.checkpointer
    estimate = estimate_save_seconds(checkpointer.save_seconds, checkpointer.resume_info.get("save_seconds"))
    elapsed = stop.elapsed()
    decision = decide_stop(
        on_preemption=ctx.spec.checkpoint.on_preemption,
        has_path=checkpointer.store is not None,
        completed=completed,
        last_checkpoint=checkpointer.last_step,
        save_seconds=estimate,
        elapsed=elapsed,
        budget=budget,
    )
    action = f"saving step {completed}" if decision.save else f"keeping step {checkpointer.last_step}"
    log(
        f"stop requested {elapsed:.1f} s ago (SIGTERM x{stop.signals}) by step {completed}: {action}: {decision.reason}"
    )
    out: dict[str, Any] = {"step": completed, "budget_seconds": budget, "estimated_save_seconds": estimate}
    if decision.save:
        timer = PhaseTimer(ctx.metrics)
        with timer.phase("checkpoint"):
            last = ctx.history[-1]  # step `completed`, saved as its regular checkpoint would have been
            path = checkpointer.save(completed, [asdict(r) for r in ctx.history[:-1]], last.rollout_digest)
        out.update(checkpoint=path, save_seconds=round(timer.seconds["checkpoint"], 3))
        line = saved_line(completed)
    else:
        line = kept_line(checkpointer.last_step, completed)
    log(line)
    out.update(line=line, checkpoint_step=checkpointer.last_step, saved=decision.save)
    out.update(seconds_after_signal=round(stop.elapsed(), 3), signals=stop.signals)
    return out


def _export(
    spec: RLHFJobSpec, log: Callable[[str], None], metrics: TrainerExporter | None = None
) -> str | None:
    """The newest checkpoint's actor to checkpoint.exportDir(), as a Hugging Face model directory, then
    uploaded to checkpoint.exportTo when set."""
    target, root = spec.checkpoint.export_dir(), spec.checkpoint.path
    if target is None or root is None:
        return None
    # The export runs as a Ray task on a trainer node, never in this process: the head has neither the
    # memory for a big actor nor need of it. Before Ray is up (a restart with nothing left to train
    # finishing an interrupted export), connect first rather than export here: on a cluster that is the
    # job's own Ray (cheap); a local run starts a private one, as its training would have.
    started = False if ray.is_initialized() else connect_ray(1)
    try:
        out = export_on_trainer(Path(root), Path(target))
        log(
            f"exported the actor of step {out.step} to {out.path} ({out.tensors} tensors in {out.shards} "
            f"shard(s), {out.dtype}; by pid {out.pid} on {out.host})"
        )
        if spec.checkpoint.export_to:
            _upload(spec, out.path, out.step, log, metrics)
    finally:
        if started:
            ray.shutdown()
    return str(out.path)


def _upload(
    spec: RLHFJobSpec, path: Path, step: int, log: Callable[[str], None], metrics: TrainerExporter | None
) -> None:
    """The export to checkpoint.exportTo, its progress in the metrics; a failure is logged and kept in the
    metrics (status.export.failed), never raised: the local export stands. Then /metrics is held one
    scrape interval more, so that the operator reads the final state before the driver exits."""
    uri = str(spec.checkpoint.export_to)

    def report(p: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.export_uploading(p["bytes_done"], p["bytes_total"], p["done"], p["error"] is not None)

    result = upload_on_trainer(path, uri, step, report)
    if result["error"]:
        log(f"export upload failed, the local export at {path} is kept: {result['error']}")
    else:
        sent, total = result["bytes_sent"], result["bytes_total"]
        log(f"uploaded {path} to {uri} ({sent} of {total} bytes sent, the rest there already)")
    if metrics is not None:
        time.sleep(spec.monitoring.scrape_interval_seconds + 1)


def _export_if_stale(
    spec: RLHFJobSpec, step: int, log: Callable[[str], None], metrics: TrainerExporter | None = None
) -> str | None:
    target = spec.checkpoint.export_dir()
    if target is None:
        return None
    info = Path(target) / EXPORT_INFO
    try:
        current = json.loads(info.read_text()).get("step") == step
    except (OSError, ValueError):
        current = False
    if not current:
        return _export(spec, log, metrics)
    if spec.checkpoint.export_to:  # the export is there; its upload may not have finished (idempotent)
        started = False if ray.is_initialized() else connect_ray(1)
        try:
            _upload(spec, Path(target), step, log, metrics)
        finally:
            if started:
                ray.shutdown()
    return target


def report_fabric(placed: Placed, metrics: TrainerExporter, job: str, log: Callable[[str], None]) -> None:
    """Each trainer rank's NCCL network (stacks.nccl) as rlhf_nccl_transport and one log line; the
    operator sets FabricDegraded from it when the job asked for RDMA. Best effort: never fails a run."""
    try:
        found = [t for g in placed.groups for t in g.get("nccl_transport")]
    except Exception as e:
        log(f"fabric: cannot read the ranks' NCCL transport: {type(e).__name__}: {e}")
        return
    for t in found:
        metrics.nccl_transport.labels(job, t["who"], t["network"] or "unknown").set(1)
    said = ", ".join(f"{t['who']} over {t['network'] or 'unknown'}" for t in found)
    log(f"fabric: NCCL {said}")


WATCH_FLOOR_ENV, WATCH_FACTOR_ENV = "RLHF_HANG_WATCH_FLOOR_SECONDS", "RLHF_HANG_WATCH_FACTOR"


def hang_watch(spec: RLHFJobSpec, log: Callable[[str], None]) -> PhaseWatchdog:
    """The driver's hang watch (stacks.watchdog): a phase past max(floor, factor x its longest run so
    far) gets a snapshot, its verdict in the log and the dump under checkpoint.path/stacks/. Floor 300 s
    and factor 5 unless RLHF_HANG_WATCH_FLOOR_SECONDS / RLHF_HANG_WATCH_FACTOR say otherwise."""

    def report(phase: str, step: int, running: float, snap: dict[str, Any]) -> None:
        lines = list(snap.get("verdict") or [])
        log(
            f"hang watch: phase {phase} of step {step} has run {running:.0f} s, past its deadline; "
            f"stacks of {len(snap.get('processes') or [])} processes:"
        )
        for line in lines:
            log(f"  {line}")
        if spec.checkpoint.path:
            where = Path(spec.checkpoint.path) / "stacks" / f"step-{step}-{phase}.json"
            try:
                where.parent.mkdir(parents=True, exist_ok=True)
                where.write_text(json.dumps(snap, indent=1))
                log(f"hang watch: the whole snapshot is in {where}")
            except OSError as e:
                log(f"hang watch: cannot keep the snapshot in {where}: {e}")

    return PhaseWatchdog(
        lambda: annotate(snapshot()),
        report,
        floor=float(os.environ.get(WATCH_FLOOR_ENV) or 300.0),
        factor=float(os.environ.get(WATCH_FACTOR_ENV) or 5.0),
    )


def step_summary(report: StepReport) -> dict[str, Any]:
    return {
        "step": report.step,
        "reward_mean": report.reward_mean,
        "kl": report.kl,
        "phase_seconds": report.phase_seconds,
        "step_seconds": report.step_seconds,
        "tokens_per_second": report.tokens_per_second,
        "generated_tokens": report.generated_tokens,
        "trained_tokens": report.trained_tokens,
        "reward_errors": report.reward_errors,
        "valid_samples": report.valid_samples,
        "weight_sync_bytes": report.weight_sync_bytes,
        "checkpoint": report.checkpoint,
        "training": report.training,
        "rollout_digest": report.rollout_digest,
        "engines": report.engines,
        "staleness": report.staleness,
        "stale_samples": report.stale_samples,
        "trainer_idle_ratio": report.trainer_idle_ratio,
        "rollout_idle_ratio": report.rollout_idle_ratio,
        "generating_seconds": report.generating_seconds,
        "dynamic_sampling": report.dynamic_sampling,
        "agent": report.agent,
        "weight_sync": report.weight_sync,
        **eval_fields(report),
        "eval": report.evaluation,
    }


def eval_fields(report: StepReport) -> dict[str, Any]:
    """The evaluation's headline figures for a step report, on a step that evaluated only:
    `eval_reward_mean`, and `eval_reward_mean_by_data_source` when data.eval has a data_source column."""
    e = report.evaluation
    if not e:
        return {}
    out: dict[str, Any] = {"eval_reward_mean": e["reward_mean"]}
    if "by_data_source" in e:
        out["eval_reward_mean_by_data_source"] = e["by_data_source"]
    return out


# ---------------------------------------------------------------------------------------------- main


def _say(line: str, stream: TextIO | None = None) -> None:
    """A line for the Ray job's log and, in a head pod, for `kubectl logs` too. Written with its newline
    in one write: Ray prints the workers' lines into this same stdout from a thread of its own, and
    `print` writes the newline apart, so a worker's line could land inside one of ours (a step report
    followed by an engine's log line on one line broke its JSON)."""
    out = sys.stdout if stream is None else stream
    out.write(line + "\n")
    out.flush()
    container_log.echo(line)


def main(argv: list[str] | None = None, stop: StopRequest | None = None) -> int:
    """The entrypoint. From its start a SIGTERM stops the run at a step boundary (stop.py): through `stop`
    if given (installed by the caller, and left installed), else through one installed here and put back
    on return (an in-process caller)."""
    p = argparse.ArgumentParser(prog="python -m rlhf_trainer.driver", description=__doc__)
    p.add_argument("--job-name", default=os.environ.get(JOB_NAME_ENV, "local"))
    p.add_argument("--spec-json")
    p.add_argument("--spec-env")
    p.add_argument("--spec-file")
    p.add_argument("--steps", type=int)
    p.add_argument("--summary-json")
    args = p.parse_args(argv)
    own = stop is None
    stop = stop or StopRequest().install()
    try:
        fail_at_start()
        spec = load_spec_arg(args)
        summary = run(
            spec,
            args.job_name,
            steps=args.steps,
            stop=stop,
            log=_say,  # the device map and start-up lines reach `kubectl logs` of the head too
            on_step=lambda r: _say(
                json.dumps(
                    {
                        "step": r.step,
                        "reward_mean": round(r.reward_mean, 4),
                        "phase_seconds": {k: round(v, 3) for k, v in r.phase_seconds.items()},
                        "engines": r.engines,
                        **eval_fields(r),
                    }
                )
            ),
        )
    except InputError as e:
        # Disconnected first: workers' output streamed to this driver (a killed actor's dump) must not
        # land after the `error:` line, which the operator reads from the log's tail.
        if ray.is_initialized():
            ray.shutdown()
        _say(f"error: {e}", sys.stderr)
        return INPUT_ERROR_EXIT_CODE  # the operator fails the job with this line, without a restart
    except Exception as e:
        # Not a bad input: the trace says where (the job's log is where an operator will look).
        traceback.print_exc(file=sys.stderr)
        _say(f"error: {type(e).__name__}: {e}", sys.stderr)
        return 1
    finally:
        if own:
            stop.restore()
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=1))
    if "preempted" in summary:
        container_log.echo(summary["preempted"]["line"])  # run() printed it; `kubectl logs` shows it too
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    import gc

    gc.enable()  # disabled for the imports (top of the module)
    # Installed until the process ends: a SIGTERM that comes while it exits (a second stop request) is
    # only counted, so the exit status stays 143 (or 0), never "killed by SIGTERM".
    raise SystemExit(main(stop=StopRequest().install()))
