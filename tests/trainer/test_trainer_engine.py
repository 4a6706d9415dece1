"""Prompt encoding of the rollout engine (rlhf_trainer.rollout.engine.encode_prompt), with the tiny BPE."""

from __future__ import annotations

from typing import Any

import pytest
from rlhf_trainer.rollout.engine import encode_prompt
from rlhf_trainer.tiny_model import build_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer(512)


def test_plain_prompt_is_tokenized_as_is_and_cut_from_the_left(tok: Any) -> None:
    ids = encode_prompt(tok, "ba ko stou", chat_template=False, max_tokens=None)
    assert ids == tok("ba ko stou")["input_ids"] and tok.decode(ids) == "ba ko stou"
    assert encode_prompt(tok, "ba ko stou", chat_template=False, max_tokens=2) == ids[-2:]


def test_chat_template_wraps_the_prompt_as_a_user_turn(tok: Any) -> None:
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }} {{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %} assistant{% endif %}"
    )
    ids = encode_prompt(tok, "ba ko", chat_template=True, max_tokens=None)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the template's own specials
    assert tok.decode(ids[1:]) == "user ba ko assistant"


def test_sampling_seeds_follow_seed_step_and_prompt_only() -> None:
    from rlhf_trainer.rollout.engine import sampling_seed

    seeds = {sampling_seed(42, step, prompt) for step in range(1, 50) for prompt in range(64)}
    assert len(seeds) == 49 * 64, "two (step, prompt) pairs share a seed"
    assert sampling_seed(42, 3, 7) == sampling_seed(42, 3, 7)  # the same on a resumed run, on any engine
    assert sampling_seed(43, 3, 7) != sampling_seed(42, 3, 7)
    # vLLM seeds a prompt's n samples seed, seed + 1, ...: room for them below 2**64
    assert max(seeds) < 2**62


def test_enforce_eager_unset_is_eager_on_cpu_only_and_the_spec_wins() -> None:
    from rlhf_trainer.rollout.engine import enforce_eager

    assert enforce_eager(None, "cpu") is True  # the CPU backend has no CUDA graphs
    assert enforce_eager(None, "cuda") is False  # CUDA graphs on GPU
    assert enforce_eager(True, "cuda") is True and enforce_eager(False, "cpu") is False


def test_engine_options_carry_the_specs_vllm_modes() -> None:
    from pathlib import Path

    import yaml
    from rlhf_trainer.config import engine_options, parse_spec
    from rlhf_trainer.device import DeviceInfo

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "rlhfjob-tiny.yaml").read_text())
    cuda = DeviceInfo("cuda", "nccl")
    defaults = engine_options(parse_spec(doc), cuda, 1)
    assert defaults["enforce_eager"] is None and defaults["enable_prefix_caching"] is True
    doc["spec"].setdefault("rollout", {}).update(enforceEager=True, enablePrefixCaching=False)
    options = engine_options(parse_spec(doc), cuda, 1)
    assert options["enforce_eager"] is True and options["enable_prefix_caching"] is False


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def test_chat_messages_go_through_the_chat_template_with_the_generation_prompt(tok: Any) -> None:
    """A message-list prompt is rendered by the template whatever data.applyChatTemplate says, system
    turn included, ending with the assistant's generation prompt."""
    tok.chat_template = TEMPLATE
    messages = [{"role": "system", "content": "ko"}, {"role": "user", "content": "ba stou"}]
    for flag in (False, True):
        ids = encode_prompt(tok, messages, chat_template=flag, max_tokens=None)
        rendered = tok.bos_token + "system ko user ba stou assistant"  # the tiny BPE has no "y": compare ids
        assert ids == tok(rendered, add_special_tokens=False)["input_ids"] and ids[0] == tok.bos_token_id
    plain = encode_prompt(tok, "ba stou", chat_template=False, max_tokens=None)
    assert tok.decode(plain) == "ba stou"  # a text without applyChatTemplate stays plain


def test_chat_messages_without_a_chat_template_are_refused_by_name() -> None:
    bare = build_tokenizer(512)
    assert not getattr(bare, "chat_template", None)
    with pytest.raises(
        ValueError, match=r"data.prompts: a prompt is a list of chat messages .* no chat template"
    ):
        encode_prompt(bare, [{"role": "user", "content": "ba"}], chat_template=False, max_tokens=None)
