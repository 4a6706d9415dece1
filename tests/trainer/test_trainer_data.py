"""The prompt dataset (rlhf_trainer.data): .jsonl and .parquet read from an index, the seeded order and
its resumable position, prompt shapes and the errors that name the field and the row."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlhf_trainer import data as data_mod
from rlhf_trainer.data import DatasetError, PromptDataset

pytestmark = pytest.mark.unit

ROWS: list[dict[str, Any]] = [{"prompt": f"p{i}", "answer": i} for i in range(7)]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


def write_jsonl(path: Path, rows: list[Any], blank_after: int | None = None) -> Path:
    with path.open("w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(row) + "\n")
            if i == blank_after:
                f.write("\n")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def drawn(ds: PromptDataset, n: int) -> tuple[list[Any], list[Any], list[Any]]:
    batch = ds.next_batch(n)
    return batch.prompts, batch.labels, batch.columns


def test_jsonl_rows_come_in_the_order_the_old_reader_served(tmp_path: Path) -> None:
    """The same file, seed and position give the rows the whole-file reader gave (its output, recorded
    from the implementation before streaming): a checkpoint's data position resumes where it was."""
    path = write_jsonl(tmp_path / "p.jsonl", ROWS, blank_after=3)
    ds = PromptDataset(str(path), "prompt", "answer", seed=3)
    prompts, labels, _ = drawn(ds, 17)
    assert prompts == [
        "p2",
        "p1",
        "p5",
        "p3",
        "p4",
        "p6",
        "p0",
        "p0",
        "p1",
        "p2",
        "p6",
        "p3",
        "p5",
        "p4",
        "p2",
        "p6",
        "p3",
    ]
    assert labels == [2, 1, 5, 3, 4, 6, 0, 0, 1, 2, 6, 3, 5, 4, 2, 6, 3]
    assert ds.position.to_dict() == {"epoch": 2, "offset": 3}
    ds.restore({"epoch": 5, "offset": 4})
    assert drawn(ds, 5)[0] == ["p2", "p6", "p3", "p3", "p6"]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_restored_position_serves_the_rows_the_run_would_have(tmp_path: Path, fmt: str) -> None:
    rows = [{"prompt": f"p{i}", "answer": i} for i in range(23)]
    path = (
        write_jsonl(tmp_path / "p.jsonl", rows)
        if fmt == "jsonl"
        else write_parquet(tmp_path / "p.parquet", rows, 4)
    )
    run = PromptDataset(str(path), "prompt", None, seed=1)
    drawn(run, 30)
    saved = run.position.to_dict()
    later = [drawn(run, 5)[0] for _ in range(6)]
    resumed = PromptDataset(str(path), "prompt", None, seed=1)
    resumed.restore(saved)
    assert [drawn(resumed, 5)[0] for _ in range(6)] == later


def test_a_parquet_file_of_one_row_group_serves_the_jsonl_rows_in_the_same_order(tmp_path: Path) -> None:
    user = [{"role": "user", "content": f"p{i}"} for i in range(9)]
    rows = [
        {"prompt": [u], "answer": i, "data_source": "s", "extra_info": {"i": i}} for i, u in enumerate(user)
    ]
    rows[4]["prompt"] = CHAT  # a column is all texts or all message lists in Parquet
    jl = PromptDataset(str(write_jsonl(tmp_path / "p.jsonl", rows)), "prompt", "answer", seed=5)
    pqt = PromptDataset(str(write_parquet(tmp_path / "p.parquet", rows)), "prompt", "answer", seed=5)
    for _ in range(5):  # across epochs
        assert drawn(pqt, 4) == drawn(jl, 4)
    assert (jl.first_chat, pqt.first_chat) == ("line 1", "row 0 (counting from 0)")


def test_parquet_row_groups_are_read_on_demand_once_an_epoch_two_at_most_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [{"prompt": f"p{i}"} for i in range(40)]
    ds = PromptDataset(str(write_parquet(tmp_path / "p.parquet", rows, 4)), "prompt", None, seed=2)
    rows_reader = ds.rows
    assert isinstance(rows_reader, data_mod.ParquetRows)
    reads: list[int] = []
    real = rows_reader.file.read_row_group
    monkeypatch.setattr(rows_reader.file, "read_row_group", lambda g, **kw: reads.append(g) or real(g, **kw))
    seen: list[Any] = []
    while len(seen) < 40:
        seen += drawn(ds, 8)[0]
        assert len(rows_reader._cache) <= data_mod.SHUFFLE_WINDOW_ROW_GROUPS
    assert sorted(seen) == sorted(r["prompt"] for r in rows)  # an epoch serves every row once
    assert sorted(reads) == list(range(10))  # each of its 10 row groups read once
    assert seen != [r["prompt"] for r in rows]  # shuffled


def test_prompts_may_be_chat_messages_and_other_columns_come_with_them(tmp_path: Path) -> None:
    verl = {
        "data_source": "gsm8k",
        "prompt": CHAT,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"index": 7},
    }
    for path in (write_jsonl(tmp_path / "v.jsonl", [verl]), write_parquet(tmp_path / "v.parquet", [verl])):
        prompts, labels, columns = drawn(PromptDataset(str(path), "prompt", None, seed=0), 1)
        assert prompts == [CHAT] and labels == [None]
        assert columns == [{**{k: v for k, v in verl.items() if k != "prompt"}, "ground_truth": "4"}]


def test_a_rows_own_ground_truth_is_not_replaced_by_the_nested_one() -> None:
    row = {"prompt": "p", "ground_truth": "mine", "reward_model": {"ground_truth": "nested"}}
    assert data_mod.reward_columns(row, "prompt")["ground_truth"] == "mine"


@pytest.mark.parametrize(
    "lines, needle",
    [
        (['{"prompt": "a"}', "{not json"], "line 2: not JSON"),
        (['{"prompt": "a"}', "", '{"text": "b"}'], "line 3: no field 'prompt' (data.inputKey)"),
        (['{"prompt": 3}'], "line 1: field 'prompt' (data.inputKey) is int"),
        (['{"prompt": []}'], "line 1: field 'prompt' (data.inputKey) is list, not a string or a non-empty"),
        (['{"prompt": [{"role": "tool", "content": "x"}]}'], "line 1: field 'prompt' (data.inputKey) message 0 has role 'tool'"),
        (['{"prompt": "a"}', '{"prompt": [{"role": "user", "content": 1}]}'], "line 2: field 'prompt' (data.inputKey) message 0 has content of type int"),
        (['{"prompt": [{"role": "user"}]}'], "message 0 is not an object with exactly the keys 'role' and 'content'"),
        (["[1, 2]"], "line 1: not a JSON object"),
        ([], "no prompts"),
    ],
)  # fmt: skip
def test_a_bad_jsonl_line_is_named(tmp_path: Path, lines: list[str], needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(DatasetError) as e:
        PromptDataset(str(path), "prompt", None, seed=0)
    assert str(e.value).startswith(f"data.prompts {path}: ") and needle in str(e.value)


def test_a_jsonl_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match="line 2: not UTF-8"):
        PromptDataset(str(path), "prompt", None, seed=0)


def test_a_bad_parquet_row_is_named_counting_from_0(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [{"prompt": [{"role": "user", "content": "x"}]} for _ in range(9)]
    rows[6]["prompt"] = [{"role": "robot", "content": "x"}]
    path = write_parquet(tmp_path / "bad.parquet", rows, 4)
    with pytest.raises(
        DatasetError, match=r"bad.parquet: row 6 \(counting from 0\): column 'prompt' .* 'robot'"
    ):
        PromptDataset(str(path), "prompt", None, seed=0)


@pytest.mark.parametrize(
    "table, needle",
    [
        (pa.table({"text": ["a"]}), "no column 'prompt' (data.inputKey); columns: ['text']"),
        (pa.table({"prompt": ["a"], "blob": [b"\x00"]}), "column 'blob' has type binary, which is not JSON"),
        (pa.table({"prompt": ["a"], "meta": pa.array([{"t": 1}], pa.struct([("t", pa.timestamp("s"))]))}), "column 'meta' has type struct<t: timestamp"),
    ],
)  # fmt: skip
def test_a_parquet_schema_without_the_prompt_or_with_a_non_json_column_is_refused(
    tmp_path: Path, table: pa.Table, needle: str
) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetError) as e:
        PromptDataset(str(path), "prompt", None, seed=0)
    assert str(e.value).startswith(f"data.prompts {path}: ") and needle in str(e.value)


@pytest.mark.parametrize(
    "name, needle",
    [
        ("p.json", "unknown format .json: use .jsonl or .parquet"),
        ("p", "unknown format (no extension)"),
        ("missing.jsonl", "cannot read"),
        ("missing.parquet", "cannot read as Parquet"),
        ("p.parquet", "cannot read as Parquet"),  # JSON text in it
    ],
)
def test_a_path_that_is_not_a_readable_jsonl_or_parquet_file_is_named(
    tmp_path: Path, name: str, needle: str
) -> None:
    path = tmp_path / name
    if name.startswith("p"):
        path.write_text('{"prompt": "a"}\n')
    with pytest.raises(DatasetError, match=f"data.prompts {re.escape(str(path))}: .*{re.escape(needle)}"):
        PromptDataset(str(path), "prompt", None, seed=0)


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("gs://bucket/p.parquet", "a local path or an s3://bucket/key URL"),
        ("https://host/p.jsonl", "a local path or an s3://bucket/key URL"),
        ("s3://b/p.parquet", "'b' is not an S3 bucket name"),
        ("s3://bucket/", "no object key after the bucket"),
    ],
)
def test_a_url_other_than_an_s3_object_is_refused_naming_the_field(url: str, needle: str) -> None:
    """s3:// objects are read (tests/e2e/io); other schemes and malformed s3:// URLs are refused before any
    request, naming the field."""
    with pytest.raises(DatasetError, match=f"data.prompts {re.escape(url)}: {re.escape(needle)}"):
        PromptDataset(url, "prompt", None, seed=0)


def test_preflight_refuses_chat_prompts_when_the_actor_has_no_chat_template(tmp_path: Path) -> None:
    """Chat messages need the actor's chat template: the trainer says so, naming the line, before Ray."""
    import yaml
    from rlhf_api.spec import RLHFJobSpec
    from rlhf_trainer.cli import apply_overrides
    from rlhf_trainer.config import InputError, preflight

    actor = tmp_path / "actor"
    actor.mkdir()
    (actor / "config.json").write_text('{"num_attention_heads": 2, "num_key_value_heads": 2}')
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": CHAT}])
    example = Path(__file__).resolve().parents[2] / "examples" / "rlhfjob-tiny.yaml"
    # The example's critic is the tiny model under /tmp, made by other tests: the actor's directory stands
    # in for it, so that this test needs nothing it does not make.
    sets = [f"model.actor={actor}", f"model.critic={actor}", f"data.prompts={prompts}", "algorithm.klCoef=0"]
    manifest = apply_overrides(yaml.safe_load(example.read_text()), sets)
    spec = RLHFJobSpec.model_validate(manifest["spec"], by_alias=True, by_name=False)
    with pytest.raises(
        InputError, match=rf"spec.data.prompts {re.escape(str(prompts))}: line 2: a chat-message"
    ):
        preflight(spec)
    (actor / "chat_template.jinja").write_text("{{ messages }}")
    assert preflight(spec).first_chat == "line 2"
