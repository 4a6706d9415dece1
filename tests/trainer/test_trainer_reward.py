"""Reward loading, per-request scoring in sub-batches, error counting (rlhf_trainer.workers.reward) and
the tiny task's reward."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rlhf_trainer.data import PromptBatch, PromptDataset
from rlhf_trainer.tasks.tiny import reward as tiny_reward
from rlhf_trainer.transfer import FinishedRequest, PackedRollout
from rlhf_trainer.workers.reward import ColumnParameters, RewardScorer, RewardSetupError, load_reward_function

pytestmark = pytest.mark.unit


def _rollout(responses: list[str]) -> PackedRollout:
    return PackedRollout.from_samples(
        [([1], [2], [0.0]) for _ in responses], list(range(len(responses))), ["p"] * len(responses), responses
    )


def test_tiny_reward_is_vowel_share() -> None:
    assert tiny_reward(["x", "y", "z"], ["aeiou", "bcd a", ""]) == [1.0, 0.25, 0.0]


def test_load_by_module_and_file(tmp_path: Path) -> None:
    assert load_reward_function("rlhf_trainer.tasks.tiny:reward") is tiny_reward
    f = tmp_path / "r.py"
    f.write_text("def score(prompts, responses):\n    return [1.0] * len(responses)\n")
    assert load_reward_function(f"{f}:score")(["a"], ["b"]) == [1.0]


@pytest.mark.parametrize(
    "ref, needle",
    [
        ("no_such_module_xyz:fn", "no_such_module_xyz"),
        ("rlhf_trainer.tasks.tiny:nope", "'nope'"),
        ("/does/not/exist.py:fn", "/does/not/exist.py"),
    ],
)
def test_bad_reward_names_the_function(ref: str, needle: str) -> None:
    with pytest.raises(RewardSetupError, match=r"model\.reward\.function") as e:
        load_reward_function(ref)
    assert needle in str(e.value)


def test_errors_are_counted_never_scored(tmp_path: Path) -> None:
    f = tmp_path / "flaky.py"
    f.write_text(
        "def reward(prompts, responses):\n"
        "    if any('boom' in r for r in responses):\n"
        "        raise RuntimeError('boom in reward')\n"
        "    return [float('nan') if r == 'nan' else 1.0 for r in responses]\n"
    )
    scorer = RewardScorer(
        {"type": "function", "function": f"{f}:reward", "timeout_seconds": 5, "concurrency": 4}
    )
    meta, result = scorer.score(0, _rollout(["ok", "boom", "nan", "ok"]))
    assert meta.errors == 2 and meta.samples == 4
    assert result.valid.tolist() == [True, False, False, True]
    assert "boom in reward" in " ".join(meta.messages)
    assert meta.score_sum == 2.0


def test_a_wrong_count_of_scores_invalidates_the_whole_call(tmp_path: Path) -> None:
    f = tmp_path / "short.py"
    f.write_text("def reward(prompts, responses):\n    return [1.0] * (len(responses) - 1)\n")
    scorer = RewardScorer(
        {"type": "function", "function": f"{f}:reward", "timeout_seconds": 5, "concurrency": 1}
    )
    meta, result = scorer.score(0, _rollout(["a", "b", "c"]))
    assert meta.errors == 3 and result.valid.tolist() == [False, False, False]
    assert "returned 2 scores for 3 samples" in " ".join(meta.messages)


def test_labels_passed_when_accepted(tmp_path: Path) -> None:
    f = tmp_path / "lab.py"
    f.write_text(
        "def reward(prompts, responses, labels):\n    return [float(l == r) for r, l in zip(responses, labels)]\n"
    )
    scorer = RewardScorer(
        {"type": "function", "function": f"{f}:reward", "timeout_seconds": 30, "concurrency": 4}
    )
    r = _rollout(["a", "b"])
    r.labels = ["a", "x"]
    _, result = scorer.score(0, r)
    assert result.scores.tolist() == [1.0, 0.0]


def test_a_request_is_scored_in_sub_batches_at_once_over_the_scorers_threads(tmp_path: Path) -> None:
    """8 samples, 4 threads: 4 calls of 2 samples run together (an I/O-bound reward: 0.3 s a call), and
    the scores come back in the samples' order."""
    f = tmp_path / "slow.py"
    f.write_text(
        "import time\n"
        "CALLS = []\n"
        "def reward(prompts, responses):\n"
        "    CALLS.append(len(responses))\n"
        "    time.sleep(0.3)\n"
        "    return [float(r) for r in responses]\n"
    )
    scorer = RewardScorer(
        {"type": "function", "function": f"{f}:reward", "timeout_seconds": 30, "concurrency": 4}
    )
    t0 = time.perf_counter()
    got = scorer.score_request(FinishedRequest(3, 1, "p", [str(i) for i in range(8)]))
    wall = time.perf_counter() - t0
    assert (got.chunk, got.request, got.messages) == (3, 1, [])
    assert got.scores == [float(i) for i in range(8)]
    assert sorted(scorer.fn.__globals__["CALLS"]) == [2, 2, 2, 2]  # type: ignore[union-attr]
    assert wall < 0.9, f"sub-batches ran one after another ({wall:.2f} s; at once: 0.3 s)"


def test_a_sub_batch_that_fails_whole_is_rescored_sample_by_sample(tmp_path: Path) -> None:
    f = tmp_path / "boom.py"
    f.write_text(
        "def reward(prompts, responses):\n"
        "    if 'boom' in responses:\n"
        "        raise RuntimeError('boom in reward')\n"
        "    return [1.0] * len(responses)\n"
    )
    scorer = RewardScorer(
        {"type": "function", "function": f"{f}:reward", "timeout_seconds": 30, "concurrency": 2}
    )
    got = scorer.score_request(FinishedRequest(0, 0, "p", ["ok", "boom", "ok", "ok"]))
    assert got.scores == [1.0, None, 1.0, 1.0]  # sub-batch [ok, boom] failed; only boom stays failed
    assert got.messages == ["RuntimeError: boom in reward"] * 2


def test_a_chunk_is_assembled_from_its_requests_scores_in_sample_order(tmp_path: Path) -> None:
    f = tmp_path / "lab.py"
    f.write_text(
        "def reward(prompts, responses, labels):\n    return [float(r == l) for r, l in zip(responses, labels)]\n"
    )
    scorer = RewardScorer(
        {"type": "function", "function": f"{f}:reward", "timeout_seconds": 30, "concurrency": 4}
    )
    first = scorer.score_request(FinishedRequest(2, 0, "p0", ["a", "b"], label="a"))
    second = scorer.score_request(FinishedRequest(2, 1, "p1", ["c", "d", "d"], label="d"))
    meta, result = scorer.assemble(2, _rollout(["a", "b", "c", "d", "d"]), second, first)
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert (meta.chunk, meta.samples, meta.errors, meta.score_sum) == (2, 5, 0, 3.0)
    with pytest.raises(ValueError, match="2 scores for its 5 samples"):
        scorer.assemble(2, _rollout(["a", "b", "c", "d", "d"]), first)


class _RewardServer(http.server.BaseHTTPRequestHandler):
    """A remote reward endpoint: rewards = response lengths; 'fail' in a response makes it answer 500."""

    bodies: list[dict[str, Any]] = []  # every request's JSON body, in order

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if any("fail" in r for r in body["responses"]):
            self.send_response(500)
            self.end_headers()
            return
        out = json.dumps({"rewards": [float(len(r)) for r in body["responses"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        del args


def test_http_reward_scores_and_counts_server_errors() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RewardServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        scorer = RewardScorer({"type": "http", "url": url, "timeout_seconds": 5, "concurrency": 4})
        meta, result = scorer.score(0, _rollout(["ab", "abcd"]))
        assert meta.errors == 0 and result.scores.tolist() == [2.0, 4.0]
        meta, result = scorer.score(1, _rollout(["ab", "fail", "abc"]))
        assert meta.errors == 1 and result.valid.tolist() == [True, False, True]
        assert result.scores.tolist() == [2.0, 0.0, 3.0] and "500" in " ".join(meta.messages)
    finally:
        server.shutdown()


def test_model_reward_scores_with_an_hf_sequence_classifier(tmp_path: Path) -> None:
    from rlhf_trainer.tiny_model import make_tiny_model

    paths = make_tiny_model(tmp_path, num_prompts=4)
    scorer = RewardScorer({"type": "model", "model": paths["model"], "timeout_seconds": 30, "concurrency": 4})
    meta, result = scorer.score(0, _rollout(["ba ko", "stou plaing tre zu", "a"]))
    assert meta.errors == 0 and result.valid.all()
    # batched scores (padded) equal one-at-a-time scores: padding does not leak into the reward
    singles = [
        float(scorer.score(0, _rollout([r]))[1].scores[0]) for r in ["ba ko", "stou plaing tre zu", "a"]
    ]
    assert result.scores.tolist() == pytest.approx(singles, abs=1e-4)
    assert len(set(singles)) == 3


def test_reward_model_input_uses_its_chat_template_and_cuts_the_prompt_from_the_left() -> None:
    from rlhf_trainer.tiny_model import build_tokenizer
    from rlhf_trainer.workers.reward import reward_model_input

    tok = build_tokenizer(512)
    prompt, response = "ba ko stou plaing tre zu ba ko", " stou tre"
    plain = reward_model_input(tok, prompt, response, 512)
    assert plain == tok(prompt + response)["input_ids"]
    tail = tok(response, add_special_tokens=False)["input_ids"]
    cut = reward_model_input(tok, prompt, response, len(tail) + 3)
    assert len(cut) == len(tail) + 3 and cut == plain[-len(cut) :]  # the response whole, the prompt's end
    assert tok.decode(cut).endswith("stou tre")
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m.role }}> {{ m.content }}{{ eos_token }}{% endfor %}"
    )
    templated = reward_model_input(tok, prompt, response, 512)
    text = tok.decode(templated)
    assert text.startswith("<s>") and "user" in text and "assistant" in text, text
    assert templated[-1] == tok.eos_token_id  # the assistant turn closes as in the reward model's training


VERL_ROW = {
    "data_source": "gsm8k",
    "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
    "reward_model": {"style": "rule", "ground_truth": "4"},
    "extra_info": {"index": 7},
}


def _verl_batch(tmp_path: Path) -> PromptBatch:
    path = tmp_path / "verl.jsonl"
    path.write_text(json.dumps(VERL_ROW) + "\n")
    return PromptDataset(str(path), "prompt", None, seed=0).next_batch(1)


def _function_scorer(tmp_path: Path, source: str) -> RewardScorer:
    f = tmp_path / "cols.py"
    f.write_text("SEEN = []\n" + source)
    return RewardScorer(
        {"type": "function", "function": f"{f}:reward", "timeout_seconds": 30, "concurrency": 1}
    )


def _seen(scorer: RewardScorer) -> list[Any]:
    return list(scorer.fn.__globals__["SEEN"])  # type: ignore[union-attr]


def test_a_rows_columns_reach_the_reward_function_parameters_named_for_them(tmp_path: Path) -> None:
    """A verl row through the dataset and the scorer: ground_truth (flattened from reward_model) and
    data_source arrive as keyword arguments, one value per response."""
    scorer = _function_scorer(
        tmp_path,
        "def reward(prompts, responses, *, ground_truth, data_source, unused=None):\n"
        "    SEEN.append((prompts, ground_truth, data_source, unused))\n"
        "    return [float(r == g) for r, g in zip(responses, ground_truth)]\n",
    )
    batch = _verl_batch(tmp_path)
    request = FinishedRequest(0, 0, batch.prompts[0], ["4", "5"], batch.labels[0])
    got = scorer.score_request(request, batch.columns[0])
    assert got.scores == [1.0, 0.0] and got.messages == []
    assert _seen(scorer) == [([VERL_ROW["prompt"]] * 2, ["4", "4"], ["gsm8k", "gsm8k"], None)]


def test_a_reward_function_taking_kwargs_gets_every_column(tmp_path: Path) -> None:
    scorer = _function_scorer(
        tmp_path,
        "def reward(prompts, responses, labels, **columns):\n"
        "    SEEN.append((labels, columns))\n"
        "    return [1.0] * len(responses)\n",
    )
    batch = _verl_batch(tmp_path)
    scorer.score_request(FinishedRequest(0, 0, batch.prompts[0], ["a"], batch.labels[0]), batch.columns[0])
    (labels, columns), = _seen(scorer)  # fmt: skip
    assert labels == [None]
    assert columns == {
        "data_source": ["gsm8k"],
        "reward_model": [VERL_ROW["reward_model"]],
        "extra_info": [{"index": 7}],
        "ground_truth": ["4"],
    }


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def reward(prompts, responses):\n    return [float(len(r)) for r in responses]\n", [1.0, 2.0]),
        (
            "def reward(prompts, responses, labels):\n    return [float(r == l) for r, l in zip(responses, labels)]\n",
            [0.0, 1.0],
        ),
    ],
)
def test_the_old_signatures_score_as_before_when_rows_have_columns(
    tmp_path: Path, source: str, expected: list[float]
) -> None:
    scorer = _function_scorer(tmp_path, source)
    columns = {"answer": "bb", "data_source": "x"}
    got = scorer.score_request(FinishedRequest(0, 0, "p", ["a", "bb"], label="bb"), columns)
    assert got.scores == expected and got.messages == []


def test_a_column_named_like_a_positional_parameter_is_not_passed_again(tmp_path: Path) -> None:
    scorer = _function_scorer(
        tmp_path,
        "def reward(prompts, responses, labels, **columns):\n"
        "    SEEN.append(columns)\n"
        "    return [1.0] * len(responses)\n",
    )
    got = scorer.score_request(FinishedRequest(0, 0, "p", ["a"], label="L"), {"labels": "x", "k": 1})
    assert got.messages == [] and _seen(scorer) == [{"k": [1]}]


def test_positional_only_parameters_leave_the_rest_to_the_columns() -> None:
    def reward(prompts: Any, responses: Any, /, labels: Any, ground_truth: Any = None) -> list[float]:
        return [1.0] * len(responses)

    cols = ColumnParameters.of(reward)  # called as reward(prompts, responses, labels)
    assert (cols.names, cols.reserved) == (frozenset({"ground_truth"}), frozenset({"labels"}))


def test_an_http_reward_gets_the_columns_under_columns() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RewardServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _RewardServer.bodies.clear()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        scorer = RewardScorer({"type": "http", "url": url, "timeout_seconds": 5, "concurrency": 1})
        got = scorer.score_request(FinishedRequest(0, 0, "p", ["ab", "c"], label=1), {"ground_truth": "ab"})
        scorer.score_request(FinishedRequest(0, 1, "q", ["ab"]))
    finally:
        server.shutdown()
    assert got.scores == [2.0, 1.0]
    first, second = _RewardServer.bodies
    assert first == {
        "prompts": ["p", "p"],
        "responses": ["ab", "c"],
        "labels": [1, 1],
        "columns": {"ground_truth": ["ab", "ab"]},
    }
    assert "columns" not in second  # a row with no other columns: the body of before
