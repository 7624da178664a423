"""calculator: multi-step arithmetic with a ``calculate`` tool (ToolEnv); the answer goes in ``\\boxed{}``."""

from __future__ import annotations

import ast
import math
import operator
import random
from collections.abc import Callable
from typing import Any

from verifiers_rl.envs.math_check import correct_answer
from verifiers_rl.envs.parsers import Parser, extract_boxed_answer
from verifiers_rl.envs.rubric import Rubric
from verifiers_rl.envs.splits import disjoint_rows
from verifiers_rl.envs.tools import ToolEnv

SYSTEM_PROMPT = "Use the calculate tool for arithmetic. Put the final answer in \\boxed{}."
MAX_EXPRESSION_CHARS = 200
MAX_POWER_DIGITS = 1000  # bounds a power's size (9**9**9 would stall the rollout); the length bounds the rest

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and abs(right) * math.log10(abs(left)) > MAX_POWER_DIGITS:
            raise ValueError(f"the power would have more than {MAX_POWER_DIGITS} digits")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax: {ast.unparse(node)!r}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    # Parsed, never eval'd: only the whitelisted nodes above are evaluated.
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def make_dataset(num_examples: int, seed: int) -> list[dict[str, str]]:
    """``num_examples`` problems ``a * b + c`` / ``a * b - c`` with 2-3 digit numbers: hard to do in one's head."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, b, c = rng.randint(12, 999), rng.randint(12, 99), rng.randint(10, 999)
        symbol = rng.choice("+-")
        rows.append(
            {"question": f"What is {a} * {b} {symbol} {c}?", "answer": str(a * b + c if symbol == "+" else a * b - c)}
        )
    return rows


def load_environment(
    *,
    tokenizer: Any,
    num_examples: int = 1000,
    num_eval_examples: int = 100,
    seed: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
    max_turns: int = 4,
    max_new_tokens: int = 128,
    max_seq_len: int = 1024,
    **kwargs: Any,
) -> ToolEnv:
    """The calculator environment (reward 1/0; needs a chat template with tool support); extra keyword arguments
    go to ``ToolEnv``."""
    rows = make_dataset(num_examples, seed)
    # The held-out split: rows from other seeds, none with a training row's prompt.
    held_out = disjoint_rows(make_dataset, num_eval_examples, rows, seed, "calculator")
    return ToolEnv(
        rows,
        Rubric([correct_answer], parser=Parser(extract=extract_boxed_answer)),
        tokenizer,
        tools=[calculate],
        system_prompt=system_prompt,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_seq_len=max_seq_len,
        name="calculator",
        eval_dataset=held_out,
        **kwargs,
    )
