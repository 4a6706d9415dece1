"""Reads a W&B offline run's data file (`run-<id>.wandb`) record by record, as `wandb sync` would upload
them: the installed wandb (0.31, whose core is Go) ships no Python reader, so this follows its documented
LevelDB-log layout (a 7-byte header `:W&B` + magic 0xBEE1 + version, then 32 KiB blocks of records, each
a 4-byte checksum, a 2-byte length, a 1-byte type (full, first, middle, last) and its bytes) and parses each
record with wandb's own protobuf (`wandb.proto.wandb_internal_pb2.Record`).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

HEADER = 7
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    """Every record of the run's data file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise AssertionError(f"{path} is not a W&B data file (header {data[:7]!r})")
    out: list[Any] = []
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, FIRST):
            pending = chunk
        elif kind in (MIDDLE, LAST):
            pending += chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict[str, str]]:
    """The run's logged rows (`run.log`), each as key -> JSON text of its value."""
    rows = []
    for r in read_records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): i.value_json for i in r.history.item})
    return rows


def config(path: Path) -> dict[str, str]:
    """The run's config (`run.config.update`), key -> JSON text of its value, the last update winning."""
    out: dict[str, str] = {}
    for r in read_records(path):
        if r.WhichOneof("record_type") == "config":
            out.update({i.key or "/".join(i.nested_key): i.value_json for i in r.config.update})
    return out
