"""A v1 environment as `vf-init reverse-v1` (verifiers 0.4.0) scaffolds it, filled in: a Taskset of reversal tasks,
a reward and a metric. Unchanged verifiers 0.4 code: nothing here knows verifiers_rl."""

import verifiers.v1 as vf

WORDS = ["hello", "world", "stone", "river", "plant", "cloud"]


class ReverseData(vf.TaskData):
    """One row's data. Add task-specific fields here, such as a reference answer."""

    answer: str = ""


class ReverseTask(vf.Task[ReverseData]):
    """Rewards, hooks, and servers, with row data available on ``self.data``."""

    @vf.reward(weight=1.0)
    async def reward(self, trace: vf.Trace) -> float:
        text = trace.last_reply or ""
        return 1.0 if text.strip() == self.data.answer else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 5
    """How many tasks to build."""


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> list[ReverseTask]:
        return [
            ReverseTask(ReverseData(prompt=f"Reverse the text: {w}", answer=w[::-1]), self.config.task)
            for w in (WORDS * 10)[: self.config.num_tasks]
        ]


__all__ = ["ReverseTaskset"]
