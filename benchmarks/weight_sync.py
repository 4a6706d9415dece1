"""Bucketed weight sync vs one RPC and one broadcast per parameter (OpenRLHF's way) (docs/benchmarks.md, issue 8).

The model: the parameter shapes of SmolLM-135M (a Llama: hidden 576, 30 layers, 9 heads, 3 KV heads,
MLP 1536, vocabulary 49,152, tied embeddings), built on the meta device with transformers, then
materialised in bfloat16: 272 tensors, 134.5M parameters, 269 MB. 1 to 4 receivers.

Receivers are stand-ins for vLLM engine workers: Ray actors (one process each) holding a preallocated
state dict of the model's shapes; "loading" a tensor is `state[name].copy_(received)`, what vLLM's
`load_weights` does for a plain Llama. No vLLM, no DeepSpeed: the ZeRO-3 gather is not measured (both
ways would gather; the sender here holds full tensors).

Ours is the trainer's code: `bucketing.plan_buckets` (bucketSizeMiB 256, the spec default), `pack_bucket`
into the channel's `staging` memory, and a channel from `channels.open_channel` (gloo: a reused buffer,
one broadcast per bucket; shm: the bucket packed straight into one of two alternating /dev/shm files that
engines map, gloo carrying only ready/consumed signals). One Ray actor call per engine per
sync starts the receive (as `RolloutEngine.receive_weights` does), then the buckets stream.

The baseline is OpenRLHF's default `_broadcast_to_vllm`: for every parameter, `engine.update_weight
.remote(name, dtype, shape)` to every engine (a real Ray actor method call per parameter per engine),
one gloo `broadcast` of that tensor from rank 0, then `ray.get` of the calls; the engine allocates an
empty tensor, receives the broadcast and loads it. (OpenRLHF's engine actor forwards the call through
vLLM's `collective_rpc` to its worker; the stand-in skips that hop, which favours the baseline.)
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from typing import Any

from lib import common

KINDS = ("ours_gloo", "ours_shm", "baseline", "limit_gloo")
SMOLLM_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}


def model_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a SmolLM-135M-shaped Llama, in named_parameters order."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**SMOLLM_135M, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


class StandInEngine:
    """A vLLM engine worker's receiving end: a preallocated state dict, one channel per way."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], dtype: str) -> None:
        import torch
        from rlhf_trainer.weight_sync.bucketing import dtype_from_name

        self.dtype = dtype_from_name(dtype)
        self.state = {n: torch.zeros(s, dtype=self.dtype) for n, s in shapes}
        self.channels: dict[str, Any] = {}

    def open(self, kind: str, rdzv_wire: dict[str, Any], rank: int) -> int:
        from rlhf_trainer.weight_sync.channels import Rendezvous, open_channel
        from rlhf_trainer.weight_sync.gloo import open_gloo_group

        rdzv = Rendezvous.from_wire(rdzv_wire)
        if kind == "baseline":  # OpenRLHF's model-update group: a plain process group, rank 0 = trainer
            pg, store = open_gloo_group(
                rdzv.master_addr, rdzv.master_port, rank, rdzv.world_size, rdzv.group_name
            )
            self.channels[kind] = (pg, store)
        else:
            self.channels[kind] = open_channel(rdzv, rank)
        return rank

    def close_all(self) -> None:
        for kind, ch in self.channels.items():
            if kind != "baseline":
                ch.close()
        self.channels = {}

    # ---- ours: one call per sync, then the buckets ------------------------------------------------
    def receive(self, kind: str, plan_wire: list[dict[str, Any]]) -> dict[str, float]:
        from rlhf_trainer.weight_sync.bucketing import plan_from_wire, unpack_bucket

        ch = self.channels[kind]
        t_wait = t_load = 0.0
        for index, bucket in enumerate(plan_from_wire(plan_wire)):
            t0 = time.perf_counter()
            flat = ch.recv(bucket, index)
            t1 = time.perf_counter()
            for name, tensor in unpack_bucket(bucket, flat):  # load_weights stand-in
                self.state[name].copy_(tensor)
            ch.done_with(index)
            t_wait += t1 - t0
            t_load += time.perf_counter() - t1
        return {"recv_wait_s": t_wait, "load_s": t_load}

    # ---- baseline: one call per parameter ---------------------------------------------------------
    def update_weight(self, name: str, dtype: str, shape: list[int]) -> None:
        import torch
        from rlhf_trainer.weight_sync.bucketing import dtype_from_name

        pg = self.channels["baseline"][0]
        weight = torch.empty(shape, dtype=dtype_from_name(dtype))
        pg.broadcast(weight, 0).wait()
        self.state[name].copy_(weight)  # load_weights([(name, weight)]) stand-in
        del weight

    # ---- the limit: one raw broadcast of one model-sized tensor ---------------------------------
    def raw_recv(self, numel: int) -> None:
        import torch

        # Reused across calls (touched by the warm-up): the limit measures the wire, not page faults.
        buf = getattr(self, "_raw", None)
        if buf is None or buf.numel() != numel:
            buf = self._raw = torch.empty(numel, dtype=self.dtype)
        self.channels["baseline"][0].broadcast(buf, 0).wait()

    # ---- checks (untimed) -------------------------------------------------------------------------
    def markers_wrong(self, version: int) -> int:
        """Every tensor's first element carries the sync's version: count the tensors that do not."""
        return sum(int(float(t.view(-1)[0]) != float(version)) for t in self.state.values())

    def digest(self) -> float:
        return float(sum(float(t.double().sum()) for t in self.state.values()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def open_groups(engines: list[Any], n: int, tag: str) -> dict[str, Any]:
    """Our gloo and shm channels and the baseline's group, rank 0 here, engines 1..n."""
    import ray
    from rlhf_trainer.weight_sync.channels import Rendezvous, open_channel
    from rlhf_trainer.weight_sync.gloo import open_gloo_group

    mine: dict[str, Any] = {}
    for kind, backend in (("ours_gloo", "gloo"), ("ours_shm", "shm"), ("baseline", "gloo")):
        rdzv = Rendezvous(backend, "127.0.0.1", free_port(), n + 1, f"bench-ws-{tag}-{kind}-{n}")
        refs = [e.open.remote(kind, rdzv.to_wire(), i + 1) for i, e in enumerate(engines[:n])]
        if kind == "baseline":
            mine[kind] = open_gloo_group(
                rdzv.master_addr, rdzv.master_port, 0, rdzv.world_size, rdzv.group_name
            )
        else:
            mine[kind] = open_channel(rdzv, 0)
        ray.get(refs, timeout=120)
    return mine


def sync_ours(
    kind: str, mine: dict[str, Any], engines: list[Any], src: dict[str, Any], bucket_bytes: int
) -> dict[str, float]:
    """The trainer's path (ModelRank.send_weights on rank 0 + pool.receive_refs), gather excluded."""
    import ray
    from rlhf_trainer.weight_sync.bucketing import pack_bucket, plan_buckets, plan_to_wire

    ch = mine[kind]
    t0 = time.perf_counter()
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in src.items()], bucket_bytes)
    wire = plan_to_wire(plan)
    refs = [e.receive.remote(kind, wire) for e in engines]
    t_pack = t_send = 0.0
    for index, bucket in enumerate(plan):
        t1 = time.perf_counter()
        flat = pack_bucket(bucket, [src[n] for n in bucket.names], out=ch.staging(bucket, index))
        t2 = time.perf_counter()
        ch.send(flat, index)
        t_pack += t2 - t1
        t_send += time.perf_counter() - t2
    t3 = time.perf_counter()
    got = ray.get(refs)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "pack_s": t_pack,
        "send_s": t_send,
        "final_get_s": time.perf_counter() - t3,
        "recv_wait_s": max(g["recv_wait_s"] for g in got),
        "load_s": max(g["load_s"] for g in got),
        "buckets": float(len(plan)),
    }


def sync_baseline(mine: dict[str, Any], engines: list[Any], src: dict[str, Any]) -> dict[str, float]:
    """OpenRLHF's per-parameter loop: RPC to every engine, broadcast, wait for the RPCs."""
    import ray
    from rlhf_trainer.weight_sync.bucketing import dtype_name

    pg = mine["baseline"][0]
    t_rpc = t_bcast = t_get = 0.0
    t0 = time.perf_counter()
    for name, param in src.items():
        t1 = time.perf_counter()
        refs = [e.update_weight.remote(name, dtype_name(param.dtype), list(param.shape)) for e in engines]
        t2 = time.perf_counter()
        pg.broadcast(param, 0).wait()
        t3 = time.perf_counter()
        ray.get(refs)
        t4 = time.perf_counter()
        t_rpc += t2 - t1
        t_bcast += t3 - t2
        t_get += t4 - t3
    return {
        "seconds": time.perf_counter() - t0,
        "rpc_submit_s": t_rpc,
        "broadcast_s": t_bcast,
        "get_s": t_get,
    }


def sync_limit(mine: dict[str, Any], engines: list[Any], big: Any) -> dict[str, float]:
    """One raw gloo broadcast of a model-sized tensor to the same engines (one RPC to start it)."""
    import ray

    t0 = time.perf_counter()
    refs = [e.raw_recv.remote(big.numel()) for e in engines]
    mine["baseline"][0].broadcast(big, 0).wait()
    ray.get(refs)
    return {"seconds": time.perf_counter() - t0}


def run_one(
    kind: str, mine: dict[str, Any], engines: list[Any], src: dict[str, Any], big: Any, bucket_bytes: int
) -> dict[str, float]:
    if kind == "limit_gloo":
        return sync_limit(mine, engines, big)
    if kind != "baseline":
        return sync_ours(kind, mine, engines, src, bucket_bytes)
    try:
        return sync_baseline(mine, engines, src)
    except Exception as exc:  # the baseline cannot run: fail, never report ours alone
        common.fail(f"baseline (per-parameter RPC + broadcast) failed: {exc!r}")
        raise


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """One copy_ of a model-sized buffer into a preallocated one (this process, default threads)."""
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return nbytes / common.median(times) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--engines", default="1,2,4", help="engine counts, comma-separated")
    p.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM-135M: 30 -> 272 tensors)")
    p.add_argument("--bucket-mib", type=int, default=256, help="bucketSizeMiB (spec default 256)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    counts = sorted({int(x) for x in args.engines.split(",")})
    if not counts or counts[0] < 1:
        common.fail("--engines needs counts >= 1")

    common.print_machine()
    common.start_ray(num_cpus=max(counts) + 2)
    import ray
    import torch
    from rlhf_trainer.weight_sync.bucketing import dtype_from_name

    dtype = dtype_from_name(args.dtype)
    shapes = model_shapes(args.layers)
    gen = torch.Generator().manual_seed(0)
    src = {n: torch.rand(s, generator=gen).to(dtype) for n, s in shapes}
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    big = torch.zeros(sum(t.numel() for t in src.values()), dtype=dtype)
    common.console.print(
        f"model: SmolLM-135M shapes, {args.layers} layers, {len(src)} tensors, "
        f"{sum(t.numel() for t in src.values()) / 1e6:.1f}M params, {nbytes / 1e6:.0f} MB {args.dtype}"
    )
    engines = [
        ray.remote(StandInEngine).options(num_cpus=1).remote(shapes, args.dtype) for _ in range(max(counts))
    ]
    ray.get([e.__ray_ready__.remote() for e in engines], timeout=300)

    bucket_bytes = args.bucket_mib << 20
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    memcpy: list[float] = []
    version = 0
    for n in counts:
        mine = open_groups(engines, n, f"{os.getpid()}")
        live = engines[:n]
        try:
            for kind in KINDS:  # warm-up (untimed): first broadcasts connect, the shm file gets its pages
                run_one(kind, mine, live, src, big, bucket_bytes)
            for i in range(args.repeats):
                order = KINDS[i % len(KINDS) :] + KINDS[: i % len(KINDS)]
                for kind in order:
                    if kind != "limit_gloo":  # the raw broadcast carries no weights: keep the version
                        version = version % 200 + 1
                        for t in src.values():
                            t.view(-1)[0] = version
                    r = run_one(kind, mine, live, src, big, bucket_bytes)
                    if kind != "limit_gloo":
                        wrong = ray.get([e.markers_wrong.remote(version) for e in live])
                        if any(wrong):
                            common.fail(f"{kind} x{n}: {wrong} tensors did not arrive (version {version})")
                    runs.setdefault((kind, n), []).append(r)
                memcpy.append(memcpy_gbps(nbytes, 1))
            want = float(sum(float(t.double().sum()) for t in src.values()))
            got = ray.get([e.digest.remote() for e in live])
            if any(abs(g - want) > 1e-6 * abs(want) for g in got):
                common.fail(f"x{n}: engine weights differ from the sender's ({got} vs {want})")
        finally:
            mine["ours_gloo"].close()
            mine["ours_shm"].close()
            ray.get([e.close_all.remote() for e in live])

    def med(kind: str, n: int, key: str = "seconds") -> float:
        return common.median([r[key] for r in runs[(kind, n)]])

    def gbps(kind: str, n: int) -> float:  # payload delivered: model bytes x engines
        return nbytes * n / med(kind, n) / 1e9

    memcpy_limit = common.median(memcpy)
    label = {
        "ours_gloo": "ours: buckets, gloo channel",
        "ours_shm": "ours: buckets, shm channel",
        "baseline": "baseline: RPC + broadcast per param",
        "limit_gloo": "limit: 1 raw gloo broadcast",
    }
    rows = []
    for n in counts:
        for kind in KINDS:
            base = med("baseline", n)
            rows.append(
                [
                    f"{label[kind]} x{n}",
                    med(kind, n),
                    base / med(kind, n) if kind.startswith("ours") else float("nan"),
                    gbps(kind, n),
                ]
            )
    common.table(
        f"Weight sync, SmolLM-135M shapes ({len(src)} tensors, {nbytes / 1e6:.0f} MB {args.dtype}), "
        f"sender = this process, receivers = stand-in engine workers (Ray actors copying into a "
        f"preallocated state dict); baseline RPC = one Ray actor call per parameter per engine; "
        f"buckets {args.bucket_mib} MiB; ZeRO-3 gather not measured; medians of {args.repeats}; "
        f"memcpy {memcpy_limit:.2f} GB/s",
        ["way x engines", "seconds", "speedup vs baseline", "GB/s to all engines"],
        rows,
    )
    phase_rows = []
    for n in counts:
        for kind in ("ours_gloo", "ours_shm"):
            phase_rows.append(
                [
                    f"{label[kind]} x{n}",
                    med(kind, n),
                    med(kind, n, "pack_s"),
                    med(kind, n, "send_s"),
                    med(kind, n, "final_get_s"),
                    med(kind, n, "recv_wait_s"),
                    med(kind, n, "load_s"),
                ]
            )
    common.table(
        "Where our time goes (sender: pack, send, final ray.get; slowest engine: waiting in recv, copying)",
        ["way x engines", "total s", "pack s", "send s", "final get s", "engine recv s", "engine load s"],
        phase_rows,
    )
    common.table(
        "Where the baseline's time goes (sums over parameters)",
        ["engines", "total s", "RPC submit s", "broadcast s", "ray.get s", "ms per parameter"],
        [
            [
                f"x{n}",
                med("baseline", n),
                med("baseline", n, "rpc_submit_s"),
                med("baseline", n, "broadcast_s"),
                med("baseline", n, "get_s"),
                med("baseline", n) / len(src) * 1e3,
            ]
            for n in counts
        ],
    )

    def worst(kind: str) -> tuple[float, int]:
        return min((med("baseline", n) / med(kind, n), n) for n in counts)

    sp_gloo, n_gloo = worst("ours_gloo")
    sp_shm, n_shm = worst("ours_shm")
    top = max(counts)
    # The main keys are the channel weightSync.backend=auto picks here: every stand-in engine is on this
    # process's Ray node, so `device.cpu_channel_for` gives shm (with its limit, memcpy). gloo, what auto
    # picks across hosts, is reported beside it against its own limit.
    common.result(
        {
            "speedup": round(sp_shm, 3),
            "gbps": round(gbps("ours_shm", top), 3),
            "limit_gbps": round(memcpy_limit, 3),
            "channel": "shm (auto, one host)",
            "engines_for_gbps": top,
            "worst_engines": n_shm,
            "gloo_speedup": round(sp_gloo, 3),
            "gloo_gbps": round(gbps("ours_gloo", top), 3),
            "gloo_limit_gbps": round(gbps("limit_gloo", top), 3),
            "gloo_worst_engines": n_gloo,
            # no gloo sender can beat one raw broadcast of the whole model: baseline / limit bounds speedup
            "gloo_speedup_bound": round(min(med("baseline", n) / med("limit_gloo", n) for n in counts), 3),
            "tensors": len(src),
            "model_mb": round(nbytes / 1e6, 1),
            "baseline_s": {str(n): round(med("baseline", n), 4) for n in counts},
            "ours_gloo_s": {str(n): round(med("ours_gloo", n), 4) for n in counts},
            "ours_shm_s": {str(n): round(med("ours_shm", n), 4) for n in counts},
        }
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
