"""Delta weight sync vs the full bucket, on SmolLM-135M's shapes in bf16 (docs/benchmarks.md, issue 39).

The model: a Llama with SmolLM-135M's shapes (hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536,
vocabulary 49,152, tied embeddings; random init, seed 0), fp32 master weights as the trainer's ZeRO-3
optimizer keeps them, trained with real AdamW steps (betas 0.9 / 0.95, no weight decay) on the real
gradients of a next-token loss over a fixed batch of random tokens (2 x 64). After each step the
weights are cast to bf16 (the engines' dtype on GPU) and packed into the sync's buckets
(`bucketing.plan_buckets`, 256 MiB, the spec default).

Both ways pack every bucket (`pack_bucket`, the cast included) and move it through a stand-in for the
shared-memory channel: one copy into a wire buffer, one out into the receiver's copy of the weights.
The baseline sends every bucket whole. Ours (`weight_sync.delta`), two ways in the same steps, each with
its own receiver: `choose: bytes` compares the packed bucket bit for bit with the copy the receiver holds
and sends whichever is smallest: the changed elements' positions (uint16 gaps) and values, a bitmask and
the values, or the whole bucket; the receiver applies it in place. `choose: time` (the spec's default)
first prices the delta from a sample of the bucket and the link speed measured on whole buckets, and sends
the bucket whole where the delta would take longer. After every step each receiver's copy is checked bit
for bit against the sender's bucket.

Measured per learning rate (1e-6, 1e-5, 1e-4, each from the same start): the changed fraction, bytes
and time per sync (means over steps 2-9; step 1 is Adam's first, bias-corrected update; a bucket that
went whole is sent whole without comparing for the next 7 syncs, then compared again). Goals:
full / delta bytes >= 10 and full / delta time >= 3 at 1e-6 (keys without a suffix: `bytes`; `_time`:
`time`); delta / full time <= 1.05 at the worst rate (`delta_worst_ratio`: `time`, the way a job runs by
default; `delta_worst_ratio_bytes`: `bytes`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from lib import common
from weight_sync import SMOLLM_135M

LRS = (1e-6, 1e-5, 1e-4)


def mean_of(xs: list[float]) -> float:
    return sum(xs) / len(xs)


STEPS = 9
BUCKET_MIB = 256


def run(lr: float, layers: int, init: dict[str, Any], tokens: Any) -> dict[str, Any]:
    import torch
    from rlhf_trainer.weight_sync import delta
    from rlhf_trainer.weight_sync.bucketing import pack_bucket, plan_buckets
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM_135M, "num_hidden_layers": layers})).float()
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    params = list(model.named_parameters())
    plan = plan_buckets([(n, tuple(p.shape), torch.bfloat16) for n, p in params], BUCKET_MIB << 20)
    by_name = dict(params)

    def packed(out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        with torch.no_grad():
            return [
                pack_bucket(b, [by_name[s.name] for s in b.slots], out[i] if out is not None else None)
                for i, b in enumerate(plan)
            ]

    sender_prev = packed()  # what the engines hold after the last sync
    full_held = [t.clone() for t in sender_prev]  # the baseline's receiver
    staging = [torch.empty_like(t) for t in sender_prev]  # ours packs into the other of two buffers
    full_staging = [torch.empty_like(t) for t in sender_prev]
    # ours twice, each with its own receiver: choose "bytes" (the smaller encoding) and "time" (priced);
    # both pack the same weights into `staging`
    ways = {c: (delta.DeltaEncoder(choose=c), [t.clone() for t in sender_prev]) for c in ("bytes", "time")}
    wire = torch.empty(max(t.numel() for t in sender_prev) * 3, dtype=torch.bfloat16)  # room for idx + values
    for encoder, held in ways.values():  # a channel's first sync is whole: it times the link
        for i, flat in enumerate(sender_prev):
            t0 = time.perf_counter()
            wire[: flat.numel()].copy_(flat)
            held[i].copy_(wire[: flat.numel()])
            encoder.observe_link(flat.numel() * flat.element_size(), time.perf_counter() - t0)
    rows = []
    for step in range(1, STEPS + 1):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        new_full = packed(full_staging)
        full_bytes = 0
        for i, flat in enumerate(new_full):
            w = wire[: flat.numel()]
            w.copy_(flat)
            full_held[i].copy_(w)
            full_bytes += flat.numel() * flat.element_size()
        t_full = time.perf_counter() - t0

        row: dict[str, Any] = {"step": step, "full_bytes": full_bytes, "full_s": t_full}
        for choose, (encoder, held) in ways.items():
            t0 = time.perf_counter()
            new = packed(staging)
            sent, encodings = 0, []
            for i, flat in enumerate(new):
                d = encoder.encode(i, flat, sender_prev[i])
                t_link = time.perf_counter()
                # the wire: the delta's bytes copied in, and the receiver applies what it reads back
                payload = [d.values] + [x for x in (d.gaps, d.bitmask) if x is not None]
                received = []
                offset = 0
                for part in payload:
                    raw = part.contiguous().view(torch.uint8)
                    w = wire.view(torch.uint8)[offset : offset + raw.numel()]
                    w.copy_(raw)
                    received.append(w.view(part.dtype))
                    offset += raw.numel()
                got = delta.Delta(d.encoding, d.numel, received[0],
                                  received[1] if d.gaps is not None else None,
                                  received[1] if d.bitmask is not None else None)  # fmt: skip
                delta.apply(got, held[i])
                if d.encoding == "full":  # as DeltaSender does: whole buckets time the link
                    encoder.observe_link(d.nbytes, time.perf_counter() - t_link)
                sent += d.nbytes
                encodings.append(d.encoding)
            row[f"{choose}_s"], row[f"{choose}_bytes"] = time.perf_counter() - t0, sent
            for i, flat in enumerate(new):
                assert torch.equal(flat.view(torch.int16), held[i].view(torch.int16)), (
                    f"bucket {i} ({choose})"
                )
            print(f"lr {lr:g} step {step} {choose}: {sent / 1e6:.1f} / {full_bytes / 1e6:.1f} MB, "
                  f"{row[f'{choose}_s']:.3f} s (full {t_full:.3f} s) {encodings}", flush=True)  # fmt: skip
        changed = sum(
            int(torch.count_nonzero(delta.changed_mask(a, b))) for a, b in zip(new, sender_prev, strict=True)
        )
        staging, sender_prev = sender_prev, new  # the bucket just sent is what the engines now hold
        for i, flat in enumerate(new):
            assert torch.equal(flat.view(torch.int16), full_held[i].view(torch.int16)), f"bucket {i} (full)"
        row["changed"] = changed / sum(t.numel() for t in new)
        rows.append(row)
    return {"lr": lr, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=SMOLLM_135M["num_hidden_layers"])
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    common.print_machine()
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SMOLLM_135M, "num_hidden_layers": args.layers})
    init = {k: v.clone() for k, v in LlamaForCausalLM(cfg).float().state_dict().items()}
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    results = [run(lr, args.layers, init, tokens) for lr in LRS]

    table_rows, out = [], {}
    worst = {"bytes": 0.0, "time": 0.0}
    for r in results:
        later = r["rows"][1:]
        key = f"{r['lr']:.0e}".replace("e-0", "e-")
        changed = mean_of([x["changed"] for x in later])
        for choose in ("bytes", "time"):
            bytes_ratio = mean_of([x["full_bytes"] / x[f"{choose}_bytes"] for x in later])
            time_ratio = mean_of([x["full_s"] / x[f"{choose}_s"] for x in later])
            worst[choose] = max(worst[choose], mean_of([x[f"{choose}_s"] / x["full_s"] for x in later]))
            table_rows.append([key, choose, changed, mean_of([x[f"{choose}_bytes"] for x in later]) / 1e6,
                               mean_of([x["full_bytes"] for x in later]) / 1e6,
                               mean_of([x[f"{choose}_s"] for x in later]), mean_of([x["full_s"] for x in later]),
                               bytes_ratio, time_ratio])  # fmt: skip
            suffix = "" if choose == "bytes" else "_time"  # the encoding's keys as before; `time` beside
            out[f"delta_bytes_ratio_{key}{suffix}"] = round(bytes_ratio, 3)
            out[f"delta_time_ratio_{key}{suffix}"] = round(time_ratio, 3)
        out[f"changed_fraction_{key}"] = round(changed, 6)
    out["delta_worst_ratio"] = round(worst["time"], 3)  # what weightSync.delta (choose: time) costs at worst
    out["delta_worst_ratio_bytes"] = round(worst["bytes"], 3)
    common.table(
        "delta weight sync vs the full bucket (SmolLM-135M shapes, bf16, mean of steps 2-9)",
        ["lr", "choose", "changed", "delta MB", "full MB", "delta s", "full s", "bytes ratio", "time ratio"],
        table_rows,
    )
    common.result(out)


if __name__ == "__main__":
    main()
