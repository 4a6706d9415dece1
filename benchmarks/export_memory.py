"""The driver's memory while it exports the actor: a Ray task off the head vs the whole model in the driver.

Issue 33, item 5 (docs/benchmarks.md). Two models made offline with random weights: the tiny Llama and
one of SmolLM-135M's shapes (hidden 576, 30 layers, 9 heads / 3 KV heads, vocabulary 49,152, tied
embeddings, bfloat16 on disk). Each gets a real ZeRO-3 checkpoint written by the trainer's own rank code
(benchmarks/lib/zero_checkpoint.py). Ours is the driver's path (`driver._export`: the streaming exporter
as a Ray task); the baseline is the export as it was before (`old_export_actor` below: DeepSpeed's whole
fp32 state dict, a full transformers model and `save_pretrained`, all in the calling process). Each
measurement runs in a fresh process; the number is that process's peak RSS (VmHWM, reset through
/proc/self/clear_refs just before the export) less its RSS then. Goal: <= 100 MiB for both models.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from lib import common, zero_checkpoint

GOAL_MIB = 100.0
WORK = Path(os.environ.get("RLHF_BENCH_EXPORT", "/tmp/rlhf-bench-export"))
MODELS = ("tiny", "135m")
EXAMPLE = common.ROOT / "examples" / "rlhfjob-tiny.yaml"


def old_export_actor(checkpoint: Path, outdir: Path) -> dict[str, Any]:
    """The baseline: export.py's `export_actor` before issue 33 (whole state dict, whole model, here)."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from rlhf_trainer.export import find_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _, path, state = find_checkpoint(checkpoint)
    base = (state.get("identity") or {})["model.actor"]
    config = AutoConfig.from_pretrained(base)
    torch_dtype = getattr(config, "dtype", None) or torch.float32
    weights = get_fp32_state_dict_from_zero_checkpoint(str(path), tag="actor")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    result = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    assert not (set(result.missing_keys) - tied) and not result.unexpected_keys
    model = model.to(torch_dtype)
    outdir = outdir.resolve()
    tmp = outdir.parent / f".tmp-{outdir.name}"
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    if outdir.exists():
        shutil.rmtree(outdir)
    os.rename(tmp, outdir)
    return {"pid": os.getpid(), "tensors": len(weights)}


def make_models() -> dict[str, Path]:
    """The two base models and their checkpoints under WORK (made once, reused by later runs)."""
    import torch
    from rlhf_trainer.tiny_model import build_tokenizer, make_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM

    roots = {m: WORK / m for m in MODELS}
    if not (roots["tiny"] / "base" / "config.json").is_file():
        make_tiny_model(roots["tiny"] / "made")
        shutil.copytree(roots["tiny"] / "made" / "model", roots["tiny"] / "base", dirs_exist_ok=True)
    base = roots["135m"] / "base"
    if not (base / "config.json").is_file():
        tok: Any = build_tokenizer(512)
        config = LlamaConfig(  # SmolLM-135M's shapes
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[no-untyped-call,arg-type]
        model.save_pretrained(base)
        tok.save_pretrained(base)
        del model
    for root in roots.values():
        if not (root / "ckpt" / "step-00000001" / "trainer_state.json").is_file():
            shutil.rmtree(root / "ckpt", ignore_errors=True)
            zero_checkpoint.write(root / "base", root / "ckpt")
    return roots


def _pid() -> int:
    return os.getpid()


def child(way: str, model: str) -> None:
    """One export in this fresh process; prints `CHILD {json}`."""
    # What a driver has loaded anyway, and what the baseline would import: not counted as export memory.
    import deepspeed.utils.zero_to_fp32  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    root = WORK / model
    out = WORK / "exports" / f"{model}-{way}"
    worker_peak_mib = float("nan")
    if way == "ours":
        import ray
        from rlhf_trainer import driver
        from rlhf_trainer.cli import apply_overrides
        from rlhf_trainer.config import parse_spec
        from yaml import safe_load

        sets = [
            f"model.actor={root / 'base'}",
            f"checkpoint.path={root / 'ckpt'}",
            f"checkpoint.exportPath={out}",
        ]
        spec = parse_spec(apply_overrides(safe_load(EXAMPLE.read_text()), sets)["spec"])
        common.start_ray(num_cpus=4)
        ray.get(ray.remote(_pid).remote())  # a worker is up: Ray's own start is not the export's
        lines: list[str] = []
        Path("/proc/self/clear_refs").write_text("5")
        before = common.status_kib("VmRSS")
        t0 = time.perf_counter()
        driver._export(spec, lines.append)
        seconds = time.perf_counter() - t0
        peak = common.status_kib("VmHWM")
        # "exported the actor of step 1 to DIR (N tensors in S shard(s), DTYPE; by pid P on HOST)"
        said = re.search(r"\((\d+) tensors in (\d+) shard\(s\), \w+; by pid (\d+) on ", lines[-1])
        assert said, lines
        tensors, shards, pid = (int(g) for g in said.groups())
        with contextlib.suppress(OSError, RuntimeError):  # the Ray worker, still alive in the pool
            worker_peak_mib = common.status_kib("VmHWM", pid) / 1024
        ray.shutdown()
    else:
        Path("/proc/self/clear_refs").write_text("5")
        before = common.status_kib("VmRSS")
        t0 = time.perf_counter()
        info = old_export_actor(root / "ckpt", out)
        seconds = time.perf_counter() - t0
        peak = common.status_kib("VmHWM")
        pid, tensors, shards = info["pid"], info["tensors"], 1
    common.child_result(
        {
            "before_mib": before / 1024,
            "peak_mib": peak / 1024,
            "growth_mib": (peak - before) / 1024,
            "seconds": seconds,
            "other_process": pid != os.getpid(),
            "exporter_peak_mib": worker_peak_mib,
            "tensors": tensors,
            "shards": shards,
        }
    )


def same_weights(a: Path, b: Path) -> bool:
    """The two exports hold the same tensors (names, dtypes, values), however they are sharded."""
    import torch
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
        return out

    ta, tb = tensors(a), tensors(b)
    return set(ta) == set(tb) and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    p.add_argument("--model", choices=MODELS, default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.model)
        return

    common.print_machine()
    t0 = time.perf_counter()
    make_models()
    print(f"models and checkpoints ready under {WORK} in {time.perf_counter() - t0:.0f} s")
    ways = ["ours", "baseline"]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    env = {**os.environ, "RLHF_BENCH_EXPORT": str(WORK)}
    for i in range(args.repeats):
        for way in ways[i % 2 :] + ways[: i % 2]:
            for model in MODELS:
                r = common.run_child(__file__, way, 0, {"model": model}, env, timeout=1800)
                runs.setdefault((way, model), []).append(r)

    def med(way: str, model: str, key: str) -> float:
        return common.median([float(r[key]) for r in runs[(way, model)]])

    label = {"ours": "ours: Ray task (driver._export)", "baseline": "baseline: whole model in the driver"}
    rows = []
    for way in ways:
        for model in MODELS:
            r = runs[(way, model)][0]
            rows.append(
                [
                    f"{label[way]}, {model}",
                    r["tensors"],
                    r["shards"],
                    med(way, model, "before_mib"),
                    med(way, model, "peak_mib"),
                    med(way, model, "growth_mib"),
                    med(way, model, "exporter_peak_mib") if way == "ours" else med(way, model, "peak_mib"),
                    med(way, model, "seconds"),
                ]
            )
    common.table(
        f"Export of a ZeRO-3 checkpoint's actor; medians of {args.repeats} fresh processes each",
        [
            "way, model",
            "tensors",
            "shards",
            "driver RSS before MiB",
            "driver peak MiB",
            "driver growth MiB",
            "exporting process peak MiB",
            "seconds",
        ],
        rows,
    )
    equal = {
        m: same_weights(WORK / "exports" / f"{m}-ours", WORK / "exports" / f"{m}-baseline") for m in MODELS
    }
    off = all(r["other_process"] for r in runs[("ours", "tiny")] + runs[("ours", "135m")])
    print(f"same weights as the baseline's export: {equal}; ours ran in another process every time: {off}")
    ours = {m: round(max(float(r["growth_mib"]) for r in runs[("ours", m)]), 1) for m in MODELS}
    common.result(
        {
            "driver_rss_growth_mib_tiny": ours["tiny"],
            "driver_rss_growth_mib_135m": ours["135m"],
            "baseline_rss_growth_mib_tiny": round(med("baseline", "tiny", "growth_mib"), 1),
            "baseline_rss_growth_mib_135m": round(med("baseline", "135m", "growth_mib"), 1),
            "exporter_peak_mib_135m": round(med("ours", "135m", "exporter_peak_mib"), 1),
            "seconds_tiny": round(med("ours", "tiny", "seconds"), 2),
            "seconds_135m": round(med("ours", "135m", "seconds"), 2),
            "baseline_seconds_tiny": round(med("baseline", "tiny", "seconds"), 2),
            "baseline_seconds_135m": round(med("baseline", "135m", "seconds"), 2),
            "same_weights": all(equal.values()),
            "goal_mib": GOAL_MIB,
            "goal_met": off and all(equal.values()) and max(ours.values()) <= GOAL_MIB,
        }
    )


if __name__ == "__main__":
    main()
