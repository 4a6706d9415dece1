"""The prompt dataset: a .jsonl file read once, served in a seeded order with a resumable position.

Owns reading and validating the file (errors name the path and line) and the data position saved in
checkpoints. Pure Python; no Ray, no tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    pass


@dataclass
class DataPosition:
    epoch: int = 0
    offset: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}


class PromptDataset:
    def __init__(self, path: str, input_key: str, label_key: str | None, seed: int) -> None:
        self.path = path
        self.seed = seed
        self.prompts: list[str] = []
        self.labels: list[Any] = []
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise DatasetError(f"data.prompts {path}: cannot read: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise DatasetError(f"data.prompts {path}: not UTF-8 text: {e}") from e
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"data.prompts {path}: line {lineno}: not JSON: {e.msg}") from e
            if not isinstance(obj, dict) or not isinstance(obj.get(input_key), str):
                raise DatasetError(
                    f"data.prompts {path}: line {lineno}: no string field {input_key!r} (data.inputKey)"
                )
            self.prompts.append(obj[input_key])
            self.labels.append(obj.get(label_key) if label_key else None)
        if not self.prompts:
            raise DatasetError(f"data.prompts {path}: no prompts")
        self.position = DataPosition()
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def restore(self, pos: dict[str, int]) -> None:
        self.position = DataPosition(int(pos["epoch"]), int(pos["offset"]))
        self._order = self._permutation(self.position.epoch)

    def next_batch(self, n: int) -> tuple[list[str], list[Any]]:
        prompts: list[str] = []
        labels: list[Any] = []
        while len(prompts) < n:
            if self.position.offset >= len(self._order):
                self.position = DataPosition(self.position.epoch + 1, 0)
                self._order = self._permutation(self.position.epoch)
            i = self._order[self.position.offset]
            self.position.offset += 1
            prompts.append(self.prompts[i])
            labels.append(self.labels[i])
        return prompts, labels
