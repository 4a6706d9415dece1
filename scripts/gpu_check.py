"""The GPU check (issue 33, item 9): the project's bf16 objectives, CUDA-IPC weight channel and bucketed
packing on one accelerator, in one short run that needs only torch. Prints a table and one `RESULT {json}`
line; exits 1 when a check fails, 2 when `--device cuda` sees no GPU. Must not start Ray or import vLLM.

What it loads: the repository's trainer_image/ goes first on sys.path, and it imports the project's own
rlhf_trainer.algorithms, .transfer, .workers.deepspeed_utils (response_logprobs; DeepSpeed and
transformers are imported only inside functions not called here), .weight_sync.bucketing and
.weight_sync.cuda_ipc: their module-level imports are torch and each other. The run fails if vLLM, Ray,
DeepSpeed or transformers got imported anyway, so a regression shows in the unit stage, where
`--device cpu --quick` runs (tests/trainer/test_gpu_check.py), not on the device machine.

- Objectives: each project function on the same seeded inputs (rounded to bf16), in bf16 on the device
  and in float64 on the CPU; a row passes when every element is finite and |dev - ref| <= TOL * scale,
  scale being 1 + |ref| per element, or for an aggregated loss 1 + the mean |token loss| it sums (GRPO's loss
  is a mean of cancelling terms, near 0, so its own size is no measure). Where a function casts to float32 itself
  (response_logprobs, group_normalised_scores) the reference carries that rounding, 1e-7, far under TOL.
- Weight channel: this process (rank 0) packs a synthetic model into buckets and sends them to a spawned
  rank 1 through the project's CudaIpcChannel, whose send/recv/done_with run as written: only its
  constructor (vLLM's StatelessProcessGroup) is replaced by QueueGroup. With `--device cpu`, torch's CPU
  shared memory stands in. Rank 1 compares every unpacked tensor's bytes with its own regeneration.
- Bandwidth: plan_buckets + StagingBuffer + pack_bucket, as workers/policy.py packs for NCCL, against one
  `Tensor.copy_` of the same bytes on the same device. On CUDA packing must reach MIN_PACKING_RATIO of
  copy (a host round trip, PCIe-bound, is a few percent of an H100's); on the CPU the ratio is only shown.

`--break NAME` is for testing the check itself: it shifts one objective row's device result by 0.1 of its
scale, or (`weight_channel`) flips one bit of the first bucket after packing; that row must then fail.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing.synchronize
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))  # the code under test

import rlhf_trainer
from rlhf_trainer import algorithms
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.weight_sync.bucketing import (
    Bucket,
    StagingBuffer,
    dtype_from_name,
    pack_bucket,
    plan_buckets,
    plan_bytes,
    unpack_bucket,
)
from rlhf_trainer.weight_sync.cuda_ipc import CudaIpcChannel
from rlhf_trainer.workers.deepspeed_utils import response_logprobs

REPO = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("vllm", "ray", "deepspeed", "transformers")
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7
TOL = 4 * BF16_EPS  # 0.031: bf16 on the CPU reaches 0.011 at most (ppo_value_loss), 3x under it
MIN_PACKING_RATIO = 0.05
CLIP = 0.2
SEED = 1234
WAIT_S = 120.0  # the longest one side of the weight channel waits for the other
BREAK = 0.1  # --break's shift, in units of the row's scale: 3.2 x TOL


@dataclass(frozen=True)
class Profile:
    """Sizes of one run: the objectives' batch, the log-prob model and the synthetic model to sync."""

    batch: int
    tokens: int
    lm_batch: int
    lm_tokens: int
    lm_vocab: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    bucket_mib: int
    reps: int


PROFILES: dict[tuple[str, bool], Profile] = {
    # the synthetic model: 713 MiB in 219 tensors on CUDA, 155 MiB in 75 (--quick); 16 and 2.5 MiB on the CPU
    ("cuda", False): Profile(256, 1024, 16, 512, 8192, 1024, 2816, 24, 32000, 64, 10),
    ("cuda", True): Profile(64, 256, 8, 256, 4096, 768, 2048, 8, 16000, 32, 5),
    ("cpu", False): Profile(64, 256, 8, 128, 2048, 256, 704, 8, 4000, 4, 5),
    ("cpu", True): Profile(32, 128, 4, 64, 1024, 128, 352, 4, 2000, 1, 3),
}


# ---- objectives -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    name: str
    max_abs_err: float
    max_scaled_err: float
    tol: float
    ok: bool


def objective_inputs(p: Profile, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Seeded inputs in float64, already rounded to bf16 so both sides start from the same numbers.

    Log-probs near the old and reference policies, 1% of tokens far off both (|log-ratio| 25: the
    clamps), ragged masks, GRPO groups of 8 samples with continuous scores."""
    b, t = p.batch, p.tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).to(torch.float64)

    base = -torch.empty(b, t, dtype=torch.float64).exponential_(1.0, generator=gen)
    far = torch.rand(b, t, generator=gen) < 0.01
    logprobs = torch.where(far, base + 25.0 * torch.sign(randn(b, t)), base + 0.1 * randn(b, t))
    lens = torch.randint(1, t + 1, (b,), generator=gen)
    return {
        "logprobs": rounded(logprobs),
        "ref_logprobs": rounded(base),
        "old_logprobs": rounded(base + 0.05 * randn(b, t)),
        "behaviour_logprobs": rounded(base + 0.3 * randn(b, t)),
        "advantages": rounded(randn(b, t)),
        "values": rounded(randn(b, t)),
        "old_values": rounded(randn(b, t)),
        "returns": rounded(randn(b, t)),
        "scores": rounded(randn(b)),
        "groups": torch.arange(b) // 8,
        "lens": lens,
        "mask": (torch.arange(t).unsqueeze(0) < lens.unsqueeze(1)).to(torch.float64),
    }


def _grpo_advantages(x: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return algorithms.grpo(x["scores"], x["groups"], [int(n) for n in x["lens"]]).advantages


# A row: (result, None) for a per-token result; (result, the masked token terms it aggregates) for a loss.
Objective = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor | None]]


def objective_functions() -> dict[str, Objective]:
    """Row name -> the project's functions applied to one input set (any device, any dtype)."""
    a = algorithms

    def ppo_tokens(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return a.policy_loss_tokens(x["logprobs"], x["old_logprobs"], x["advantages"], CLIP)[0]

    def ppo_loss(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss = ppo_tokens(x)
        return a.aggregate_loss(loss, x["mask"], "token-mean"), loss[x["mask"].bool()]

    def grpo_loss(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        adv = torch.zeros_like(x["logprobs"])
        for i, row in enumerate(_grpo_advantages(x)):
            adv[i, : row.numel()] = row.to(adv)
        loss, _ = a.policy_loss_tokens(x["logprobs"], x["old_logprobs"], adv, CLIP)
        return a.aggregate_loss(loss, x["mask"], "seq-mean-token-mean"), loss[x["mask"].bool()]

    def kl(kind: str) -> Objective:
        return lambda x: (a.kl_per_token(x["logprobs"], x["ref_logprobs"], kind), None)

    return {
        "kl_k1": kl("k1"),
        "kl_k2": kl("k2"),
        "kl_k3": kl("k3"),
        "ppo_token_loss": lambda x: (ppo_tokens(x), None),
        "ppo_decoupled_loss": lambda x: (
            ppo_tokens(x)
            * a.rollout_weights(
                x["old_logprobs"], x["behaviour_logprobs"], x["mask"], "token", "mask", 0.0, 5.0
            )[0],
            None,
        ),
        "ppo_clip_higher_dual_clip": lambda x: (
            a.ppo_tokens(x["logprobs"], x["old_logprobs"], x["advantages"], CLIP, 0.28, 3.0).loss,
            None,
        ),
        "ppo_value_loss": lambda x: (
            a.value_loss_tokens(x["values"], x["old_values"], x["returns"], CLIP),
            None,
        ),
        "ppo_loss": ppo_loss,
        "grpo_advantages": lambda x: (torch.cat(_grpo_advantages(x)), None),
        "grpo_loss": grpo_loss,
    }


class TinyLM(torch.nn.Module):
    """Just enough of a causal LM for response_logprobs: forward(input_ids, ...) -> .logits."""

    def __init__(self, vocab: int, hidden: int, gen: torch.Generator) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab, hidden, generator=gen))
            self.head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * (3.0 / math.sqrt(hidden)))

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(torch.tanh(self.embed(input_ids))))


def logprob_rows(p: Profile, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """response_logprobs of a packed rollout: (bf16 model on the device, its float64 copy on the CPU)."""
    model = TinyLM(p.lm_vocab, p.hidden, gen).to(torch.bfloat16)
    seq_lens = torch.randint(p.lm_tokens // 2, p.lm_tokens + 1, (p.lm_batch,), generator=gen)
    prompt_lens = torch.randint(1, p.lm_tokens // 4 + 1, (p.lm_batch,), generator=gen)
    rollout = PackedRollout(
        tokens=torch.randint(1, p.lm_vocab, (int(seq_lens.sum()),), generator=gen),
        seq_lens=seq_lens,
        prompt_lens=prompt_lens,
        group=torch.arange(p.lm_batch),
        rollout_logprobs=torch.zeros(int((seq_lens - prompt_lens).sum())),
    )
    with torch.no_grad():
        dev = response_logprobs(model.to(device), rollout, 0, p.lm_batch, pad_id=0).packed()
        ref = response_logprobs(model.to("cpu", torch.float64), rollout, 0, p.lm_batch, pad_id=0).packed()
    return dev, ref


def compare(name: str, dev: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, broken: bool) -> Row:
    """|dev - ref| / scale against TOL, every element finite; `broken` first shifts dev by BREAK * scale."""
    d = dev.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if broken:
        d = d + BREAK * scale
    if d.shape != r.shape or d.numel() == 0 or not bool(torch.isfinite(d).all() & torch.isfinite(r).all()):
        return Row(name, math.inf, math.inf, TOL, False)
    diff = (d - r).abs()
    scaled = float((diff / scale).max())
    return Row(name, float(diff.max()), scaled, TOL, scaled <= TOL)


def check_objectives(p: Profile, device: torch.device, broken: list[str]) -> list[Row]:
    gen = torch.Generator().manual_seed(SEED)
    inputs = objective_inputs(p, gen)

    def on(dev: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {k: v.to(dev, dtype) if v.is_floating_point() else v.to(dev) for k, v in inputs.items()}

    on_device, on_cpu = on(device, torch.bfloat16), on(torch.device("cpu"), torch.float64)
    rows = []
    with torch.no_grad():
        for name, fn in objective_functions().items():
            dev, _ = fn(on_device)
            ref, terms = fn(on_cpu)
            scale = 1.0 + (ref.abs() if terms is None else terms.abs().mean())
            rows.append(compare(name, dev, ref, scale, name in broken))
        dev_lp, ref_lp = logprob_rows(p, gen, device)
    rows.append(
        compare(
            "response_logprobs", dev_lp, ref_lp, 1.0 + ref_lp.double().abs(), "response_logprobs" in broken
        )
    )
    return rows


# ---- the synthetic model ----------------------------------------------------------------------------


def synthetic_model(p: Profile) -> list[tuple[str, torch.Tensor]]:
    """A decoder's parameter list (bf16 matrices, float32 norms) filled with seeded random bytes, so the
    channel's comparison covers every bit pattern (NaN payloads and denormals included). On the CPU."""
    h, m = p.hidden, p.intermediate
    shapes: list[tuple[str, tuple[int, ...], torch.dtype]] = [
        ("model.embed_tokens.weight", (p.vocab, h), torch.bfloat16)
    ]
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        shapes += [(pre + n, (h, h), torch.bfloat16) for n in ("q", "k", "v", "o")]
        shapes += [(pre + "gate", (m, h), torch.bfloat16), (pre + "up", (m, h), torch.bfloat16)]
        shapes += [(pre + "down", (h, m), torch.bfloat16)]
        shapes += [(pre + n, (h,), torch.float32) for n in ("input_norm", "post_norm")]
    shapes += [("model.norm.weight", (h,), torch.float32), ("lm_head.weight", (p.vocab, h), torch.bfloat16)]
    gen = torch.Generator().manual_seed(SEED + 1)
    out = []
    for name, shape, dtype in shapes:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        out.append((name, raw.view(dtype).view(shape)))
    return out


def model_plan(model: list[tuple[str, torch.Tensor]], p: Profile) -> list[Bucket]:
    return plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in model], p.bucket_mib << 20)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


# ---- the weight channel -----------------------------------------------------------------------------


class QueueGroup:
    """Stands in for vLLM's StatelessProcessGroup between two processes: broadcast_obj from rank 0 and
    barrier, over a torch.multiprocessing queue and barrier (the queue's pickler shares CPU tensors)."""

    def __init__(self, rank: int, q: Any, barrier: multiprocessing.synchronize.Barrier) -> None:
        self.rank = rank
        self.q = q
        self._barrier = barrier

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        if self.rank == src:
            self.q.put(obj)
            return obj
        return self.q.get(timeout=WAIT_S)

    def barrier(self) -> None:
        self._barrier.wait(timeout=WAIT_S)


class SharedMemoryChannel:
    """The CPU stand-in for CudaIpcChannel: each bucket is packed into fresh CPU shared memory and its
    handle (a file descriptor) crosses the queue; the receiver maps the same pages."""

    def __init__(self, rank: int, pg: QueueGroup) -> None:
        self.rank = rank
        self.pg = pg

    def staging(self, bucket: Bucket, index: int) -> torch.Tensor:
        del index
        flat = torch.empty(bucket.numel, dtype=dtype_from_name(bucket.dtype))
        flat.share_memory_()  # type: ignore[no-untyped-call]
        return flat

    def send(self, flat: torch.Tensor, index: int) -> None:
        self.pg.broadcast_obj((index, flat), src=0)
        self.pg.barrier()

    def recv(self, bucket: Bucket, index: int) -> torch.Tensor:
        got, flat = self.pg.broadcast_obj(None, src=0)
        if got != index or flat.numel() != bucket.numel:
            raise RuntimeError(f"shared-memory stand-in out of order: expected bucket {index}, got {got}")
        tensor: torch.Tensor = flat
        return tensor

    def done_with(self, index: int) -> None:
        del index
        self.pg.barrier()


def open_channel(device: torch.device, rank: int, pg: QueueGroup) -> Any:
    """The project's CudaIpcChannel on CUDA (its constructor only builds the vLLM group, replaced here by
    `pg`); the shared-memory stand-in on the CPU."""
    if device.type == "cuda":
        channel = CudaIpcChannel.__new__(CudaIpcChannel)
        channel.rank = rank
        channel.pg = pg  # type: ignore[assignment]  # the same broadcast_obj and barrier
        return channel
    return SharedMemoryChannel(rank, pg)


def receiver(device_name: str, profile: Profile, q: Any, barrier: Any, results: Any) -> None:
    """Rank 1: receive every bucket, keep a copy (as an engine's load_weights would), signal done; then
    compare each unpacked tensor's bytes with the seeded model regenerated here."""
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        expected = dict(synthetic_model(profile))
        plan = model_plan(list(expected.items()), profile)
        channel = open_channel(device, 1, QueueGroup(1, q, barrier))
        channel.pg.barrier()  # ready: the sender's clock starts
        received = []
        for index, bucket in enumerate(plan):
            flat = channel.recv(bucket, index)
            received.append(flat.clone())
            del flat
            if device.type == "cuda":
                torch.cuda.synchronize()
            channel.done_with(index)
        mismatched = [
            name
            for bucket, flat in zip(plan, received, strict=True)
            for name, view in unpack_bucket(bucket, flat.cpu())
            if not torch.equal(_bytes(view), _bytes(expected[name]))
        ]
        results.put(
            {"mismatched": mismatched[:10], "mismatched_count": len(mismatched), "tensors": len(expected)}
        )
    except Exception as exc:  # reported by the sender's row, never lost in a child's stderr only
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def check_weight_channel(
    device: torch.device, profile: Profile, model: list[tuple[str, torch.Tensor]], broken: bool
) -> dict[str, Any]:
    """Rank 0 here, rank 1 spawned: pack and send every bucket; rank 1 checks them bit for bit."""
    transport = "cuda_ipc (CudaIpcChannel)" if device.type == "cuda" else "cpu shared memory (stand-in)"
    ctx = mp.get_context("spawn")
    q, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
    child = ctx.Process(target=receiver, args=(str(device), profile, q, barrier, results), daemon=True)
    child.start()
    plan = model_plan(model, profile)
    params = dict(model)
    out: dict[str, Any] = {"transport": transport, "ok": False, "bytes": plan_bytes(plan), "seconds": None}
    try:
        channel = open_channel(device, 0, QueueGroup(0, q, barrier))
        channel.pg.barrier()
        t0 = time.perf_counter()
        for index, bucket in enumerate(plan):
            flat = pack_bucket(bucket, [params[n] for n in bucket.names], out=channel.staging(bucket, index))
            if broken and index == 0:
                _bytes(flat)[0] ^= 1
            channel.send(flat, index)
        out["seconds"] = time.perf_counter() - t0
        report = results.get(timeout=WAIT_S)
    except Exception as exc:
        report = {"error": f"{type(exc).__name__}: {exc} (receiver exit code {child.exitcode})"}
        child.terminate()  # it may be waiting for a bucket that will not come
    child.join(timeout=WAIT_S)
    if child.is_alive():
        child.terminate()
    out.update(report)
    out["buckets"] = len(plan)
    out["ok"] = "error" not in report and report["mismatched_count"] == 0 and report["tensors"] == len(model)
    return out


# ---- bandwidth --------------------------------------------------------------------------------------


def _timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of fn over `reps` runs after two warm-ups, the device drained around each."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(reps + 2):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_bandwidth(
    device: torch.device, profile: Profile, model: list[tuple[str, torch.Tensor]]
) -> dict[str, Any]:
    plan = model_plan(model, profile)
    params = dict(model)
    nbytes = plan_bytes(plan)
    staging = StagingBuffer(device)

    def pack_all() -> None:
        for bucket in plan:
            flat = staging.get(bucket.numel, dtype_from_name(bucket.dtype))
            pack_bucket(bucket, [params[n] for n in bucket.names], out=flat)

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
    dst = torch.empty_like(src)
    pack_gbps = nbytes / _timed(pack_all, device, profile.reps) / 1e9
    copy_gbps = nbytes / _timed(lambda: dst.copy_(src), device, profile.reps) / 1e9
    ratio = pack_gbps / copy_gbps
    floor = MIN_PACKING_RATIO if device.type == "cuda" else 0.0
    return {
        "bytes": nbytes,
        "tensors": len(model),
        "buckets": len(plan),
        "packing_gbps": pack_gbps,
        "copy_gbps": copy_gbps,
        "packing_vs_copy": ratio,
        "floor": floor,
        "ok": math.isfinite(ratio) and ratio > floor,
    }


# ---- the run ----------------------------------------------------------------------------------------


def _finite(x: Any) -> Any:
    """JSON has no inf/NaN: those become null (and their row has failed)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return x


def print_table(
    device_name: str,
    rows: list[Row],
    channel: dict[str, Any],
    bw: dict[str, Any],
    heavy: list[str],
    sources: Path,
    own: bool,
) -> None:
    print(f"GPU check on {device_name}, torch {torch.__version__}")
    print(
        f"\n{'objective (bf16 vs float64 CPU)':<32} {'max_abs_err':>12} {'max_scaled_err':>15} {'tol':>8}  ok"
    )
    for r in rows:
        print(f"{r.name:<32} {r.max_abs_err:>12.3e} {r.max_scaled_err:>15.3e} {r.tol:>8.4f}  {_mark(r.ok)}")
    mib = channel["bytes"] / 2**20
    secs = channel["seconds"]
    speed = f"{channel['bytes'] / secs / 1e9:.3g} GB/s" if secs else "-"
    print(f"\n{'weight channel':<32} {channel['transport']}")
    print(f"{'':<32} {mib:.1f} MiB in {channel['buckets']} buckets, {secs or 0:.3f} s ({speed}), bit for bit")
    detail = channel.get("error") or ", ".join(channel.get("mismatched", [])[:5]) or "all equal"
    print(f"{'':<32} {detail}  {_mark(channel['ok'])}")
    print(f"\n{'bucketed packing vs copy_':<32} {bw['bytes'] / 2**20:.1f} MiB, {bw['tensors']} tensors")
    print(
        f"{'':<32} packing {bw['packing_gbps']:.3g} GB/s, copy_ {bw['copy_gbps']:.3g} GB/s, "
        f"ratio {bw['packing_vs_copy']:.3f} (floor {bw['floor']})  {_mark(bw['ok'])}"
    )
    print(f"\n{'project code under test':<32} {sources}  {_mark(own)}")
    print(
        f"{'only torch needed':<32} {'heavy imports: ' + ', '.join(heavy) if heavy else 'yes'}  {_mark(not heavy)}"
    )


def _mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    names = [*objective_functions(), "response_logprobs", "weight_channel"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (seconds on a CPU)")
    ap.add_argument(
        "--break",
        dest="broken",
        action="append",
        default=[],
        choices=names,
        help="for testing the check itself: fail this row on purpose",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"error: --device cuda, but torch {torch.__version__} sees no GPU "
            f"(CUDA build {torch.version.cuda}); use --device cpu to run the checks on the CPU",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    device_name = f"cuda:0 ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"
    profile = PROFILES[(args.device, args.quick)]
    heavy = [m for m in HEAVY_MODULES if m in sys.modules]
    sources = Path(rlhf_trainer.__file__).resolve().parent
    own = sources.is_relative_to(REPO)

    rows = check_objectives(profile, device, args.broken)
    model = [(name, t.to(device)) for name, t in synthetic_model(profile)]  # as the actor holds it
    channel = check_weight_channel(device, profile, model, "weight_channel" in args.broken)
    bw = check_bandwidth(device, profile, model)

    print_table(device_name, rows, channel, bw, heavy, sources, own)
    ok = all(r.ok for r in rows) and channel["ok"] and bw["ok"] and not heavy and own
    result = {
        "device": device_name,
        "torch_version": torch.__version__,
        "ok": ok,
        "quick": args.quick,
        "broken": args.broken,
        "project_sources": str(sources),
        "heavy_imports": heavy,
        "objectives": {
            r.name: {
                "max_abs_err": r.max_abs_err,
                "max_scaled_err": r.max_scaled_err,
                "tol": r.tol,
                "pass": r.ok,
            }
            for r in rows
        },
        "weight_channel": channel,
        "packing": bw,
        "packing_gbps": bw["packing_gbps"],
        "copy_gbps": bw["copy_gbps"],
        "packing_vs_copy": bw["packing_vs_copy"],
    }
    print("RESULT " + json.dumps(_finite(result)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
