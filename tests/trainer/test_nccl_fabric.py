"""NCCL's transport, read from its INFO lines (rlhf_trainer.stacks.nccl), and the operator's
FabricDegraded condition from it (rlhf_operator.fabric). The GPU path cannot run here: the inputs are
NCCL 2.2x log lines as NCCL prints them with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET (an
InfiniBand node, a node whose HCAs are missing so NCCL falls back to sockets, an EFA node)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from rlhf_api.spec import RLHFJobSpec
from rlhf_operator.fabric import asks_rdma, fabric_condition
from rlhf_operator.scrape import parse_metrics
from rlhf_trainer.stacks import nccl

pytestmark = pytest.mark.unit
NOW = datetime(2026, 11, 27, tzinfo=UTC)

IB = """\
gpu-a:4120:4120 [0] NCCL INFO Bootstrap : Using eth0:10.42.0.17<0>
gpu-a:4120:4120 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so), using internal implementation
gpu-a:4120:4188 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.42.0.17<0>
gpu-a:4120:4188 [0] NCCL INFO Using network IB
gpu-a:4120:4188 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-a:4120:4188 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
gpu-a:4120:4188 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [send] via NET/IB/1/GDRDMA
"""
SOCKETS = """\
gpu-b:977:1010 [0] NCCL INFO NET/IB : No device found.
gpu-b:977:1010 [0] NCCL INFO NET/Socket : Using [0]eth0:10.42.1.9<0>
gpu-b:977:1010 [0] NCCL INFO Using network Socket
gpu-b:977:1010 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
"""
EFA = """\
gpu-c:88:130 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)
gpu-c:88:130 [0] NCCL INFO Using network AWS Libfabric
"""


def test_the_network_devices_and_channels_nccl_chose() -> None:
    ib = nccl.transport(IB.splitlines())
    assert (ib.network, ib.devices, ib.rdma, ib.sockets) == (
        "IB",
        ["mlx5_0:1/IB", "mlx5_1:1/IB"],
        True,
        False,
    )
    assert ib.channels == ["P2P/CUMEM", "NET/IB"]
    sock = nccl.transport(SOCKETS.splitlines())
    assert (sock.network, sock.devices, sock.rdma, sock.sockets) == (
        "Socket",
        ["eth0:10.42.1.9<0>"],
        False,
        True,
    )
    efa = nccl.transport(EFA.splitlines())
    assert (efa.network, efa.rdma) == ("AWS Libfabric", True)
    assert nccl.transport([]).network is None


def test_a_process_reads_its_own_debug_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nccl.DIR_ENV, str(tmp_path))
    (tmp_path / "nccl.gpu-b.977.log").write_text(SOCKETS)
    assert nccl.own_transport(977).network == "Socket"
    assert nccl.own_transport(978).network is None
    env = nccl.env_defaults(tmp_path)
    assert env["NCCL_DEBUG_FILE"] == f"{tmp_path}/nccl.%h.%p.log" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # a job's own setting wins
    nccl.apply_defaults()
    import os

    assert os.environ["NCCL_DEBUG"] == "WARN" and os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"


def spec(resources: dict[str, object] | None, where: str = "fabric") -> RLHFJobSpec:
    pods: dict[str, object] = {where: {"resources": {"limits": resources}}} if resources else {}
    return RLHFJobSpec.model_validate(
        {
            "model": {"actor": "/m", "reward": {"type": "function", "function": "m:f"}},
            "data": {"prompts": "/p"},
            "pods": pods,
        }
    )


def test_a_job_asks_for_rdma_through_the_device_resources_of_its_nccl_pods() -> None:
    assert asks_rdma(spec({"rdma/ib": 1}))
    assert asks_rdma(spec({"vpc.amazonaws.com/efa": 4}, "trainer"))
    assert asks_rdma(spec({"nvidia.com/hostdev": 1, "rdma/hca_shared_devices_a": 1}))
    assert not asks_rdma(spec({"memory": "64Gi"}))
    assert not asks_rdma(spec(None))


def test_fabric_degraded_when_an_rdma_job_runs_on_sockets() -> None:
    metrics = parse_metrics(
        'rlhf_nccl_transport{rlhfjob="j",process="actor rank 0",network="IB"} 1\n'
        'rlhf_nccl_transport{rlhfjob="j",process="actor rank 1",network="Socket"} 1\n'
    )
    assert metrics.nccl_networks == {"actor rank 0": "IB", "actor rank 1": "Socket"}
    conds, said = fabric_condition([], True, metrics.nccl_networks, NOW)
    (cond,) = conds
    assert (cond["type"], cond["status"], cond["reason"]) == ("FabricDegraded", "True", "SocketTransport")
    assert said and "1 of 2 NCCL processes run over TCP sockets" in said and "actor rank 1" in said
    again, said_again = fabric_condition(conds, True, metrics.nccl_networks, NOW)
    assert said_again is None and again[0]["lastTransitionTime"] == cond["lastTransitionTime"]  # once
    healthy, _ = fabric_condition(conds, True, {"actor rank 0": "IB", "actor rank 1": "IB"}, NOW)
    assert healthy[0]["status"] == "False" and healthy[0]["message"] == "NCCL over IB"
    assert fabric_condition([], False, metrics.nccl_networks, NOW) == ([], None)  # asked for no RDMA
