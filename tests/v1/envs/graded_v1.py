"""A v1 environment whose reward varies with any reply (shorter replies score higher), so a random policy has signal
to learn from; with ``boom=True`` the reward of task 1 raises. Unchanged verifiers 0.4 code."""

import verifiers.v1 as vf

WORDS = ["hello", "world", "stone", "river", "plant", "cloud", "green", "light"]


class GradedData(vf.TaskData):
    answer: str = ""


class GradedTask(vf.Task[GradedData]):
    @vf.reward(weight=1.0)
    async def shortness(self, trace: vf.Trace) -> float:
        if self.data.answer == "boom":
            raise RuntimeError("the reward exploded on purpose")
        return 1.0 / (1.0 + len(trace.last_reply or ""))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class GradedConfig(vf.TasksetConfig):
    num_tasks: int = 8
    boom: bool = False


class GradedTaskset(vf.Taskset[GradedTask, GradedConfig]):
    def load(self) -> list[GradedTask]:
        words = (WORDS * 10)[: self.config.num_tasks]
        return [
            GradedTask(GradedData(prompt=f"Say something short about: {w}",
                                  answer="boom" if self.config.boom and i == 1 else w), self.config.task)
            for i, w in enumerate(words)
        ]


__all__ = ["GradedTaskset"]
