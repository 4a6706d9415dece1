"""NCCL on the GPU path: the settings that make a collective hang diagnosable, and the transport each
rank actually got (an RDMA fabric asked for can silently fall back to TCP sockets).

Set by default in every CUDA rank and engine (a job's own `pods.env` wins, as with any setdefault):
torch's flight recorder (the last `TRACE_ENTRIES` collectives of each process group, dumped to
`<dir>/trace_<rank>` when a collective times out, where a stack snapshot picks it up) and NCCL's
INIT and NET lines written to a file per process (not the job's log), which `transport` reads.

None of this runs on the CPU stand-in (gloo has no NCCL): the parser is tested on recorded NCCL lines
(tests/trainer/test_nccl_fabric.py) and was not run on a GPU here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

DIR_ENV = "RLHF_NCCL_DEBUG_DIR"
DEFAULT_DIR = "/tmp/rlhf-nccl"
TRACE_ENTRIES = 2000
RDMA_NETWORKS = ("IB", "AWS Libfabric", "OFI", "RoCE", "GDRDMA")


def debug_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR)


def env_defaults(root: Path | None = None) -> dict[str, str]:
    """The NCCL and torch settings a CUDA process sets before its first communicator."""
    root = root or debug_dir()
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_ENTRIES),
        "TORCH_FR_BUFFER_SIZE": str(TRACE_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(root / "trace_"),
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": str(root / "nccl.%h.%p.log"),
    }


def apply_defaults() -> None:
    """Set `env_defaults` where the environment does not already say otherwise; make the directory."""
    root = debug_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # no writable directory: NCCL and torch keep their own defaults
    for key, value in env_defaults(root).items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class Transport:
    """What NCCL chose: `network` ("IB", "Socket", "AWS Libfabric"; None when no line said), the
    devices it uses, and the transports its channels go over ("NET/IB", "P2P/IPC", "SHM", ...)."""

    network: str | None
    devices: list[str] = field(default_factory=list)
    channels: list[str] = field(default_factory=list)

    @property
    def rdma(self) -> bool:
        return self.network is not None and any(n.lower() in self.network.lower() for n in RDMA_NETWORKS)

    @property
    def sockets(self) -> bool:
        return self.network is not None and self.network.lower() == "socket"


_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_DEVICES = re.compile(r"NCCL INFO NET/(\w+)\s*: Using (.+?)(?:\s*;\s*OOB.*)?\s*$")
_CHANNEL = re.compile(r"NCCL INFO Channel \d+(?:/\d+)? : .* via (\S+)")


def transport(lines: Iterable[str]) -> Transport:
    """The transport from NCCL's INFO lines of one process (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET)."""
    network: str | None = None
    devices: list[str] = []
    channels: list[str] = []
    for line in lines:
        if m := _NETWORK.search(line):
            network = m.group(1)
        elif m := _DEVICES.search(line):
            devices = re.findall(r"\[\d+\](\S+)", m.group(2))
            network = network or m.group(1)
        elif m := _CHANNEL.search(line):
            via = "/".join(m.group(1).split("/")[:2])
            if via not in channels:
                channels.append(via)
    return Transport(network, devices, channels)


def own_transport(pid: int | None = None) -> Transport:
    """This process's transport from its NCCL debug file (NCCL_DEBUG_FILE with %h and %p filled)."""
    pid = pid or os.getpid()
    found = sorted(debug_dir().glob(f"nccl.*.{pid}.log"))
    if not found:
        return Transport(None)
    return transport(found[-1].read_text(errors="replace").splitlines())
