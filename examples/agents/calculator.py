"""A calculator-tool agent (rollout.agent: examples/agents/calculator.py:run_episode).

The model may write `<calc>2+3</calc>`; generation stops there, the tool evaluates the arithmetic, and
`<result>5</result>` is appended as tool tokens (loss mask 0) before the model goes on. The tool parses
the expression with `ast` and evaluates numbers and + - * / // % ** and unary signs only: nothing else
(names, calls, attributes) is ever evaluated.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from rlhf_trainer.agents.contract import Episode, Trajectory

CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)
MAX_POWER_BITS = 4096  # 9**9**9**9 would hang the tool's thread: a power's result stays under 2**4096
MAX_LENGTH = 200  # characters of one expression

BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class NotArithmetic(ValueError):
    """The expression is not plain arithmetic on numbers."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; NotArithmetic for anything else (ZeroDivisionError as
    Python raises it)."""
    if len(expression) > MAX_LENGTH:
        raise NotArithmetic(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise NotArithmetic(f"not an expression: {expression!r}") from e
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * math.log2(abs(left) + 2) > MAX_POWER_BITS:
            raise NotArithmetic(f"{left} ** {right} is too large")
        return BINARY[type(node.op)](left, right)  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))  # type: ignore[no-any-return]
    raise NotArithmetic(f"{type(node).__name__} is not arithmetic")


async def run_episode(episode: Episode) -> Trajectory:
    """Generate; while the turn ends in a <calc> call, append the tool's <result> and generate again. A
    malformed expression gets `<result>error</result>` (the model learns from it); the episode ends when a
    turn makes no call, or at maxTurns / the token budget (EpisodeLimit, handled by the dispatcher)."""
    while True:
        turn = await episode.generate(stop=("</calc>",))
        call = CALL.search(episode.codec.decode(turn.token_ids))
        if call is None:
            return episode.finish()
        try:
            value = await episode.call_tool(calculate, call.group(1))
            result = f"{value:g}" if isinstance(value, float) else str(value)
        except Exception as e:
            if getattr(e, "reason", "") == "tool_timeout":
                raise  # a hung tool ends the episode
            result = "error"
        episode.append_text(f"<result>{result}</result>")
