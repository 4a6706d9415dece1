"""Reward scoring: a Python function, an HF reward model, or a remote HTTP endpoint, one request at a time.

Owns turning (prompts, responses) into scores and *counting* failures: a failed, missing, non-finite or
timed-out score marks the sample invalid and is reported as an error, never returned as None or 0.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_trainer import device as device_mod
from rlhf_trainer.data import Columns, Prompt
from rlhf_trainer.stacks import dump as stacks
from rlhf_trainer.transfer import FinishedRequest, PackedRollout
from rlhf_trainer.user_code import load_callable
from rlhf_trainer.workers.reward_results import (
    MAX_MESSAGES,
    RequestScores,
    RewardMeta,
    RewardResult,
    assemble_chunk,
    checked_scores,
    sub_batches,
)
from rlhf_trainer.workers.timed_pool import TimedPool

RewardFn = Callable[..., Any]
# prompts, responses, labels and each sample's row columns (data.Columns) of one reward call
Batch = tuple[list[Prompt], list[str], list[Any], list[Columns]]


class RewardSetupError(RuntimeError):
    """The configured reward cannot be loaded (bad module path, missing file, not callable...)."""


def load_reward_function(ref: str) -> RewardFn:
    """`path/to/file.py:function` or `package.module:function` -> the callable, or RewardSetupError."""
    return load_callable(ref, "model.reward.function", RewardSetupError)


def _accepts_labels(fn: RewardFn) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3


@dataclass(frozen=True)
class ColumnParameters:
    """Which row columns a reward function takes as keyword arguments: those named by its keyword
    parameters (`names`; None: it takes **kwargs, so every column), never one named like a parameter
    that already receives a positional argument (`reserved`: a column `labels` would collide)."""

    names: frozenset[str] | None
    reserved: frozenset[str]

    @staticmethod
    def of(fn: RewardFn) -> ColumnParameters:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return ColumnParameters(frozenset(), frozenset())
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        taken = positional[: 3 if _accepts_labels(fn) else 2]  # (prompts, responses[, labels])
        reserved = frozenset(p.name for p in taken if p.kind is p.POSITIONAL_OR_KEYWORD)
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return ColumnParameters(None, reserved)
        return ColumnParameters(frozenset(p.name for p in named) - reserved, reserved)

    def wants(self, name: str) -> bool:
        return name not in self.reserved and (self.names is None or name in self.names)


def column_lists(columns: Sequence[Columns]) -> dict[str, list[Any]]:
    """Per-sample columns -> one list per column name, aligned with the samples (None where a sample's
    row lacks the column), in the order the names first appear."""
    names = dict.fromkeys(k for row in columns for k in row)
    return {k: [row.get(k) for row in columns] for k in names}


def reward_model_max_length(tokenizer: Any, config: Any) -> int:
    """Tokens the reward model reads: the tokenizer's limit, capped by the model's positions."""
    limits = [int(tokenizer.model_max_length)] if tokenizer.model_max_length < 10**9 else []
    if getattr(config, "max_position_embeddings", None):
        limits.append(int(config.max_position_embeddings))
    return min(limits) if limits else 4096


def reward_model_input(tokenizer: Any, prompt: Prompt, response: str, max_length: int) -> list[int]:
    """Token ids a reward model reads for one sample, in the form it was trained on: [user: prompt,
    assistant: response] (a message-list prompt: its messages, then the response) through the reward
    tokenizer's own chat template when it has one, else prompt + response as plain text (with the
    tokenizer's special tokens; messages' contents joined by newlines). Tokenized whole, so the response's
    first tokens join the prompt's as in training. Too long, it keeps the last max_length tokens: the
    prompt loses its left, the response is kept whole (all of a reward model's signal is at the end)."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [*turns, {"role": "assistant", "content": response}], tokenize=False
        )
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        plain = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        ids = list(tokenizer(plain + response, add_special_tokens=True)["input_ids"])
    return ids[-max_length:]


def _take(batch: Batch, idx: Sequence[int]) -> Batch:
    prompts, responses, labels, columns = batch
    return (
        [prompts[i] for i in idx],
        [responses[i] for i in idx],
        [labels[i] for i in idx],
        [columns[i] for i in idx],
    )


class RewardScorer:
    """Scores each request's samples as the engines stream them, and builds each chunk's result from its
    requests' scores. Runs as a threaded Ray actor: requests are scored while others still generate."""

    def __init__(self, reward: dict[str, Any], device: str = "cpu") -> None:
        self.kind = reward["type"]
        self.device = device
        self.fn: RewardFn | None = None
        self.url: str | None = None
        self.model: Any = None
        stacks.arm("reward scorer", "reward")
        # A reward model's process checks its GPU before loading onto it (the driver reads `where`).
        self.whereabouts = (
            device_mod.whereabouts(device, "reward model") if self.kind == "model" else {"gpus": []}
        )
        if "problem" in self.whereabouts:
            return
        if self.kind == "function":
            self.fn = load_reward_function(str(reward["function"]))
            self.with_labels = _accepts_labels(self.fn)
            self.columns = ColumnParameters.of(self.fn)
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
        # No defaults here: they are the spec's (placement.reward_config), and a key missing must fail,
        # not leave a user's timeoutSeconds and concurrency silently unapplied.
        self.timeout = float(reward["timeout_seconds"])
        self.threads = int(reward["concurrency"])
        self._pool = TimedPool(self.threads, self.timeout)
        # A function or an endpoint may wait on I/O: a request's samples go out in sub-batches, one per
        # thread. A reward model computes: one forward per request batches it best.
        self.sub_batches = self.threads if self.kind != "model" else 1

    def ready(self) -> dict[str, Any]:
        return {"kind": self.kind, "pid": os.getpid()}

    def where(self) -> dict[str, Any]:
        """Its pod and GPU ids, and a `problem` if it does not see the GPU it was promised."""
        return self.whereabouts

    def score_request(self, request: FinishedRequest, columns: Columns | None = None) -> RequestScores:
        """One finished request's samples, scored the moment the engine streams it. `columns`: its row's
        other columns (the dispatcher sends them here, not through the engine)."""
        n = len(request.responses)
        batch: Batch = (
            [request.prompt] * n,
            list(request.responses),
            [request.label] * n,
            [columns or {}] * n,
        )
        if not request.rewards and not request.failures:
            return self._score(request.chunk, request.request, batch)
        return self._score_episodes(request, batch)

    def _score_episodes(self, request: FinishedRequest, batch: Batch) -> RequestScores:
        """rollout.agent's samples: an agent's own reward is taken (checked like a reward's), a failed agent's
        sample is a reward error with the agent's message, and the job's reward scores the others."""
        t0 = time.perf_counter()
        n = len(request.responses)
        failures = request.failures or ("",) * n
        own = request.rewards or (None,) * n
        need = [k for k in range(n) if not failures[k] and own[k] is None]
        scores: list[float | None] = [None] * n
        messages = [f for f in failures if f]
        if need:
            scored = self._score(request.chunk, request.request, _take(batch, need))
            for k, v in zip(need, scored.scores, strict=True):
                scores[k] = v
            messages += scored.messages
        given = [k for k in range(n) if not failures[k] and own[k] is not None]
        checked, msg = checked_scores([own[k] for k in given], len(given))
        for k, v in zip(given, checked, strict=True):
            scores[k] = v
        if msg:
            messages.append(f"agent reward: {msg}")
        return RequestScores(
            request.chunk, request.request, scores, messages[:MAX_MESSAGES], time.perf_counter() - t0
        )

    def assemble(
        self, chunk: int, packed: PackedRollout, *requests: RequestScores
    ) -> tuple[RewardMeta, RewardResult]:
        """The chunk's reward, in its sample order, from its requests' scores. `packed` is the chunk itself:
        Ray reads it from the engine's node before this runs, so a chunk whose engine is gone fails here,
        and the dispatcher generates it again (its tokens are needed for training anyway)."""
        return assemble_chunk(chunk, requests, packed.num_samples)

    def score(self, chunk: int, rollout: PackedRollout) -> tuple[RewardMeta, RewardResult]:
        """A whole packed rollout at once, in sub-batches like a request (the blocking way, for callers
        holding every sample: benchmarks/async_reward.py's baselines). No row columns: a packed rollout does
        not carry them."""
        labels = list(rollout.labels) or [None] * rollout.num_samples
        batch: Batch = (list(rollout.prompts), list(rollout.responses), labels, [{}] * rollout.num_samples)
        scores = self._score(chunk, 0, batch)
        return assemble_chunk(chunk, [scores], rollout.num_samples)

    def _score(self, chunk: int, request: int, batch: Batch) -> RequestScores:
        """The samples' scores in order, from sub-batches run at once over the scorer's threads. A
        sub-batch that fails whole is scored again sample by sample, so one bad sample costs only itself."""
        t0 = time.perf_counter()
        parts = sub_batches(len(batch[0]), self.sub_batches)
        answers = self._run([_take(batch, part) for part in parts])
        scores: list[float | None] = []
        messages: list[str] = []
        for part, (got, msg) in zip(parts, answers, strict=True):
            if msg and len(part) > 1 and all(s is None for s in got):
                singles = self._run([_take(batch, [i]) for i in part])
                got = [one[0] for one, _ in singles]
                messages += [msg] + [m for _, m in singles if m]
            elif msg:
                messages.append(msg)
            scores += got
        return RequestScores(chunk, request, scores, messages[:MAX_MESSAGES], time.perf_counter() - t0)

    def _run(self, batches: list[Batch]) -> list[tuple[list[float | None], str]]:
        """Every batch submitted at once, then each one's scores (None per sample on failure) and error."""
        calls = [self._pool.submit(self._call, *b) for b in batches]
        out: list[tuple[list[float | None], str]] = []
        for call, (prompts, *_) in zip(calls, batches, strict=True):
            try:
                raw = call.result()
            except Exception as e:
                out.append(([None] * len(prompts), f"{type(e).__name__}: {e}"))
                continue
            out.append(checked_scores(raw, len(prompts)))
        return out

    def _call(
        self, prompts: list[Prompt], responses: list[str], labels: list[Any], columns: list[Columns]
    ) -> list[Any]:
        if self.fn is not None:
            kwargs = {k: v for k, v in column_lists(columns).items() if self.columns.wants(k)}
            args = (prompts, responses, labels) if self.with_labels else (prompts, responses)
            return list(self.fn(*args, **kwargs))
        if self.url is not None:
            import httpx

            body: dict[str, Any] = {"prompts": prompts, "responses": responses, "labels": labels}
            if any(columns):
                body["columns"] = column_lists(columns)
            resp = httpx.post(self.url, json=body, timeout=self.timeout)
            resp.raise_for_status()
            return list(resp.json()["rewards"])
        return self._score_with_model(prompts, responses)

    @torch.no_grad()
    def _score_with_model(self, prompts: list[Prompt], responses: list[str]) -> list[float]:
        limit = reward_model_max_length(self.tokenizer, self.model.config)
        ids = [
            reward_model_input(self.tokenizer, p, r, limit) for p, r in zip(prompts, responses, strict=True)
        ]
        self.tokenizer.padding_side = "right"  # the classifier reads the last non-pad token
        enc = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        return [float(x) for x in logits[:, 0].float().cpu()]
