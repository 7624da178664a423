"""Shared by the benchmarks that time a trainer's optimizer steps: the wall and CPU time of every step (kept apart
from timing.py, which loads no transformers)."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class StepRecorder(TrainerCallback):
    """Instants of every ``on_step_end`` and the reward each trainer logs."""

    def __init__(self):
        self.begin = None
        self.ends: list[float] = []
        self.rewards: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()
        self.cpu: list[float] = [time.process_time()]

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def cores(self, skip: int) -> float:
        """CPU seconds of this process per wall second over the steps after ``skip``."""
        wall = [self.begin] + self.ends
        return (self.cpu[-1] - self.cpu[skip]) / (wall[-1] - wall[skip])

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append(float(logs["reward"]))

    def intervals(self) -> list[float]:
        points = [self.begin] + self.ends
        return [b - a for a, b in zip(points, points[1:])]

