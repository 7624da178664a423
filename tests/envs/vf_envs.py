"""Classic verifiers environments written as a user of the Environments Hub would (no hub, no network):
``load_environment(kind=...)`` returns a ``vf.SingleTurnEnv``, a ``vf.MultiTurnEnv`` with an environment turn, a
``vf.ToolEnv``, verifiers' own ``ReasoningGymEnv``, or environments that fail. Loaded as ``vf:tests.envs.vf_envs``.
"""

from __future__ import annotations

import asyncio

import verifiers as vf
from datasets import Dataset

WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "quartz", "willow"]


def vowel_fraction(completion, **kwargs) -> float:
    text = "".join(m.content or "" for m in completion if m.role == "assistant")
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def longest_in_group(completions, **kwargs) -> list[float]:
    """A group-level reward function (verifiers sees the plural parameter): 1 for the group's longest reply."""
    lengths = [sum(len(m.content or "") for m in c if m.role == "assistant") for c in completions]
    return [float(length == max(lengths)) for length in lengths]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def says_five(completion, **kwargs) -> float:
    return float("5" in (completion[-1].content or ""))


class EchoEnv(vf.MultiTurnEnv):
    """Asks the model to go on after each of its turns: every rollout has environment turns between model turns."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=f"Go on ({len(state['trajectory'])}).")]


class BrokenEnv(vf.MultiTurnEnv):
    """An environment whose game server fails after ``fail_after`` environment turns (in any rollout)."""

    def __init__(self, fail_after: int, **kwargs):
        super().__init__(**kwargs)
        self.fail_after = fail_after
        self.turns = 0

    async def env_response(self, messages, state, **kwargs):
        self.turns += 1
        if self.turns > self.fail_after:
            raise ConnectionError("the game server went away")
        return [vf.UserMessage(content="again")]


class OneSandboxGone(vf.MultiTurnEnv):
    """The first environment turn of any rollout fails; the others go on, counting the turns they play."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.failed, self.turns_played = False, 0

    async def env_response(self, messages, state, **kwargs):
        if not self.failed:
            self.failed = True
            raise ConnectionError("sandbox gone")
        await asyncio.sleep(0.01)
        self.turns_played += 1
        return [vf.UserMessage(content="again")]


def broken_group_reward(completions, **kwargs) -> list[float]:
    return [1.0]  # one score for a whole group: verifiers' score_group then fails with an IndexError


def dataset(num_examples: int, seed: int = 0) -> Dataset:
    words = [WORDS[(seed + i) % len(WORDS)] for i in range(num_examples)]
    return Dataset.from_list([{"question": f"Say a word like {w}.", "answer": w} for w in words])


def load_environment(kind: str = "single", num_examples: int = 8, max_turns: int = 3, fail_after: int = 4, **kwargs):
    rubric = vf.Rubric(funcs=[vowel_fraction, longest_in_group], weights=[1.0, 0.5])
    common = dict(dataset=dataset(num_examples), eval_dataset=dataset(4, seed=3), system_prompt="Be brief.", **kwargs)
    if kind == "single":
        return vf.SingleTurnEnv(rubric=rubric, **common)
    if kind == "multi":
        return EchoEnv(rubric=rubric, max_turns=max_turns, **common)
    if kind == "tool":
        return vf.ToolEnv(tools=[add], rubric=vf.Rubric(funcs=[says_five]), max_turns=max_turns, **common)
    if kind == "reasoning_gym":
        return vf.ReasoningGymEnv(gym="leg_counting", num_train_examples=num_examples, num_eval_examples=4, seed=0)
    if kind == "broken_env":
        return BrokenEnv(fail_after=fail_after, rubric=rubric, max_turns=max_turns, **common)
    if kind == "one_sandbox_gone":
        return OneSandboxGone(rubric=rubric, max_turns=max_turns, **common)
    if kind == "broken_rubric":
        return vf.SingleTurnEnv(rubric=vf.Rubric(funcs=[broken_group_reward]), **common)
    raise ValueError(f"unknown kind {kind!r}")
