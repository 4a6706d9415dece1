"""The real node's job with its inputs and outputs where a team keeps them (issue 34): the tiny model and
its prompts in the io stage's S3 server, the run tracked in a real MLflow server that the test can stop
and start again on the same port and store, and what the test reads back from both.

Owns the objects the job reads (uploaded here, over HTTP, like any client) and the MLflow server's life;
the job itself is testkit.realnode's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from testkit.mlflow_server import MlflowServer, running_mlflow_server
from testkit.object_store import ObjectStore
from testkit.support import free_port

MODELS, DATA, EXPORTS = "realnode-models", "realnode-data", "realnode-exports"
S3_SECRET, WRONG_SECRET = "s3-credentials", "s3-wrong-key"
EXPERIMENT = "realnode"
# The tiny tokenizer has no chat template; the copy in the object store gets this one (the model a team
# uploads carries its own), so that the chat-message prompts below go through a real template.
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}"
SYSTEM_TURN = "ba"  # a short system turn: the tiny prompts are 2 to 5 words, maxPromptLength 32 tokens


@dataclass(frozen=True)
class Sources:
    """Where the job's model, prompts, evaluation split and export live (s3:// URIs)."""

    actor: str
    prompts: str
    eval: str
    export: str
    model_bytes: int


def put_sources(store: ObjectStore, tiny: Path) -> Sources:
    """Upload the tiny model (with a chat template), its prompts as a Parquet file of chat messages with a
    system turn, and its evaluation split as JSONL (with `data_source`); return their URIs."""
    client = store.client()
    for bucket in (MODELS, DATA, EXPORTS):
        store.bucket(bucket)
    size = 0
    for path in sorted((tiny / "model").iterdir()):
        client.upload_file(str(path), MODELS, f"tiny/{path.name}")
        size += path.stat().st_size
    client.put_object(Bucket=MODELS, Key="tiny/chat_template.jinja", Body=CHAT_TEMPLATE.encode())
    size += len(CHAT_TEMPLATE.encode())
    rows = [json.loads(line) for line in (tiny / "prompts.jsonl").read_text().splitlines() if line.strip()]
    table = pa.Table.from_pylist(
        [
            {"prompt": [{"role": "system", "content": SYSTEM_TURN}, {"role": "user", "content": r["prompt"]}]}
            for r in rows
        ]
    )
    parquet = tiny.parent / f"{tiny.name}-prompts.parquet"
    pq.write_table(table, parquet, row_group_size=16)
    client.upload_file(str(parquet), DATA, "tiny/prompts.parquet")
    client.upload_file(str(tiny / "eval.jsonl"), DATA, "tiny/eval.jsonl")
    return Sources(
        actor=f"s3://{MODELS}/tiny",
        prompts=f"s3://{DATA}/tiny/prompts.parquet",
        eval=f"s3://{DATA}/tiny/eval.jsonl",
        export=f"s3://{EXPORTS}/tiny",
        model_bytes=size,
    )


def secret(name: str, values: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": values}


class Mlflow:
    """A real MLflow server that pods reach, stopped and started again on the same port and store (an
    outage as the trainer sees one)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.port = workdir, free_port()
        self._stack = ExitStack()
        self.server: MlflowServer | None = None

    def start(self) -> MlflowServer:
        self.server = self._stack.enter_context(
            # Up to 4 minutes: it starts beside a replacement pod's engine and the trainer on 2 cores.
            running_mlflow_server(self.workdir, for_pods=True, port=self.port, timeout=240)
        )
        return self.server

    def stop(self) -> None:
        self._stack.close()
        self._stack = ExitStack()


@contextmanager
def mlflow(workdir: Path) -> Iterator[Mlflow]:
    server = Mlflow(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def mlflow_run(url: str, job: str) -> tuple[Any, Any]:
    """The MLflow client and the job's one run in EXPERIMENT (found by the trainer's `rlhfjob` tag)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp is not None, f"no experiment {EXPERIMENT} on {url}"
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.rlhfjob = '{job}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def metric_steps(client: Any, run_id: str, name: str) -> list[int]:
    """The steps a metric was logged at, sorted and distinct (a step trained again after a resume is
    logged again at the same step)."""
    return sorted({m.step for m in client.get_metric_history(run_id, name)})


def io_spec(src: Sources, tracking_uri: str) -> dict[str, dict[str, Any]]:
    """The job's sections (merged over realnode_job's) that put its inputs and outputs in the stores: the
    actor from s3:// into the runtime's model cache, chat prompts and an evaluation split every 5 steps
    from s3://, MLflow tracking, and the export uploaded to s3://."""
    return {
        "model": {"actor": src.actor},
        "storage": {"s3": {"credentialsSecret": S3_SECRET}},
        "data": {"prompts": src.prompts, "eval": {"prompts": src.eval}},
        "evaluation": {"everySteps": 5},
        "tracking": {
            "mlflow": {"trackingUri": tracking_uri, "experiment": EXPERIMENT},
            "samplesEverySteps": 10,
        },
        "checkpoint": {"exportTo": src.export},
    }
