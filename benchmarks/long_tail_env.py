"""The long-tail benchmark's workload (benchmarks/long_tail.py): an environment whose completion lengths are fixed per
prompt, and the same lengths forced on TRL's ``generate``.

Every row asks for a fixed number of sampled tokens in each model turn (``info["lengths"]``); the model's eos must be
suppressed by whoever runs it (the benchmark replaces the embedded engine's eos list), and ``FixedLengths`` asks the
engine for exactly each turn's length and fails loudly when a sample comes back with another, so both sides of the
benchmark decode the same tokens per row. Rows are numbered in their text (``Row 17: ...``) so a prompt names its row
wherever it is tokenized (TRL's side finds its lengths that way).
"""

from __future__ import annotations

import dataclasses
import random
import re
import statistics
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from verifiers_rl.envs import MultiTurnEnv, Rubric

WORDS = ["river", "mountain", "stone", "tree", "cloud", "harbor", "lantern", "meadow", "copper", "violet"]
ROW = re.compile(r"Row (\d+):")
CONTINUE = [{"role": "user", "content": "Go on."}]


def total_lengths(rows: int, median: int, tail_fraction: float, tail_factor: int, workload: str,
                  seed: int = 0) -> list[int]:
    """Each row's total completion tokens: ``longtail``: ``tail_fraction`` of the rows (seeded places) ask for
    ``tail_factor`` x ``median``, the others lengths spread evenly over [median/2, 3 median/2]; ``uniform``: every
    row the long-tail workload's mean (the same total tokens)."""
    rng = random.Random(seed)
    short = [round(median / 2 + median * i / max(rows - 1, 1)) for i in range(rows)]
    rng.shuffle(short)
    tail = set(rng.sample(range(rows), round(tail_fraction * rows)))
    longtail = [tail_factor * median if i in tail else short[i] for i in range(rows)]
    if workload == "longtail":
        return longtail
    if workload == "uniform":
        return [round(statistics.mean(longtail))] * rows
    raise ValueError(f"workload must be longtail or uniform, not {workload!r}")


def turn_lengths(total: int, turns: int) -> list[int]:
    """``total`` tokens over ``turns`` model turns, as equal as integers allow (each at least 1)."""
    base, extra = divmod(max(total, turns), turns)
    return [base + (1 if t < extra else 0) for t in range(turns)]


def variety(completion, parser) -> float:
    """The reward: the share of distinct characters in the reply (cheap, and varies within a group)."""
    text = parser.parse_answer(completion) or ""
    return len(set(text)) / max(len(text), 1)


def asked_tokens(info) -> float:
    """Not a reward (weight 0): the tokens the row asks for, so every trained rollout can be checked against it."""
    return float(sum(info["lengths"]))


def row(info) -> float:
    """Not a reward (weight 0): the row's index, to compare the same row across the benchmark's sides."""
    return float(info["row"])


class FixedLengths:
    """A sampler that asks the engine for exactly the current turn's length and checks it got it (eos suppressed);
    the sample is reported as ``stop`` (the episode's own end, not a truncation)."""

    def __init__(self, sampler, lengths: list[int], state: dict[str, Any]):
        self.sampler, self.lengths, self.state = sampler, lengths, state

    async def sample(self, prompt_ids: list[int], max_new_tokens: int):
        asked = self.lengths[self.state["turn"]]
        if asked > max_new_tokens:
            raise ValueError(f"row {self.state['info']['row']} asks {asked} tokens in turn {self.state['turn']}, "
                             f"only {max_new_tokens} fit: raise the environment's max_seq_len")
        sample = await self.sampler.sample(prompt_ids, asked)
        if len(sample.token_ids) != asked:
            raise RuntimeError(f"row {self.state['info']['row']}, turn {self.state['turn']}: asked {asked} tokens, "
                               f"got {len(sample.token_ids)} ({sample.finish_reason}): is the engine's eos suppressed? "
                               "The sides would not do equal work.")
        return dataclasses.replace(sample, finish_reason="stop")


class LongTailEnv(MultiTurnEnv):
    """``len(lengths[i])`` model turns for row i, turn t sampling exactly ``lengths[i][t]`` tokens; between turns the
    user says "Go on."."""

    def __init__(self, tokenizer, lengths: list[list[int]], **kwargs: Any):
        turns = {len(per_row) for per_row in lengths}
        if len(turns) != 1:
            raise ValueError("every row must have the same number of turns")
        records = [{"question": f"Row {i}: tell a story about the {WORDS[i % len(WORDS)]}.",
                    "info": {"row": i, "lengths": per_row}} for i, per_row in enumerate(lengths)]
        self.turns = turns.pop()
        longest = max(sum(per_row) for per_row in lengths)
        prompt = max(len(tokenizer.apply_chat_template(
            [{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=True,
            return_dict=False)) for r in records)
        max_seq_len = prompt + longest + 32 * self.turns  # 32 per turn: the bridge (end of turn, "Go on.", prompt)
        super().__init__(records, Rubric([variety, asked_tokens, row], weights=[1.0, 0.0, 0.0]), tokenizer,
                         max_new_tokens=max(max(per_row) for per_row in lengths), max_seq_len=max_seq_len,
                         max_turns=self.turns, name="long_tail", **kwargs)

    def is_completed(self, messages, state) -> bool:
        return state["turn"] >= len(state["info"]["lengths"])

    def env_response(self, messages, state):
        return list(CONTINUE)

    async def generate(self, sampler, prompt, prompt_ids, state):
        return await super().generate(FixedLengths(sampler, state["info"]["lengths"], state), prompt, prompt_ids,
                                      state)


def build_env(tokenizer, rows: int, median: int, tail_fraction: float, tail_factor: int, workload: str,
              turns: int) -> LongTailEnv:
    """The benchmark's environment: ``rows`` rows of ``total_lengths`` tokens each, over ``turns`` model turns."""
    totals = total_lengths(rows, median, tail_fraction, tail_factor, workload)
    return LongTailEnv(tokenizer, [turn_lengths(total, turns) for total in totals])


class ForcedLengths(LogitsProcessor):
    """For ``transformers.generate``: row r's eos is masked until its ``targets[r]``-th token, which is an eos
    (forced): the row's completion, eos included, is exactly ``targets[r]`` tokens."""

    def __init__(self, targets: torch.Tensor, prompt_width: int, eos_ids: list[int]):
        self.targets, self.width, self.eos = targets, prompt_width, torch.tensor(eos_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        made = input_ids.shape[1] - self.width  # tokens generated so far
        eos = self.eos.to(scores.device)
        last = (self.targets.to(scores.device) - 1 == made)  # rows whose next token is their last
        scores = scores.clone()
        scores[:, eos] = float("-inf")
        scores[last] = float("-inf")
        scores[last.nonzero()[:, :1], eos[None, :]] = 0.0
        return scores


def force_lengths(model, tokenizer, lengths: dict[int, int], eos_ids: list[int]) -> None:
    """Make ``model.generate`` (as TRL's GRPOTrainer calls it) give each row the completion length its prompt's
    ``Row i:`` asks (``lengths[i]``, eos included); a prompt naming no known row fails loudly."""
    generate = model.generate

    def fixed(*args, input_ids=None, attention_mask=None, **kwargs):
        targets = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = tokenizer.decode([t for t, m in zip(ids, mask) if m])
            found = ROW.search(text)
            if found is None or int(found.group(1)) not in lengths:
                raise RuntimeError(f"TRL's prompt names no row of the workload: {text!r}")
            targets.append(lengths[int(found.group(1))])
        processor = ForcedLengths(torch.tensor(targets), input_ids.shape[1], eos_ids)
        return generate(*args, input_ids=input_ids, attention_mask=attention_mask,
                        logits_processor=LogitsProcessorList([processor]), **kwargs)

    model.generate = fixed
