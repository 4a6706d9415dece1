"""The prompt dataset: a .jsonl or .parquet file, local or s3://, indexed once and read on demand, served
in a seeded order with a resumable position.

Owns reading and validating the file (errors name the field, data.prompts or data.eval.prompts, the path
and the line or row), the order rows are served in, and the data position saved in checkpoints. The driver keeps an index, never the
rows: a JSONL file's byte offsets, a Parquet file's row-group sizes (and at most two row groups decoded).
An s3:// file is read the same way through ranged GETs (rlhf_trainer.object_store): the same index, the
same rows, the same order. Pure Python, pyarrow and boto3; no Ray, no tokenizer.
"""

from __future__ import annotations

import io
import json
import random
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlhf_trainer import object_store
from rlhf_trainer.object_store import ObjectStoreError, S3RangeReader

Message = dict[str, str]
Prompt = str | list[Message]  # a text, or chat messages rendered by the actor tokenizer's chat template
Columns = dict[str, Any]  # a row's other columns (JSON values), for the reward function
ROLES = ("system", "user", "assistant")
# Parquet rows are shuffled within windows of this many row groups (the groups' order is shuffled too):
# each row group is read once per epoch, and the driver decodes at most this many at a time.
SHUFFLE_WINDOW_ROW_GROUPS = 2
CHECK_BATCH_ROWS = 1024  # Parquet prompts checked at open this many rows at a time
REMOTE_LINE_BUFFER = 64 * 1024  # bytes of an s3:// JSONL file fetched per row read (one ranged GET)


class DatasetError(ValueError):
    """A dataset that cannot be used as given (missing, refused, malformed): config.preflight makes it an
    input error, which fails the job at once."""


class DatasetUnavailable(RuntimeError):
    """An s3:// dataset the object store could not serve now: unreachable, timed out, a 5xx or throttling
    answer. Not a ValueError, so not an input error: the attempt fails (the driver exits 1) and the
    operator restarts it within runPolicy.backoffLimit, where a DatasetError would fail the job for good.
    The message names the field and the URL, as a DatasetError's does."""


@dataclass
class DataPosition:
    epoch: int = 0
    offset: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}


@dataclass(frozen=True)
class PromptBatch:
    """A batch of prompts as drawn: per prompt its label (data.labelKey; None without) and its row's
    other columns (every column but data.inputKey, see `reward_columns`)."""

    prompts: list[Prompt]
    labels: list[Any]
    columns: list[Columns] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.columns:
            object.__setattr__(self, "columns", [{} for _ in self.prompts])


def prompt_problem(value: Any) -> str | None:
    """Why `value` is not a prompt (a string, or a non-empty list of {role, content} messages with role
    system, user or assistant and string content), or None when it is one."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list) or not value:
        return f"is {type(value).__name__}, not a string or a non-empty list of chat messages"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            return f"message {i} is not an object with exactly the keys 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"message {i} has role {m['role']!r}, not one of {', '.join(ROLES)}"
        if not isinstance(m["content"], str):
            return f"message {i} has content of type {type(m['content']).__name__}, not a string"
    return None


def reward_columns(row: dict[str, Any], input_key: str) -> Columns:
    """Every column of a row but the prompt, for the reward function. verl's rows keep the reference
    answer at reward_model.ground_truth: it is also passed as `ground_truth` unless the row has its own."""
    cols = {k: v for k, v in row.items() if k != input_key}
    nested = cols.get("reward_model")
    if isinstance(nested, dict) and "ground_truth" in nested and "ground_truth" not in cols:
        cols["ground_truth"] = nested["ground_truth"]
    return cols


class _Rows(Protocol):
    """A file's rows by index, and the order an epoch serves them in. `first_chat`: where the first
    chat-message prompt is ("line 3", "row 2"), None when every prompt is a string."""

    first_chat: str | None

    def __len__(self) -> int: ...
    def order(self, seed: int, epoch: int) -> array[int]: ...
    def read(self, rows: Sequence[int]) -> list[dict[str, Any]]: ...


def _shuffled(n_or_rows: range, rng: random.Random) -> array[int]:
    """random.shuffle over an int64 array: the same order as over a list (what the dataset always
    served), at 8 bytes a row."""
    order = array("q", n_or_rows)
    rng.shuffle(order)  # an array is a MutableSequence: shuffle only swaps items
    return order


def _epoch_rng(seed: int, epoch: int) -> random.Random:
    return random.Random(seed * 1_000_003 + epoch)


class JsonlRows:
    """A .jsonl file as the byte offsets of its non-empty lines; each row is read again when served.
    Indexing validates every line (JSON object, prompt shape), so a bad line fails the preflight."""

    def __init__(self, path: str, input_key: str, field: str = "data.prompts") -> None:
        self.path = path
        self.field = field
        self.source = f"{field} {path}"  # what errors name
        self.offsets = array("q")
        self.lines = array("q")  # each row's line number, for messages
        self.first_chat: str | None = None
        self._remote: S3RangeReader | None = None
        if object_store.is_s3(path):
            with _remote_errors(field, path):
                self._remote = _open_remote(path, field)
                self._index(object_store.iter_lines(self._remote.stream()), input_key)
            return
        try:
            with open(path, "rb") as f:
                self._index(f, input_key)
        except OSError as e:
            raise DatasetError(f"{self.source}: cannot read: {e.strerror or e}") from e

    def _index(self, f: Any, input_key: str) -> None:
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            obj = _parse_line(raw, self.source, lineno)
            if obj is not None:
                _check_row_prompt(obj, input_key, f"{self.source}: line {lineno}")
                if self.first_chat is None and isinstance(obj[input_key], list):
                    self.first_chat = f"line {lineno}"
                self.offsets.append(offset)
                self.lines.append(lineno)
            offset += len(raw)

    def __len__(self) -> int:
        return len(self.offsets)

    def order(self, seed: int, epoch: int) -> array[int]:
        return _shuffled(range(len(self)), _epoch_rng(seed, epoch))

    def read(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        with _remote_errors(self.field, self.path), self._open() as f:
            for i in rows:
                f.seek(self.offsets[i])
                obj = _parse_line(f.readline(), self.source, self.lines[i])
                if obj is None:
                    raise DatasetError(f"{self.source}: line {self.lines[i]}: changed since read")
                out.append(obj)
        return out

    def _open(self) -> Any:
        """The file, or the object through a small buffer: one ranged GET per row read (a row's line
        longer than the buffer takes more)."""
        if self._remote is None:
            return open(self.path, "rb")
        return io.BufferedReader(self._remote.reopen(), buffer_size=REMOTE_LINE_BUFFER)


def _parse_line(raw: bytes, source: str, lineno: int) -> dict[str, Any] | None:
    """One JSONL line -> its object (None for a blank line), or DatasetError naming the line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{source}: line {lineno}: not UTF-8 text: {e}") from e
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{source}: line {lineno}: not JSON: {e.msg}") from e
    if not isinstance(obj, dict):
        raise DatasetError(f"{source}: line {lineno}: not a JSON object")
    return obj


def _check_row_prompt(row: dict[str, Any], input_key: str, where: str) -> None:
    if input_key not in row:
        raise DatasetError(f"{where}: no field {input_key!r} (data.inputKey)")
    problem = prompt_problem(row[input_key])
    if problem:
        raise DatasetError(f"{where}: field {input_key!r} (data.inputKey) {problem}")


class ParquetRows:
    """A .parquet file as its row groups' sizes; a served row's group is decoded on demand and kept in a
    cache of SHUFFLE_WINDOW_ROW_GROUPS groups. Opening checks the schema (the prompt column, JSON-typed
    columns) and every row's prompt, one row group at a time."""

    def __init__(self, path: str, input_key: str, field: str = "data.prompts") -> None:
        import pyarrow.parquet as pq

        self.path = path
        self.field = field
        self.source = f"{field} {path}"  # what errors name
        self.source_reader: S3RangeReader | None = None  # the object's reader, for an s3:// file
        if object_store.is_s3(path):
            with _remote_errors(field, path):
                self.source_reader = _open_remote(path, field)
        source: Any = self.source_reader or path
        try:
            with _remote_errors(field, path):
                self.file = pq.ParquetFile(source)
        except DatasetError:
            raise
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid (not Parquet) is a ValueError
            raise DatasetError(f"{self.source}: cannot read as Parquet: {e}") from e
        schema = self.file.schema_arrow
        if input_key not in schema.names:
            raise DatasetError(
                f"{self.source}: no column {input_key!r} (data.inputKey); columns: {schema.names}"
            )
        for f in schema:
            if not _json_typed(f.type):
                raise DatasetError(
                    f"{self.source}: column {f.name!r} has type {f.type}, which is not JSON "
                    "(strings, numbers, booleans, lists and structs of them)"
                )
        meta = self.file.metadata
        self.starts = array("q", [0])
        for g in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self.first_chat: str | None = None
        self._check_prompts(input_key)

    def _check_prompts(self, input_key: str) -> None:
        """Every row's prompt: one row group's prompt column at a time, made Python objects in slices
        (pyarrow's iter_batches would buffer the whole column)."""
        for g in range(len(self.starts) - 1):
            column = self.file.read_row_group(g, columns=[input_key]).column(0)
            for at in range(0, len(column), CHECK_BATCH_ROWS):
                for j, value in enumerate(column.slice(at, CHECK_BATCH_ROWS).to_pylist(), start=at):
                    where = f"row {self.starts[g] + j} (counting from 0)"
                    problem = prompt_problem(value)
                    if problem:
                        raise DatasetError(
                            f"{self.source}: {where}: column {input_key!r} (data.inputKey) {problem}"
                        )
                    if self.first_chat is None and isinstance(value, list):
                        self.first_chat = where
            del column
        _release_arrow_memory()

    def __len__(self) -> int:
        return self.starts[-1]

    def order(self, seed: int, epoch: int) -> array[int]:
        """The row groups in a shuffled order, then the rows of each window of SHUFFLE_WINDOW_ROW_GROUPS
        groups shuffled: one row group gives the JSONL order of the same rows."""
        rng = _epoch_rng(seed, epoch)
        groups = list(range(len(self.starts) - 1))
        rng.shuffle(groups)
        order = array("q")
        for w in range(0, len(groups), SHUFFLE_WINDOW_ROW_GROUPS):
            window = array("q")
            for g in groups[w : w + SHUFFLE_WINDOW_ROW_GROUPS]:
                window.extend(range(self.starts[g], self.starts[g + 1]))
            rng.shuffle(window)
            order.extend(window)
        return order

    def read(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        import bisect

        out: list[dict[str, Any]] = []
        for i in rows:
            g = bisect.bisect_right(self.starts, i) - 1
            out.append(self._group(g).slice(i - self.starts[g], 1).to_pylist()[0])
        return out

    def _group(self, g: int) -> Any:
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        with _remote_errors(self.field, self.path):
            table = self.file.read_row_group(g)
        self._cache[g] = table
        if len(self._cache) > SHUFFLE_WINDOW_ROW_GROUPS:
            self._cache.popitem(last=False)
            _release_arrow_memory()
        return table


def _open_remote(path: str, field: str) -> S3RangeReader:
    """The object at s3:// `path`, its existence and size checked (a HEAD)."""
    return S3RangeReader(object_store.client(), object_store.parse_s3_url(path, field))


@contextmanager
def _remote_errors(field: str, path: str) -> Iterator[None]:
    """An S3 failure naming the field and URL: the store's own (unreachable, a 5xx, throttling) as
    DatasetUnavailable, any other (no such object, refused keys, no credentials) as a DatasetError;
    anything else passes through."""
    try:
        yield
    except ObjectStoreError as e:
        raise DatasetError(str(e)) from e
    except Exception as e:
        if not type(e).__module__.startswith(("botocore", "boto3", "urllib3")):
            raise
        message = object_store.describe_error(e, field, path)
        if object_store.is_transient(e):
            raise DatasetUnavailable(message) from e
        raise DatasetError(message) from e


def _release_arrow_memory() -> None:
    """Hand the row groups dropped back to the system: pyarrow's pool would keep their pages."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def _json_typed(t: Any) -> bool:
    """Whether pyarrow type `t` reads as JSON values (to_pylist): no bytes, times, decimals or maps."""
    import pyarrow.types as pt

    if pt.is_dictionary(t):
        return _json_typed(t.value_type)
    if pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t):
        return _json_typed(t.value_type)
    if pt.is_struct(t):
        return all(_json_typed(t.field(i).type) for i in range(t.num_fields))
    return bool(
        pt.is_null(t)
        or pt.is_boolean(t)
        or pt.is_integer(t)
        or pt.is_floating(t)
        or pt.is_string(t)
        or pt.is_large_string(t)
    )


def open_rows(path: str, input_key: str, field: str = "data.prompts") -> JsonlRows | ParquetRows:
    """The file's reader, chosen by its extension; `field` is the spec field errors name."""
    if "://" in path and not object_store.is_s3(path):
        raise DatasetError(f"{field} {path}: a local path or an s3://bucket/key URL (no other scheme)")
    if object_store.is_s3(path):
        with _remote_errors(field, path):
            object_store.parse_s3_url(path, field)
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return JsonlRows(path, input_key, field)
    if suffix == ".parquet":
        return ParquetRows(path, input_key, field)
    raise DatasetError(f"{field} {path}: unknown format {suffix or '(no extension)'}: use .jsonl or .parquet")


def prompt_batch(rows: list[dict[str, Any]], input_key: str, label_key: str | None) -> PromptBatch:
    """Rows as drawn -> their prompts, labels and other columns."""
    return PromptBatch(
        prompts=[r[input_key] for r in rows],
        labels=[r.get(label_key) if label_key else None for r in rows],
        columns=[reward_columns(r, input_key) for r in rows],
    )


class PromptDataset:
    def __init__(self, path: str, input_key: str, label_key: str | None, seed: int) -> None:
        self.path = path
        self.seed = seed
        self.input_key = input_key
        self.label_key = label_key
        self.rows: _Rows = open_rows(path, input_key)
        if not len(self.rows):
            raise DatasetError(f"data.prompts {path}: no prompts")
        self.position = DataPosition()
        self._order = self.rows.order(seed, 0)
        self.eval_split: EvalPrompts | None = None  # data.eval, opened beside it (config.preflight)

    @property
    def first_chat(self) -> str | None:
        """Where the first chat-message prompt is (they need the actor's chat template), or None."""
        return self.rows.first_chat

    def __len__(self) -> int:
        return len(self.rows)

    def restore(self, pos: dict[str, int]) -> None:
        self.position = DataPosition(int(pos["epoch"]), int(pos["offset"]))
        self._order = self.rows.order(self.seed, self.position.epoch)

    def next_batch(self, n: int) -> PromptBatch:
        return prompt_batch(self.rows.read(list(self._indices(n))), self.input_key, self.label_key)

    def _indices(self, n: int) -> Iterator[int]:
        """The next n row indices, moving the position (a new epoch reshuffles)."""
        for _ in range(n):
            if self.position.offset >= len(self._order):
                self.position = DataPosition(self.position.epoch + 1, 0)
                self._order = self.rows.order(self.seed, self.position.epoch)
            yield self._order[self.position.offset]
            self.position.offset += 1


class EvalPrompts:
    """The evaluation split (data.eval): the first `max_prompts` rows (all without it) in file order, in
    batches, read from the same index as the prompt dataset (never held whole). No position: every
    evaluation serves the same rows."""

    def __init__(
        self, path: str, input_key: str, label_key: str | None, max_prompts: int | None = None
    ) -> None:
        self.path = path
        self.input_key = input_key
        self.label_key = label_key
        self.rows: _Rows = open_rows(path, input_key, "data.eval.prompts")
        self.count = min(len(self.rows), max_prompts) if max_prompts else len(self.rows)
        if not self.count:
            raise DatasetError(f"data.eval.prompts {path}: no prompts")

    @property
    def first_chat(self) -> str | None:
        return self.rows.first_chat

    def __len__(self) -> int:
        return self.count

    def batches(self, size: int) -> Iterator[PromptBatch]:
        """Every row served, `size` at a time, in file order."""
        for start in range(0, self.count, size):
            rows = self.rows.read(range(start, min(start + size, self.count)))
            yield prompt_batch(rows, self.input_key, self.label_key)
