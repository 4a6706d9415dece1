"""Reward scoring: a Python function, an HF reward model, or a remote HTTP endpoint, one chunk at a time.

Owns turning (prompts, responses) into scores and *counting* failures: a failed, missing, non-finite or
timed-out score marks the sample invalid and is reported as an error, never returned as None or 0.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import inspect
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from rlhf_trainer.transfer import PackedRollout

RewardFn = Callable[..., Any]


class RewardSetupError(RuntimeError):
    """The configured reward cannot be loaded (bad module path, missing file, not callable...)."""


@dataclass
class RewardMeta:
    """What the driver learns about a scored chunk (small; the scores themselves stay in the store)."""

    chunk: int
    samples: int
    errors: int
    score_sum: float
    seconds: float
    messages: list[str] = field(default_factory=list)


@dataclass
class RewardResult:
    scores: torch.Tensor  # float32 [n]; 0 where invalid (never used: valid masks it out)
    valid: torch.Tensor  # bool [n]


def load_reward_function(ref: str) -> RewardFn:
    """`path/to/file.py:function` or `package.module:function` -> the callable, or RewardSetupError."""
    if ":" not in ref:
        raise RewardSetupError(
            f"model.reward.function {ref!r}: expected 'module:function' or 'file.py:function'"
        )
    target, _, name = ref.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise RewardSetupError(f"model.reward.function {ref!r}: file {target} does not exist")
            mod_name = f"rlhf_reward_{abs(hash(str(path.resolve())))}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            if spec is None or spec.loader is None:
                raise RewardSetupError(f"model.reward.function {ref!r}: cannot load {target}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except RewardSetupError:
        raise
    except Exception as e:
        raise RewardSetupError(
            f"model.reward.function {ref!r}: import of {target} failed: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardSetupError(f"model.reward.function {ref!r}: {target} has no callable {name!r}")
    return cast(RewardFn, fn)


def _accepts_labels(fn: RewardFn) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3


def reward_model_max_length(tokenizer: Any, config: Any) -> int:
    """Tokens the reward model reads: the tokenizer's limit, capped by the model's positions."""
    limits = [int(tokenizer.model_max_length)] if tokenizer.model_max_length < 10**9 else []
    if getattr(config, "max_position_embeddings", None):
        limits.append(int(config.max_position_embeddings))
    return min(limits) if limits else 4096


def reward_model_input(tokenizer: Any, prompt: str, response: str, max_length: int) -> list[int]:
    """Token ids a reward model reads for one sample, in the form it was trained on: [user: prompt,
    assistant: response] through the reward tokenizer's own chat template when it has one, else prompt +
    response as plain text (with the tokenizer's special tokens). Tokenized whole, so the response's
    first tokens join the prompt's as in training. Too long, it keeps the last max_length tokens: the
    prompt loses its left, the response is kept whole (all of a reward model's signal is at the end)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False
        )
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tokenizer(prompt + response, add_special_tokens=True)["input_ids"])
    return ids[-max_length:]


class RewardScorer:
    """Scores chunks; runs as a threaded Ray actor so several chunks are scored while others generate."""

    def __init__(self, reward: dict[str, Any], device: str = "cpu") -> None:
        self.kind = reward["type"]
        self.timeout = float(reward.get("timeout_seconds", 30.0))
        self.device = device
        self.fn: RewardFn | None = None
        self.url: str | None = None
        self.model: Any = None
        if self.kind == "function":
            self.fn = load_reward_function(str(reward["function"]))
            self.with_labels = _accepts_labels(self.fn)
        elif self.kind == "http":
            self.url = str(reward["url"])
        elif self.kind == "model":
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            path = str(reward["model"])
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = (
                AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval().to(device)
            )
        else:
            raise RewardSetupError(f"model.reward.type {self.kind!r} is not function, model or http")
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=int(reward.get("concurrency", 4)))

    def ready(self) -> dict[str, Any]:
        return {"kind": self.kind, "pid": os.getpid()}

    def _call(self, prompts: list[str], responses: list[str], labels: list[Any]) -> list[Any]:
        if self.fn is not None:
            out = self.fn(prompts, responses, labels) if self.with_labels else self.fn(prompts, responses)
            return list(out)
        if self.url is not None:
            import httpx

            resp = httpx.post(
                self.url,
                json={"prompts": prompts, "responses": responses, "labels": labels},
                timeout=self.timeout,
            )
            resp.raise_for_status()
            return list(resp.json()["rewards"])
        return self._score_with_model(prompts, responses)

    @torch.no_grad()
    def _score_with_model(self, prompts: list[str], responses: list[str]) -> list[float]:
        limit = reward_model_max_length(self.tokenizer, self.model.config)
        ids = [
            reward_model_input(self.tokenizer, p, r, limit) for p, r in zip(prompts, responses, strict=True)
        ]
        self.tokenizer.padding_side = "right"  # the classifier reads the last non-pad token
        enc = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        return [float(x) for x in logits[:, 0].float().cpu()]

    def _score_batch(
        self, prompts: list[str], responses: list[str], labels: list[Any]
    ) -> tuple[list[float | None], str]:
        """Scores or None per sample, plus the first error message."""
        try:
            raw = self._pool.submit(self._call, prompts, responses, labels).result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            return [None] * len(prompts), f"reward timed out after {self.timeout}s"
        except Exception as e:
            return [None] * len(prompts), f"{type(e).__name__}: {e}"
        if len(raw) != len(prompts):
            return [None] * len(prompts), f"reward returned {len(raw)} scores for {len(prompts)} samples"
        out: list[float | None] = []
        msg = ""
        for x in raw:
            try:
                v = float(x)
            except (TypeError, ValueError):
                out.append(None)
                msg = msg or f"reward returned a non-number: {x!r}"
                continue
            if not math.isfinite(v):
                out.append(None)
                msg = msg or f"reward returned a non-finite value: {v}"
                continue
            out.append(v)
        return out, msg

    def score(self, chunk: int, rollout: PackedRollout) -> tuple[RewardMeta, RewardResult]:
        t0 = time.perf_counter()
        n = rollout.num_samples
        labels = rollout.labels or [None] * n
        scores, msg = self._score_batch(rollout.prompts, rollout.responses, labels)
        messages = [msg] if msg else []
        if msg and all(s is None for s in scores) and n > 1:
            # The batch failed as a whole: score sample by sample so one bad sample costs only itself.
            scores = []
            for i in range(n):
                one, m = self._score_batch([rollout.prompts[i]], [rollout.responses[i]], [labels[i]])
                scores.append(one[0])
                if m and len(messages) < 3:
                    messages.append(m)
        valid = torch.tensor([s is not None for s in scores], dtype=torch.bool)
        values = torch.tensor([s if s is not None else 0.0 for s in scores], dtype=torch.float32)
        meta = RewardMeta(
            chunk=chunk,
            samples=n,
            errors=int((~valid).sum()),
            score_sum=float(values[valid].sum()),
            seconds=time.perf_counter() - t0,
            messages=messages[:3],
        )
        return meta, RewardResult(values, valid)
