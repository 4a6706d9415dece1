"""The actor's export off the head (issue 33, item 5): the driver's path runs it as a Ray task elsewhere,
its memory stays flat, and what is written is sharded safetensors with an index that loads as the checkpoint.

Checkpoints are real: the trainer's own `ModelRank` (DeepSpeed ZeRO-3, 1 rank, gloo) saves the tiny model
through `CheckpointStore` (benchmarks/lib/zero_checkpoint.py, which the 135M benchmark uses too). The base
model's weights are then replaced, so an export that read them instead of the checkpoint would show.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from lib import zero_checkpoint
from lib.common import status_kib
from testkit.trainer_runs import EXAMPLE, spec_of, tiny_sets

pytestmark = pytest.mark.trainer

GOAL_MIB = 100  # the driver's peak RSS growth during an export, whatever the model's size


def _checkpoint(tiny: Path, root: Path, *, tied: bool) -> Path:
    """A checkpoint of (a copy of) the tiny model, whose base weights are then replaced by others."""
    from transformers import AutoConfig, LlamaForCausalLM

    base = root / "base"
    shutil.copytree(tiny / "model", base)
    config = AutoConfig.from_pretrained(base)
    if tied:
        config.tie_word_embeddings = True
        config.save_pretrained(base)
    zero_checkpoint.write(base, root / "ckpt")
    import torch

    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(base)  # type: ignore[no-untyped-call]
    return root / "ckpt"


@pytest.fixture(scope="module")
def ckpt(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tiny, tmp_path_factory.mktemp("untied"), tied=False)


@pytest.fixture(scope="module")
def tied_ckpt(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tiny, tmp_path_factory.mktemp("tied"), tied=True)


@pytest.fixture
def private_ray(ray_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh embedded Ray for what the driver connects (never a running head); shut down after."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "local")
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    monkeypatch.setenv("RLHF_WORKER_LOGS", "0")
    yield
    if ray.is_initialized():
        ray.shutdown()


def _spec(tiny: Path, ckpt: Path) -> object:
    from rlhf_trainer.config import parse_spec

    return parse_spec(spec_of(EXAMPLE, tiny_sets(tiny, ckpt)))


def _assert_loads_as_the_checkpoint(model_dir: Path, ckpt: Path) -> dict[str, object]:
    """Sharded safetensors with a complete index, loading in transformers with the checkpoint's weights."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert files == sorted(p.name for p in model_dir.glob("model-*-of-*.safetensors")), files
    assert not (model_dir / "model.safetensors").exists()
    stored: dict[str, str] = {}
    size = 0
    for f in files:
        with safe_open(str(model_dir / f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                stored[k] = f
                t = st.get_tensor(k)
                size += t.numel() * t.element_size()
    assert stored == index["weight_map"] and index["metadata"]["total_size"] == size
    expected = get_fp32_state_dict_from_zero_checkpoint(str(next(ckpt.glob("step-*"))), tag="actor")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    loaded = model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), f"{name} differs from the checkpoint"
    return index


def test_driver_exports_in_a_ray_task_beside_held_trainer_slots_with_flat_memory(
    tiny: Path, ckpt: Path, private_ray: None
) -> None:
    """As at the end of a run: Ray is up and the actor's ranks hold every trainer slot and CPU. The
    driver's `_export` runs the export in another process (pinned to the trainer node, waiting for
    neither), and its own peak RSS grows by less than GOAL_MIB while it waits."""
    import ray
    from rlhf_api.constants import TRAINER_RESOURCE
    from rlhf_trainer import driver

    ray.init(address="local", num_cpus=2, resources={TRAINER_RESOURCE: 1}, include_dashboard=False)

    @ray.remote(num_cpus=2, resources={TRAINER_RESOURCE: 1})
    class Rank:  # stands in for the actor's ranks: holds the node's only trainer slot and every CPU
        def pid(self) -> int:
            return os.getpid()

    rank = Rank.remote()  # type: ignore[attr-defined]
    ray.get(rank.pid.remote())
    lines: list[str] = []
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: count what the export adds
    before = status_kib("VmRSS")
    out = driver._export(_spec(tiny, ckpt), lines.append)  # type: ignore[arg-type]
    growth_mib = (status_kib("VmHWM") - before) / 1024
    assert out == str(ckpt / "model")
    assert ray.is_initialized(), "the driver's Ray was shut down by the export"
    pid = int(lines[-1].split("by pid ")[1].split()[0])
    assert pid != os.getpid(), f"the export ran in the driver's process: {lines[-1]}"
    assert growth_mib <= GOAL_MIB, f"the driver's peak RSS grew {growth_mib:.0f} MiB during the export"
    info = json.loads((ckpt / "model" / "rlhf_export.json").read_text())
    assert info["step"] == 1
    _assert_loads_as_the_checkpoint(ckpt / "model", ckpt)
    print(f"\ndriver peak RSS growth during the export: {growth_mib:.1f} MiB; {lines[-1]}")


def test_a_stale_export_before_ray_is_up_connects_and_exports_off_the_driver(
    tiny: Path, ckpt: Path, private_ray: None
) -> None:
    """The `nothing to do` path (Ray not started): `_export_if_stale` connects Ray, exports in a task,
    and leaves Ray as it found it (down)."""
    import ray
    from rlhf_trainer import driver

    shutil.rmtree(ckpt / "model", ignore_errors=True)
    assert not ray.is_initialized()
    lines: list[str] = []
    out = driver._export_if_stale(_spec(tiny, ckpt), 1, lines.append)  # type: ignore[arg-type]
    assert out == str(ckpt / "model")
    assert not ray.is_initialized(), "the Ray the export started was left running"
    pid = int(lines[-1].split("by pid ")[1].split()[0])
    assert pid != os.getpid(), f"the export ran in the driver's process: {lines[-1]}"
    _assert_loads_as_the_checkpoint(ckpt / "model", ckpt)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_cuts_bounded_shards_that_load_as_the_checkpoint(
    request: pytest.FixtureRequest, tmp_path: Path, tied: bool
) -> None:
    """`export_actor` (also `rlhf export`) with a small shard bound: several shards, none over the bound
    unless one tensor is, and the weights load back equal to the checkpoint's; a tied lm_head is not
    written (it is the embedding) and comes back tied."""
    from rlhf_trainer.export import export_actor

    ckpt: Path = request.getfixturevalue("tied_ckpt" if tied else "ckpt")
    bound = 300_000  # bytes; the tiny model is 1.8 MB in float32, its biggest tensor 262 kB
    out = export_actor(ckpt, tmp_path / "model", max_shard_bytes=bound)
    assert out.pid == os.getpid() and out.shards >= 5, out
    index = _assert_loads_as_the_checkpoint(out.path, ckpt)
    weight_map: dict[str, str] = index["weight_map"]  # type: ignore[assignment]
    assert ("lm_head.weight" in weight_map) is not tied
    for f in {*weight_map.values()}:
        assert (out.path / f).stat().st_size <= bound + 4096, f  # + the safetensors header
    assert not list(tmp_path.glob(".tmp-*")), "the temp directory outlived the export"
