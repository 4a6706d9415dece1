"""docs/agents.md's chat-template example runs as the page shows it: `tool_turn_text`, taken from the page,
gives the tool turn a ChatML template writes after an assistant turn, and prompt + model turn + tool text +
next model turn is what the template renders for the whole conversation (so an agent that appends it trains
on what a served model would see, without re-tokenising the model's tokens)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
# A ChatML template with Qwen2.5's tool turn (a tool message is a user turn holding <tool_response>).
CHATML = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tool_turn_text() -> Any:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    (source,) = [b for b in blocks if "def tool_turn_text" in b]
    space: dict[str, Any] = {}
    exec(compile(source, str(DOC), "exec"), space)
    return space["tool_turn_text"]


@pytest.fixture(scope="module")
def chatml() -> Any:
    from rlhf_trainer.tiny_model import build_tokenizer

    tok: Any = build_tokenizer(512)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    return tok


def test_the_tool_turn_is_the_templates_text_after_the_models_end_of_turn(
    tool_turn_text: Any, chatml: Any
) -> None:
    assert tool_turn_text(chatml, "42", True) == TOOL_TURN
    assert tool_turn_text(chatml, "42", False) == "<|im_end|>" + TOOL_TURN  # stopped on a stop string
    assert json.dumps(TOOL_TURN) in DOC.read_text(encoding="utf-8")  # the page shows this very string


def test_prompt_model_turns_and_tool_text_are_the_whole_conversation_rendered(
    tool_turn_text: Any, chatml: Any
) -> None:
    conversation = [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "<calc>6*7</calc>"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "Answer: 42"},
    ]
    prompt = chatml.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    # what the model samples: each turn's text and its end-of-turn token (EOS); the agent appends the rest
    trajectory = (
        prompt + "<calc>6*7</calc><|im_end|>" + tool_turn_text(chatml, "42", True) + "Answer: 42<|im_end|>"
    )
    assert trajectory + "\n" == chatml.apply_chat_template(conversation, tokenize=False)
