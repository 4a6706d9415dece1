"""benchmarks/lib/heap.py: memray's peak records grouped by site, and the command that makes them."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
from lib import heap

pytestmark = pytest.mark.unit

STDLIB = sysconfig.get_paths()["stdlib"]
SITE = "/venv/lib/python3.11/site-packages"


def test_memray_command_runs_the_module_under_memray_aggregated() -> None:
    cmd = heap.memray_command("/py", "rlhf_cli.main", ["operator", "-A"], Path("/tmp/cap.bin"))
    assert cmd[:4] == ["/py", "-m", "memray", "run"]
    assert "--aggregate" in cmd and "--trace-python-allocators" in cmd
    assert cmd[cmd.index("-o") + 1] == "/tmp/cap.bin"
    assert cmd[-4:] == ["-m", "rlhf_cli.main", "operator", "-A"]


def test_sites_group_by_allocating_frame_and_owners_outside_the_stdlib() -> None:
    decode = ("raw_decode", f"{STDLIB}/json/decoder.py", 353)
    kopf_watch = ("watch_objs", f"{SITE}/kopf/_cogs/clients/watching.py", 250)
    kopf_index = ("index", f"{SITE}/kopf/_core/engines/indexing.py", 90)
    handler = ("rlhf_pods", "/repo/operator/rlhf_operator/handlers.py", 200)
    run = ("run", f"{STDLIB}/asyncio/events.py", 80)
    records = [
        (1000, 10, [decode, run, kopf_watch, run]),
        (500, 5, [decode, kopf_watch]),  # same allocating frame and owners: summed
        (3000, 1, [("copy", f"{STDLIB}/copy.py", 1), handler, kopf_index, kopf_watch]),
        (10, 1, []),
    ]
    sites = heap.top_sites(records, depth=2)
    assert [s.size for s in sites] == [3000, 1500, 10]
    first, second, unknown = sites
    assert first.allocated_in == "copy.py:1"
    assert first.owners == (
        "rlhf_operator/handlers.py:200 rlhf_pods",
        "kopf/_core/engines/indexing.py:90 index",
    )
    assert (second.count, second.allocated_in) == (15, "json/decoder.py:353")
    assert second.owners == ("kopf/_cogs/clients/watching.py:250 watch_objs",)
    assert (unknown.allocated_in, unknown.owners) == ("?", ())
