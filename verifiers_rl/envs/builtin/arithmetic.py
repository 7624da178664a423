"""arithmetic: small procedurally generated problems, answered in ``\\boxed{}`` and checked with math-verify."""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

from verifiers_rl.envs.math_check import correct_answer
from verifiers_rl.envs.parsers import Parser, extract_boxed_answer
from verifiers_rl.envs.rubric import Rubric
from verifiers_rl.envs.singleturn import SingleTurnEnv
from verifiers_rl.envs.splits import disjoint_rows

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def make_dataset(num_examples: int, max_operand: int, seed: int) -> list[dict[str, str]]:
    """``num_examples`` problems ``a op b`` with operands in 0..``max_operand`` (divisors 1..); a division's answer
    is a reduced fraction such as ``7/3``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        symbol = rng.choice(list(_OPERATIONS))
        a, b = rng.randint(0, max_operand), rng.randint(1 if symbol == "/" else 0, max_operand)
        rows.append(
            {"question": f"What is {a} {symbol} {b}?", "answer": str(_OPERATIONS[symbol](Fraction(a), Fraction(b)))}
        )
    return rows


def load_environment(
    *,
    tokenizer: Any,
    num_examples: int = 1000,
    num_eval_examples: int = 100,
    max_operand: int = 20,
    seed: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
    max_new_tokens: int = 64,
    max_seq_len: int = 192,
    **kwargs: Any,
) -> SingleTurnEnv:
    """The arithmetic environment (reward 1/0); extra keyword arguments go to ``SingleTurnEnv``."""
    rows = make_dataset(num_examples, max_operand, seed)
    # The held-out split: rows from other seeds, none with a training row's prompt.
    held_out = disjoint_rows(lambda n, s: make_dataset(n, max_operand, s), num_eval_examples, rows, seed, "arithmetic")
    return SingleTurnEnv(
        rows,
        Rubric([correct_answer], parser=Parser(extract=extract_boxed_answer)),
        tokenizer,
        system_prompt=system_prompt,
        max_new_tokens=max_new_tokens,
        max_seq_len=max_seq_len,
        name="arithmetic",
        eval_dataset=held_out,
        **kwargs,
    )
