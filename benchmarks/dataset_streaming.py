"""The driver's memory while it serves prompts from a ~1 GB Parquet file: an index and on-demand row groups
vs the whole file loaded.

Issue 34, item 2 (docs/benchmarks.md, docs/data.md). A verl-style Parquet file (chat-message prompts,
data_source, reward_model.ground_truth, extra_info) is written under /tmp and deleted at the end. Ours is
`rlhf_trainer.data.PromptDataset` (row-group sizes indexed, rows read on demand, at most two row groups
decoded); the baseline is the old way, the whole file read into the driver (`WholeFile` below: pyarrow's
read_table, then the rows as Python objects, as the old reader held its .jsonl). Each measurement runs in
a fresh process; the number is its peak RSS (VmHWM, reset through /proc/self/clear_refs just before the
dataset is opened) less its RSS then, over opening the file and drawing every batch. Goal: <= 200 MiB.
"""

from __future__ import annotations

import argparse
import base64
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from lib import common

GOAL_MIB = 200.0
WORK = Path(os.environ.get("RLHF_BENCH_DATASET", "/tmp/rlhf-bench-dataset"))
FILE = WORK / "prompts.parquet"
ROWS_PER_GROUP = 8_192  # about 16 MiB of text a row group
CONTENT_BYTES = 1_500  # random bytes per row, base64 in the user turn (about 2 KB of text: incompressible)


def write_file(target_mib: int) -> dict[str, Any]:
    """The verl-style Parquet file, row group by row group, until it is about target_mib on disk."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    WORK.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    writer: Any = None
    rows = groups = 0
    try:
        while not FILE.exists() or FILE.stat().st_size < target_mib * 2**20:
            table = pa.Table.from_pylist([verl_row(rows + i, rng) for i in range(ROWS_PER_GROUP)])
            writer = writer or pq.ParquetWriter(FILE, table.schema)
            writer.write_table(table, row_group_size=ROWS_PER_GROUP)
            rows, groups = rows + ROWS_PER_GROUP, groups + 1
    finally:
        if writer is not None:
            writer.close()
    return {"rows": rows, "row_groups": groups, "file_mib": FILE.stat().st_size / 2**20}


def verl_row(i: int, rng: random.Random) -> dict[str, Any]:
    text = base64.b64encode(rng.randbytes(CONTENT_BYTES)).decode()
    return {
        "data_source": "synthetic",
        "prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}],
        "reward_model": {"style": "rule", "ground_truth": str(i % 97)},
        "extra_info": {"index": i, "split": "train"},
    }


class WholeFile:
    """The baseline: every row in the driver (the old reader's way), served in the same seeded order."""

    def __init__(self, path: Path, seed: int) -> None:
        import pyarrow.parquet as pq

        self.rows = pq.read_table(path).to_pylist()
        self.order = list(range(len(self.rows)))
        random.Random(seed * 1_000_003).shuffle(self.order)
        self.offset = 0

    def next_batch(self, n: int) -> list[Any]:
        out = [self.rows[self.order[(self.offset + k) % len(self.order)]] for k in range(n)]
        self.offset += n
        return out


def child(way: str, batches: int, batch_size: int) -> None:
    """One measurement in this fresh process; prints `CHILD {json}`."""
    import pyarrow.parquet  # noqa: F401  # imports are not the dataset's memory
    from rlhf_trainer.data import PromptDataset

    Path("/proc/self/clear_refs").write_text("5")
    before = common.status_kib("VmRSS")
    t0 = time.perf_counter()
    data: Any = PromptDataset(str(FILE), "prompt", None, seed=0) if way == "ours" else WholeFile(FILE, 0)
    opened = time.perf_counter()
    served = 0
    for _ in range(batches):
        batch = data.next_batch(batch_size)
        served += len(batch.prompts) if way == "ours" else len(batch)
    done = time.perf_counter()
    peak = common.status_kib("VmHWM")
    common.child_result(
        {
            "before_mib": before / 1024,
            "peak_mib": peak / 1024,
            "growth_mib": (peak - before) / 1024,
            "open_seconds": opened - t0,
            "batches_per_s": batches / (done - opened),
            "rows_served": served,
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--file-mib", type=int, default=1024)
    p.add_argument("--batches", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--child", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.batches, args.batch_size)
        return

    common.print_machine()
    free_mib = shutil.disk_usage(WORK.parent).free / 2**20
    if free_mib < 3 * args.file_mib:
        common.fail(
            f"{WORK.parent} has {free_mib:,.0f} MiB free; the file needs {args.file_mib} MiB and headroom"
        )
    try:
        t0 = time.perf_counter()
        made = write_file(args.file_mib)
        print(
            f"{FILE}: {made['file_mib']:,.0f} MiB, {made['rows']:,} rows in {made['row_groups']} row groups, "
            f"written in {time.perf_counter() - t0:.0f} s"
        )
        runs = measure(args)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    report(args, made, runs)


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Each way `repeats` times in fresh processes, interleaved in a rotating order."""
    ways = ["ours", "baseline"]
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    env = {**os.environ, "RLHF_BENCH_DATASET": str(WORK)}
    flags = {"batches": args.batches, "batch_size": args.batch_size}
    for i in range(args.repeats):
        for way in ways[i % 2 :] + ways[: i % 2]:
            runs[way].append(common.run_child(__file__, way, 0, flags, env, timeout=1800))
    return runs


def report(args: argparse.Namespace, made: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> None:
    def med(way: str, key: str) -> float:
        return common.median([float(r[key]) for r in runs[way]])

    label = {"ours": "ours: index + row groups on demand", "baseline": "baseline: whole file in the driver"}
    keys = ["before_mib", "peak_mib", "growth_mib", "open_seconds", "batches_per_s"]
    common.table(
        f"{args.batches} batches of {args.batch_size} prompts from a {made['file_mib']:,.0f} MiB Parquet file "
        f"({made['rows']:,} rows, {made['row_groups']} row groups); medians of {args.repeats} fresh processes",
        ["way", "RSS before MiB", "peak MiB", "growth MiB", "open s", "batches/s"],
        [[label[w], *(med(w, k) for k in keys)] for w in runs],
    )
    growth = max(float(r["growth_mib"]) for r in runs["ours"])
    common.result(
        {
            "rss_growth_mib": round(growth, 1),
            "baseline_rss_growth_mib": round(med("baseline", "growth_mib"), 1),
            "file_mib": round(made["file_mib"], 1),
            "rows": made["rows"],
            "row_groups": made["row_groups"],
            "batches": args.batches,
            "batch_size": args.batch_size,
            "open_seconds": round(med("ours", "open_seconds"), 2),
            "batches_per_s": round(med("ours", "batches_per_s"), 1),
            "baseline_open_seconds": round(med("baseline", "open_seconds"), 2),
            "baseline_batches_per_s": round(med("baseline", "batches_per_s"), 1),
            "goal_mib": GOAL_MIB,
            "goal_met": growth <= GOAL_MIB,
        }
    )


if __name__ == "__main__":
    main()
