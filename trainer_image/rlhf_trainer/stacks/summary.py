"""The verdict of a snapshot, as a person reads it: processes grouped by where they are, the odd ones
named. Pure: it reads the snapshot's dicts (collect.snapshot) and returns text.

Where a process "is": the thread doing the job's work (the one running a user's function, else the
main thread when it runs our code, else another thread running our code, else the main thread), its
innermost Python frame, and the innermost frame of our or the user's code under it when that is
another one ("in `all_reduce` (torch.distributed) ← `train_batch` (rlhf_trainer.workers.policy:88)").
A Ray worker whose work thread is in Ray's task loop is idle.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

OURS = "/rlhf_trainer/"
_THIRD_PARTY = ("/site-packages/", "/dist-packages/")
_COLLECTIVE = ("torch/distributed/", "deepspeed/comm/")
_RAY_IDLE = (("ray/_private/worker.py", "main_loop"),)


@dataclass(frozen=True)
class Where:
    """One process's place: a short text (`key`) shared by processes in the same place."""

    key: str
    detail: str  # where in our or the user's code it got there from ('' when the innermost frame is)


def module_of(file: str) -> str:
    """A frame's file as a module name: `torch.distributed.distributed_c10d`, `rlhf_trainer.faults`,
    `threading`, or the file's name for a user's file outside any package directory."""
    path = file.replace("\\", "/")
    for mark in (*_THIRD_PARTY, OURS, "/lib/python3."):
        if mark in path:
            rest = path.split(mark, 1)[1]
            if mark == OURS:
                rest = "rlhf_trainer/" + rest
            elif mark == "/lib/python3.":
                rest = rest.split("/", 1)[1] if "/" in rest else rest
            return rest.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return path.rsplit("/", 1)[-1].removesuffix(".py")


def kind_of(file: str) -> str:
    """`user` (a user's file), `ours` (rlhf_trainer), `library` (installed packages) or `stdlib`."""
    path = file.replace("\\", "/")
    if OURS in path:
        return "ours"
    if any(m in path for m in _THIRD_PARTY):
        return "library"
    if "/lib/python3." in path or path.startswith("<"):
        return "stdlib"
    return "user"


def _frames(thread: dict[str, Any]) -> list[dict[str, Any]]:
    return list(thread.get("frames") or [])


def work_thread(process: dict[str, Any]) -> dict[str, Any] | None:
    """The thread that shows where the process's work is (see the module's docstring)."""
    threads: list[dict[str, Any]] = list(process.get("threads") or [])
    if not threads:
        return None
    main = next((t for t in threads if t.get("ident") == process.get("main_thread")), threads[-1])
    kinds = {id(t): {kind_of(f["file"]) for f in _frames(t)} for t in threads}
    for t in [main, *threads]:
        if "user" in kinds[id(t)]:
            return t
    if "ours" in kinds[id(main)]:
        return main
    return next((t for t in threads if "ours" in kinds[id(t)]), main)


def where(process: dict[str, Any]) -> Where:
    """Where one answering process is."""
    thread = work_thread(process)
    frames = _frames(thread) if thread else []
    if not frames:
        return Where("with no Python frame", "")
    top = frames[0]
    if any(top["file"].endswith(f) and top["func"] == fn for f, fn in _RAY_IDLE):
        return Where("idle (waiting for work)", "")
    collective = next(
        (f for f in frames if any(c in f["file"] for c in _COLLECTIVE) and kind_of(f["file"]) == "library"),
        None,
    )
    if collective is not None:
        key = f"waiting in the collective `{collective['func']}` ({module_of(collective['file'])})"
    else:
        key = f"in `{top['func']}` ({module_of(top['file'])}:{top['line']})"
    anchor = next((f for f in frames if kind_of(f["file"]) in ("user", "ours")), None)
    detail = ""
    if anchor is not None and anchor is not top:
        detail = f"`{anchor['func']}` ({module_of(anchor['file'])}:{anchor['line']})"
    return Where(key, detail)


def _plural(role: str, n: int) -> str:
    """`actor ranks`, `rollout engines`, `reward scorers`: what `n` processes of a role are called."""
    if role in ("actor", "critic", "reference"):
        return f"{role} rank" + ("s" if n != 1 else "")
    noun = {"engine": "rollout engine", "reward": "reward scorer", "agent": "agent runner"}.get(
        role, f"{role} process"
    )
    return noun + ("es" if noun.endswith("process") and n != 1 else "s" if n != 1 else "")


def verdict(snapshot: dict[str, Any]) -> list[str]:
    """One line per role (driver, actor, critic, reference, engine, reward, ...), odd ones named.

    A role whose processes are all in one place reads "2 of 2 actor ranks in ..."; otherwise the
    largest group is counted and every process outside it named with where it is. Processes that did
    not answer are named with their kernel state, then nodes whose collector never answered."""
    by_role: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in snapshot.get("processes") or []:
        by_role[p.get("role") or "other"].append(p)
    order = ["driver", "actor", "critic", "reference", "engine", "agent", "reward"]
    lines = []
    for role in sorted(by_role, key=lambda r: (order.index(r) if r in order else len(order), r)):
        procs = sorted(by_role[role], key=lambda p: (p.get("rank") is None, p.get("rank") or 0, p["pid"]))
        answered = [p for p in procs if p.get("answered")]
        silent = [p for p in procs if not p.get("answered")]
        groups: dict[str, list[tuple[dict[str, Any], Where]]] = defaultdict(list)
        for p in answered:
            w = where(p)
            groups[w.key].append((p, w))
        parts = []
        ranked = sorted(groups.values(), key=lambda g: -len(g))
        if ranked:
            main = ranked[0]
            if len(procs) == 1:
                parts.append(f"{main[0][0]['who']} {_place(main[0][1])}")
            elif len(main) > 1:
                parts.append(f"{len(main)} of {len(procs)} {_plural(role, len(procs))} {_place(main[0][1])}")
            else:
                ranked = [[m] for g in ranked for m in g]  # all apart: name each
                main = []
            for group in ranked[1 if main else 0 :]:
                for p, w in group:
                    parts.append(f"{p['who']} {_place(w)}")
        for p in silent:
            parts.append(
                f"{p['who']} (pid {p['pid']}, pod {p['pod']}) did not answer within "
                f"{p.get('limit_seconds', '?')} s (state {p.get('state', 'unknown')})"
            )
        lines.append("; ".join(parts))
    lines.extend(f"node {n}" for n in snapshot.get("silent_nodes") or [])
    traces = snapshot.get("nccl_traces") or []
    if traces:
        lines.append(
            "NCCL flight recorder dumps (a collective timed out): "
            + ", ".join(f"{t['file']} ({t['bytes']} bytes) on {t['pod']}" for t in traces)
        )
    return lines


def _place(w: Where) -> str:
    return f"{w.key} ← {w.detail}" if w.detail else w.key


def annotate(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The snapshot with its verdict (`verdict`) and, per answering process, the thread it read
    (`work_thread`), so a reader of the dump (or the operator trimming it) needs no reducer."""
    for p in snapshot.get("processes") or []:
        if p.get("answered"):
            t = work_thread(p)
            p["work_thread"] = t.get("ident") if t else None
            p["where"] = _place(where(p))
    snapshot["verdict"] = verdict(snapshot)
    return snapshot
