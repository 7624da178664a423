"""reverse_text: reverse a short random string; partial credit by edit distance. Small models learn it quickly."""

from __future__ import annotations

import random
import string
from typing import Any

from verifiers_rl.envs.messages import Messages
from verifiers_rl.envs.parsers import Parser
from verifiers_rl.envs.rubric import Rubric
from verifiers_rl.envs.singleturn import SingleTurnEnv
from verifiers_rl.envs.splits import disjoint_rows

SYSTEM_PROMPT = "Reverse the text character by character. Reply with the reversed text only."


def levenshtein(a: str, b: str) -> int:
    """The number of single-character insertions, deletions and substitutions turning ``a`` into ``b``."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def reversal_similarity(completion: Messages, answer: str, parser: Parser) -> float:
    """1 - (edit distance to the reversed text) / (length of the longer string): 1.0 exact, 0.0 nothing alike."""
    reply = parser.parse_answer(completion) or ""
    return 1.0 - levenshtein(reply, answer) / max(len(reply), len(answer), 1)


def make_dataset(num_examples: int, min_len: int, max_len: int, seed: int) -> list[dict[str, str]]:
    """``num_examples`` random lowercase strings of ``min_len``..``max_len`` characters and their reversals."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"reverse_text: need 1 <= min_len <= max_len, got {min_len} and {max_len}.")
    rng = random.Random(seed)
    texts = ("".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len))) for _ in range(num_examples))
    return [{"question": text, "answer": text[::-1]} for text in texts]


def load_environment(
    *,
    tokenizer: Any,
    num_examples: int = 1000,
    num_eval_examples: int = 100,
    min_len: int = 3,
    max_len: int = 6,
    seed: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
    max_new_tokens: int = 16,
    max_seq_len: int = 128,
    **kwargs: Any,
) -> SingleTurnEnv:
    """The reverse_text environment; extra keyword arguments go to ``SingleTurnEnv``."""
    rows = make_dataset(num_examples, min_len, max_len, seed)
    # The held-out split: rows from other seeds, none with a training row's prompt.
    held_out = disjoint_rows(lambda n, s: make_dataset(n, min_len, max_len, s), num_eval_examples, rows, seed, "reverse_text")
    return SingleTurnEnv(
        rows,
        Rubric([reversal_similarity]),
        tokenizer,
        system_prompt=system_prompt,
        max_new_tokens=max_new_tokens,
        max_seq_len=max_seq_len,
        name="reverse_text",
        eval_dataset=held_out,
        **kwargs,
    )
