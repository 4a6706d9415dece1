"""`python -m rlhf_trainer.stacks.snapshot`: the Ray job the operator submits when it declares a step
stalled. It connects to the job's Ray cluster as a second driver (so it works whether the trainer's
driver is alive, hung or gone), takes the snapshot of every node, prints the verdict, and last a line
`RLHF_STACKS {json}` with the whole snapshot, which the operator reads from the job's log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rlhf_api.constants import STACKS_LOG_MARKER

from rlhf_trainer.stacks.collect import PROCESS_LIMIT_SECONDS, snapshot
from rlhf_trainer.stacks.summary import annotate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf_trainer.stacks.snapshot", description=__doc__)
    p.add_argument("--limit", type=float, default=PROCESS_LIMIT_SECONDS, help="seconds per process")
    p.add_argument("--node-timeout", type=float, default=60.0, help="seconds per node's collector")
    args = p.parse_args(argv)
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
    try:
        snap = annotate(snapshot(args.limit, args.node_timeout))
    finally:
        ray.shutdown()
    for line in snap["verdict"]:
        print(line)
    print(STACKS_LOG_MARKER + json.dumps(snap, separators=(",", ":")))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
