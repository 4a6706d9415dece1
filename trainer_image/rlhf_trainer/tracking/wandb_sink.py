"""The Weights & Biases sink (`wandb.init` in the background thread, never at import): the params as the
run's config, a step's metrics with `step=`, the samples table as a `wandb.Table` under `samples`.

The run id is derived from the job's name, with `resume="allow"`, so a restarted attempt goes on with the
same run. Offline mode writes the run directory under WANDB_DIR for a later `wandb sync`. The key comes from
env only (WANDB_API_KEY, from the Secret).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from rlhf_api.spec import WandbTrackingSpec

from rlhf_trainer.tracking.dispatch import SAMPLE_COLUMNS, SampleRow


def run_id(job: str) -> str:
    """A W&B run id for the job (W&B allows letters, digits, `-` and `_`; 64 characters at most)."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", job)[:48]
    return f"{safe}-{hashlib.sha256(job.encode()).hexdigest()[:8]}"


class WandbSink:
    name = "wandb"

    def __init__(self, spec: WandbTrackingSpec, job: str) -> None:
        self.spec, self.job = spec, job
        self._run: Any = None

    def open(self) -> str:
        import wandb

        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self._run = wandb.init(
            project=self.spec.project,
            entity=self.spec.entity,
            mode=self.spec.mode,
            id=run_id(self.job),
            name=self.job,
            resume="allow",
            dir=os.environ.get("WANDB_DIR") or None,
            settings=settings,
            reinit="create_new",
        )
        if self.spec.mode == "offline":
            return str(os.path.dirname(self._run.dir))  # <WANDB_DIR>/wandb/offline-run-<time>-<id>
        return str(self._run.url)

    def log_params(self, params: dict[str, str]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[SampleRow]) -> None:
        import wandb

        data = [[step, r.prompt, r.completion, r.reward] for r in rows]
        self._run.log({"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=data)}, step=step)

    def close(self) -> None:
        self._run.finish()
