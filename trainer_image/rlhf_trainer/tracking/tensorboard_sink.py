"""The TensorBoard sink: event files under <logDir>/<job>, written with torch's `SummaryWriter` (the
trainer has torch; TensorBoard reads the files). Metrics as scalars at the step, the params once as a
markdown table under the text tag `config`, each samples table as markdown under `samples`.

A restarted attempt appends a new event file to the same directory; TensorBoard merges them by step.
"""

from __future__ import annotations

import os
from typing import Any

from rlhf_api.spec import TensorBoardTrackingSpec

from rlhf_trainer.tracking.dispatch import SAMPLE_COLUMNS, SampleRow


def markdown_table(header: tuple[str, ...] | list[str], rows: list[list[Any]]) -> str:
    """Rows as a markdown table (TensorBoard's text plugin renders markdown); `|` and newlines escaped."""

    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, spec: TensorBoardTrackingSpec, job: str) -> None:
        self.log_dir = os.path.join(spec.log_dir, job)
        self._writer: Any = None

    def open(self) -> str:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = SummaryWriter(log_dir=self.log_dir, flush_secs=10)
        return self.log_dir

    def log_params(self, params: dict[str, str]) -> None:
        self._writer.add_text(
            "config", markdown_table(("param", "value"), [[k, v] for k, v in sorted(params.items())]), 0
        )
        self._writer.flush()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_samples(self, step: int, rows: list[SampleRow]) -> None:
        data = [[step, r.prompt, r.completion, r.reward] for r in rows]
        self._writer.add_text("samples", markdown_table(SAMPLE_COLUMNS, data), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
