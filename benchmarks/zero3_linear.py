"""A ZeRO-3 training step on CPU: DeepSpeed's memory-efficient linear against torch's, and plain torch.

The same model (e2e_vs_trl.py's medium Llama: 21M parameters), the same batch (32 samples x 130 tokens)
and the same step (forward, token log-likelihood loss, backward, gradient clipping at 1.0, AdamW) in
three ways, each in a fresh process (DeepSpeed's linear replaces `torch.nn.functional.linear` for the
whole process), the ways interleaved over the repeats:
- `plain`: the Hugging Face model and torch's AdamW, no DeepSpeed (the baseline, as TRL trains on CPU);
- `zero3_ds_linear`: our engine as built before, a 1-rank ZeRO-3 DeepSpeed engine over gloo whose linears
  are DeepSpeed's `LinearFunctionForZeroStage3` (`memory_efficient_linear`, DeepSpeed's default);
- `zero3_torch_linear` (ours): the same engine with torch's linear, as `build_engine` now builds on CPU.

Measured: the process CPU seconds per step (both threads; steadier than wall time on a shared machine)
and the wall seconds. RESULT: `zero3_cpu_over_plain_ds_linear`, `zero3_cpu_over_plain_torch_linear`
(CPU per step over plain torch's) and `torch_linear_speedup` (CPU per step, DeepSpeed's linear over
torch's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from lib import common, grpo

WAYS = ("plain", "zero3_ds_linear", "zero3_torch_linear")


def child(way: str, steps: int, threads: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1",
        LOCAL_RANK="0", DS_ACCELERATOR="cpu",
    )  # fmt: skip
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    path = str(grpo.model_dir(1) / "model")
    ids = torch.randint(3, 512, (32, 130), generator=torch.Generator().manual_seed(0))

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        return -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()

    if way == "plain":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

        def step() -> None:
            loss_of(model).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    else:
        from rlhf_trainer.workers.deepspeed_utils import ds_config, import_deepspeed, load_hf_model

        deepspeed = import_deepspeed()
        deepspeed.init_distributed("gloo")
        cfg = ds_config(
            zero_stage=3, micro_batch=32, grad_accum=1, world_size=1, bf16=False, offload=False, train=True,
            memory_efficient_linear=way == "zero3_ds_linear",
        )  # fmt: skip
        model, keep = load_hf_model(path, "causal_lm", cfg, torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        del keep

        def step() -> None:
            engine.backward(loss_of(engine))
            engine.step()

    for _ in range(2):  # warm-up
        step()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    cpu, wall = (time.process_time() - c0) / steps, (time.perf_counter() - t0) / steps
    print("CHILD " + json.dumps({"cpu_s": cpu, "wall_s": wall}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per way (interleaved)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per process, after 2 warm-up steps")
    p.add_argument("--threads", type=int, default=2, help="torch threads (a CPU rank's: the cores)")
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.steps, args.threads)
        return 0
    common.print_machine()
    grpo.model_dir(1)
    got: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    for r in range(args.repeats):
        for way in WAYS if r % 2 == 0 else tuple(reversed(WAYS)):
            cmd = [sys.executable, __file__, "--child", way, "--steps", str(args.steps)]
            proc = subprocess.run([*cmd, "--threads", str(args.threads)], capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD ")]
            if proc.returncode or not lines:
                common.fail(f"{way} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            got[way].append(json.loads(lines[-1][len("CHILD ") :]))
            common.console.print(f"[dim]repeat {r + 1} {way}: {got[way][-1]}[/dim]")
    cpu = {w: common.median([x["cpu_s"] for x in got[w]]) for w in WAYS}
    wall = {w: common.median([x["wall_s"] for x in got[w]]) for w in WAYS}
    common.table(
        f"one training step, 32 x 130 tokens, 21M-parameter Llama, {args.threads} threads "
        f"(medians over {args.repeats} processes x {args.steps} steps)",
        ["way", "CPU s/step", "wall s/step", "CPU over plain"],
        [[w, cpu[w], wall[w], cpu[w] / cpu["plain"]] for w in WAYS],
    )
    common.result(
        {
            "zero3_cpu_over_plain_ds_linear": round(cpu["zero3_ds_linear"] / cpu["plain"], 3),
            "zero3_cpu_over_plain_torch_linear": round(cpu["zero3_torch_linear"] / cpu["plain"], 3),
            "torch_linear_speedup": round(cpu["zero3_ds_linear"] / cpu["zero3_torch_linear"], 3),
            "plain_cpu_s": round(cpu["plain"], 3),
            "plain_wall_s": round(wall["plain"], 3),
            "zero3_torch_linear_wall_s": round(wall["zero3_torch_linear"], 3),
            "zero3_ds_linear_wall_s": round(wall["zero3_ds_linear"], 3),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
