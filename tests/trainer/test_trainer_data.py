"""The prompt dataset (rlhf_trainer.data): .jsonl and .parquet read from an index, the seeded order and
its resumable position, prompt shapes and the errors that name the field and the row."""

from __future__ import annotations

import http.server
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlhf_trainer import data as data_mod
from rlhf_trainer.data import DatasetError, DatasetUnavailable, EvalPrompts, PromptDataset
from testkit.support import free_port

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


# s3:// datasets whose store fails, read by a real botocore client over HTTP: the store's own failure
# (unreachable, a 5xx, throttling) is DatasetUnavailable, which is not an input error, so the attempt
# fails and the operator restarts it; the request's (no such object, refused keys) stays a DatasetError.


def _point_s3_at(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str) -> None:
    """The pod's S3 variables (spec.storage.s3's Secret) aimed at `endpoint`: one attempt per request,
    no config file, no proxy, no instance metadata, so that a failure comes back at once."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "AKIATEST",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_REGION": "us-east-1",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_RETRY_MODE": "standard",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "NO_PROXY": "127.0.0.1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@dataclass
class _Answers:
    """What the stub store answers: to every HEAD, then to every GET (status, S3 error code)."""

    head: int = 200
    get: tuple[int, str] = (200, "")


@pytest.fixture
def stub_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[_Answers]:
    """An HTTP server on loopback answering S3 requests with the statuses asked for (a HEAD: a 1 KiB
    object; a GET: an S3 XML error), the S3 variables pointed at it."""
    answers = _Answers()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(answers.head)
            self.send_header("Content-Length", "1024" if answers.head == 200 else "0")
            self.send_header("ETag", '"e"')
            self.end_headers()

        def do_GET(self) -> None:
            status, code = answers.get
            body = f"<Error><Code>{code}</Code><Message>m</Message></Error>".encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    _point_s3_at(monkeypatch, tmp_path, f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield answers
    finally:
        server.shutdown()
        server.server_close()


def test_an_unreachable_store_is_unavailable_not_a_dataset_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Nothing listens at the endpoint: the JSONL prompts and the Parquet eval split each fail as
    DatasetUnavailable (not a ValueError), naming the field and the URL."""
    _point_s3_at(monkeypatch, tmp_path, f"http://127.0.0.1:{free_port()}")
    with pytest.raises(DatasetUnavailable) as e:
        PromptDataset("s3://bucket/p.jsonl", "prompt", None, seed=0)
    assert not isinstance(e.value, ValueError)
    assert str(e.value).startswith("data.prompts s3://bucket/p.jsonl: cannot reach the object store: ")
    with pytest.raises(
        DatasetUnavailable, match=r"^data\.eval\.prompts s3://bucket/e\.parquet: cannot reach the object"
    ):
        EvalPrompts("s3://bucket/e.parquet", "prompt", None)


@pytest.mark.parametrize(
    ("head", "get", "unavailable", "needle"),
    [
        (404, (200, ""), False, "no such object"),
        (403, (200, ""), False, "access refused (403)"),
        (503, (200, ""), True, "the object store answered 503: try again later"),
        (200, (503, "SlowDown"), True, "the object store answered SlowDown: try again later"),
        (200, (500, "InternalError"), True, "the object store answered InternalError: try again later"),
        (200, (404, "NoSuchKey"), False, "no such object"),  # deleted between the HEAD and the GET
    ],
)
@pytest.mark.parametrize("name", ["p.jsonl", "p.parquet"])
def test_the_stores_answer_decides_unavailable_or_a_dataset_error(
    stub_store: _Answers, name: str, head: int, get: tuple[int, str], unavailable: bool, needle: str
) -> None:
    stub_store.head, stub_store.get = head, get
    url = f"s3://bucket/{name}"
    with pytest.raises((DatasetError, DatasetUnavailable)) as e:
        PromptDataset(url, "prompt", None, seed=0)
    assert isinstance(e.value, DatasetUnavailable) is unavailable, e.value
    assert isinstance(e.value, DatasetError) is not unavailable, e.value
    assert str(e.value).startswith(f"data.prompts {url}: {needle}"), e.value


def test_the_driver_exits_1_on_an_unreachable_store_and_2_on_a_missing_object(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    stub_store: _Answers,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The operator restarts exit 1 (within runPolicy.backoffLimit) and fails the job at once on exit 2
    (InvalidInput): an unreachable store is the first, a missing object the second. Both `error:` lines
    name the field and the URL. Before Ray starts: preflight fails first."""
    import yaml
    from rlhf_api.constants import INPUT_ERROR_EXIT_CODE
    from rlhf_trainer import driver
    from rlhf_trainer.cli import apply_overrides

    monkeypatch.delenv("RLHF_TRAINER_FAULTS", raising=False)
    actor = tmp_path / "actor"
    actor.mkdir()
    (actor / "config.json").write_text('{"num_attention_heads": 2, "num_key_value_heads": 2}')
    example = Path(__file__).resolve().parents[2] / "examples" / "rlhfjob-tiny.yaml"
    url = "s3://bucket/p.jsonl"
    sets = [f"model.actor={actor}", f"model.critic={actor}", f"data.prompts={url}", "algorithm.klCoef=0"]
    sets.append("storage.s3.credentialsSecret=store")  # the admission rule for an s3:// dataset
    manifest = apply_overrides(yaml.safe_load(example.read_text()), sets)
    spec_json = ["--spec-json", json.dumps(manifest["spec"])]

    stub_store.head = 404
    assert driver.main(spec_json) == INPUT_ERROR_EXIT_CODE == 2
    assert f"error: spec.data.prompts {url}: no such object" in capsys.readouterr().err

    _point_s3_at(monkeypatch, tmp_path, f"http://127.0.0.1:{free_port()}")
    assert driver.main(spec_json) == 1
    err = capsys.readouterr().err
    assert f"error: DatasetUnavailable: data.prompts {url}: cannot reach the object store: " in err, err
