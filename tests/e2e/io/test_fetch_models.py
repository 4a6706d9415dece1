"""The `fetch-models` step against a real S3 server (moto's, over HTTP; tests/conftest.py `object_store`):
a tiny model fetched into the cache loads back with the same weights; a second fetch of the same revision
transfers 0 bytes; a half-written entry is fetched again; a missing prefix is ModelNotFound and a wrong
key CredentialsRefused, also through the command's exit status and termination message. No pods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from rlhf_api.model_source import COMPLETE_MARKER
from rlhf_trainer import fetch_models
from rlhf_trainer.fetch_models import fetch
from rlhf_trainer.model_cache import FetchError

if TYPE_CHECKING:
    from testkit.object_store import ObjectStore

pytestmark = pytest.mark.io

BUCKET = "rlhf-models"


@pytest.fixture(scope="module")
def tiny_in_s3(object_store: ObjectStore, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The tests' tiny model (HF format, safetensors and tokenizer) uploaded under s3://rlhf-models/tiny."""
    from rlhf_trainer.tiny_model import make_tiny_model

    model = Path(make_tiny_model(tmp_path_factory.mktemp("tiny"), num_prompts=8)["model"])
    client = object_store.client()
    object_store.bucket(BUCKET)
    for f in sorted(model.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), BUCKET, f"tiny/{f.relative_to(model)}")
    return model, f"s3://{BUCKET}/tiny"


@pytest.fixture
def s3_env(object_store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AWS variables a pod gets from spec.storage.s3.credentialsSecret, as the fetcher reads them."""
    for key, value in object_store.env().items():
        monkeypatch.setenv(key, value)


def _state(model: Path) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).state_dict())


@pytest.mark.usefixtures("s3_env")
def test_fetch_loads_back_and_a_second_fetch_moves_nothing(
    tiny_in_s3: tuple[Path, str], tmp_path: Path
) -> None:
    import torch
    from transformers import AutoTokenizer

    model, uri = tiny_in_s3
    size = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    seen: list[tuple[int, int]] = []
    first = fetch({"model.actor": uri}, str(tmp_path), report=lambda d, t, _: seen.append((d, t)))
    assert (first.bytes_fetched, first.bytes_total) == (size, size)
    assert seen[0] == (0, size) and seen[-1] == (size, size)  # progress from nothing to all of it
    local = Path(first.paths["model.actor"])
    assert local.name == "current" and (local / COMPLETE_MARKER).is_file()
    fetched, original = _state(local), _state(model)
    assert fetched.keys() == original.keys()
    assert all(torch.equal(fetched[k], original[k]) for k in original)  # type: ignore[arg-type]
    assert AutoTokenizer.from_pretrained(str(local)).encode("ba ke") == AutoTokenizer.from_pretrained(
        str(model)
    ).encode("ba ke")

    second = fetch({"model.actor": uri}, str(tmp_path))
    assert (second.bytes_fetched, second.bytes_total) == (0, 0)
    assert second.paths == first.paths


@pytest.mark.usefixtures("s3_env")
def test_a_half_written_entry_is_fetched_again(tiny_in_s3: tuple[Path, str], tmp_path: Path) -> None:
    _, uri = tiny_in_s3
    first = fetch({"model.actor": uri}, str(tmp_path))
    entry = Path(first.paths["model.actor"]).resolve()
    (entry / COMPLETE_MARKER).unlink()  # as a fetch killed before its last write leaves it
    (entry / "config.json").write_text("{")  # and a torn file in it
    again = fetch({"model.actor": uri}, str(tmp_path))
    assert again.bytes_fetched == first.bytes_fetched > 0
    assert json.loads((entry / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.usefixtures("s3_env")
def test_a_missing_model_is_model_not_found(object_store: ObjectStore, tmp_path: Path) -> None:
    object_store.bucket(BUCKET)
    with pytest.raises(FetchError) as missing:
        fetch({"model.critic": f"s3://{BUCKET}/no-such-model"}, str(tmp_path))
    assert (missing.value.reason, missing.value.field) == ("ModelNotFound", "model.critic")
    with pytest.raises(FetchError) as no_bucket:
        fetch({"model.actor": "s3://no-such-bucket/model"}, str(tmp_path))
    assert no_bucket.value.reason == "ModelNotFound"


@pytest.mark.usefixtures("s3_env")
def test_a_wrong_key_is_credentials_refused(
    tiny_in_s3: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(FetchError) as refused:
        fetch({"model.actor": tiny_in_s3[1]}, str(tmp_path))
    assert refused.value.reason == "CredentialsRefused"
    assert "spec.model.actor" in refused.value.message


@pytest.mark.usefixtures("s3_env")
def test_the_command_ends_a_missing_model_with_its_reason(
    object_store: ObjectStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the operator reads: exit status 2 (no retry helps), the classified termination message; run
    as the operator's init container runs it (--cache, --source)."""
    object_store.bucket(BUCKET)
    log = tmp_path / "termination-log"
    argv = [
        "--cache",
        str(tmp_path),
        "--source",
        f"model.actor=s3://{BUCKET}/gone",
        "--termination-log",
        str(log),
    ]
    assert fetch_models.main(argv) == 2
    assert json.loads(log.read_text())["reason"] == "ModelNotFound"
    assert "error: ModelNotFound: spec.model.actor" in capsys.readouterr().out
