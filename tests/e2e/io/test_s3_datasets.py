"""data.prompts and data.eval.prompts as s3:// objects on the real S3 server: JSONL and Parquet rows of
chat messages (with a system turn) read back exactly as from the local file, in the same order, through
ranged reads; a missing object and a refused key fail naming the field."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlhf_trainer.data import DatasetError, EvalPrompts, ParquetRows, PromptDataset
from testkit.object_store import ObjectStore

pytestmark = pytest.mark.io
BUCKET = "io-datasets"


def _rows(n: int) -> list[dict[str, Any]]:
    """verl-style rows: chat messages with a system turn, a ground truth, a source and extra info."""
    return [
        {
            "data_source": "short" if i % 3 else "long",
            "prompt": [
                {"role": "system", "content": f"You are terse ({i})."},
                {"role": "user", "content": f"What is {i} + {i}? " + "x" * (i % 7)},
            ],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"index": i, "note": random.Random(i).randbytes(1500).hex()},  # incompressible bulk
        }
        for i in range(n)
    ]


@pytest.fixture
def store(object_store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    """The trainer's process env as a pod's: the AWS variables of spec.storage.s3's Secret."""
    for name, value in object_store.env().items():
        monkeypatch.setenv(name, value)
    object_store.bucket(BUCKET)
    return object_store


def _upload(store: ObjectStore, path: Path) -> str:
    store.client().upload_file(str(path), BUCKET, f"prompts/{path.name}")
    return f"s3://{BUCKET}/prompts/{path.name}"


def _draws(dataset: PromptDataset, batches: int, size: int) -> list[Any]:
    return [dataset.next_batch(size) for _ in range(batches)]


def test_jsonl_of_chat_messages_reads_back_as_the_local_file_in_the_same_order(
    store: ObjectStore, tmp_path: Path
) -> None:
    local = tmp_path / "train.jsonl"
    local.write_text(
        "".join(json.dumps(r) + "\n" + ("\n" if i == 4 else "") for i, r in enumerate(_rows(40)))
    )
    url = _upload(store, local)
    remote, here = (
        PromptDataset(url, "prompt", None, seed=7),
        PromptDataset(str(local), "prompt", None, seed=7),
    )
    assert len(remote) == len(here) == 40
    assert remote.first_chat == here.first_chat == "line 1"
    drawn = _draws(remote, 12, 8)  # 96 rows: two epochs and a part, each reshuffled
    assert drawn == _draws(here, 12, 8)
    assert drawn[0].prompts[0][0]["role"] == "system"
    assert remote.position == here.position
    evaluation = EvalPrompts(url, "prompt", None, max_prompts=10)
    assert list(evaluation.batches(4)) == list(
        EvalPrompts(str(local), "prompt", None, max_prompts=10).batches(4)
    )


def test_parquet_of_chat_messages_reads_back_as_the_local_file_one_row_group_at_a_time(
    store: ObjectStore, tmp_path: Path
) -> None:
    local = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(128)), local, row_group_size=16)  # about 400 KB, 8 groups
    url = _upload(store, local)
    remote, here = (
        PromptDataset(url, "prompt", None, seed=3),
        PromptDataset(str(local), "prompt", None, seed=3),
    )
    assert len(remote) == 128
    assert _draws(remote, 20, 16) == _draws(here, 20, 16)
    # Opening reads the footer and the prompt column; a batch, the row groups its rows are in (at most
    # two): never the object, whose bulk is in another column.
    fresh = PromptDataset(url, "prompt", None, seed=3)
    fresh.next_batch(4)
    rows = fresh.rows
    assert isinstance(rows, ParquetRows) and rows.source_reader is not None
    size = local.stat().st_size
    assert rows.source_reader.bytes_read < size / 2, (rows.source_reader.bytes_read, size)


def test_a_missing_object_or_a_refused_key_fails_naming_the_field(
    store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        DatasetError, match=rf"^data.prompts s3://{BUCKET}/prompts/none.jsonl: no such object"
    ):
        PromptDataset(f"s3://{BUCKET}/prompts/none.jsonl", "prompt", None, seed=0)
    with pytest.raises(DatasetError, match=r"^data.eval.prompts s3://no-such-bucket/e.parquet: no such"):
        EvalPrompts("s3://no-such-bucket/e.parquet", "prompt", None)
    local = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(4)), local)
    url = _upload(store, local)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(DatasetError, match=rf"^data.prompts {url}: access refused \(403\): check the keys"):
        PromptDataset(url, "prompt", None, seed=0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN")
    with pytest.raises(DatasetError, match=rf"^data.eval.prompts {url}: access refused"):
        EvalPrompts(url, "prompt", None)
