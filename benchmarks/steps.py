"""Shared by the benchmarks that time a trainer's optimizer steps: the wall and CPU time of every step and the
trainer settings the runs share (kept apart from timing.py, which loads no transformers)."""

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


def run_settings(out: str, max_steps: int, learning_rate: float) -> dict:
    """The trainer settings every timed run shares: on the CPU, no reports, checkpoints or progress bar, a log line
    per step (the recorders read it), a constant learning rate."""
    return dict(output_dir=out, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                max_steps=max_steps, learning_rate=learning_rate, lr_scheduler_type="constant")


def grpo_settings(out: str, max_steps: int, learning_rate: float, batch: int, num_generations: int,
                  max_completion_length: int) -> dict:
    """What our trainer and TRL's are both given when compared: ``run_settings``, one optimizer step per ``batch``
    rollouts, GRPO's clipped loss without KL, plain sampling, float32, no gradient checkpointing."""
    return dict(
        run_settings(out, max_steps, learning_rate), bf16=False, warmup_steps=0,
        optim="adamw_torch_fused",  # transformers' default with torch >= 2.8: what both run when a user sets none
        weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=num_generations, max_completion_length=max_completion_length, temperature=1.0, top_k=0,
        top_p=1.0, num_iterations=1, beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        gradient_checkpointing=False, seed=0,
    )


def watch_ours(trainer, recorder) -> None:
    """Make ``recorder`` our trainer's last callback, so that a step ends once the engine holds its weights, and give
    it the trainer, whose trained rollouts it reads at each step's end."""
    trainer.add_callback(recorder)
    recorder.trainer = trainer
