"""What a training run prints: one short line per logged step, and a few sample completions every N steps.

Replaces transformers' ``ProgressCallback`` / ``PrinterCallback`` (which print the raw dict of every metric) with a
progress bar (unless ``disable_tqdm``) and lines a person can read while the run goes on.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback
from transformers.utils.logging import tqdm  # honours transformers' progress-bar switches

from verifiers_rl.core.models import is_terminal

# (log key, label, format); a key missing from the logs (e.g. is_ratio when replaying without sampler log-probs)
# is left out of the line. wait + train + sync (+ log/save/eval, shown when it took time) add up to step: the wall
# time between two optimizer steps (step_metrics.py).
STEP_FIELDS = (
    ("reward", "reward", "{:.3f}"),
    ("reward_std", "±", "{:.3f}"),
    ("loss", "loss", "{:.4f}"),
    ("is_ratio", "is_ratio", "{:.3f}"),
    ("staleness_max", "staleness", "{:.0f}"),
    ("reward_errors", "reward_errors", "{:.0f}"),
    ("rollouts_failed", "rollouts_failed", "{:.0f}"),
    ("groups_dropped_on_error", "dropped_on_error", "{:.0f}"),  # not --filter_groups' groups_dropped
    ("groups_stale_dropped", "stale_dropped", "{:.0f}"),  # continuous generation: older than the bound
    ("weight_sync_probe_gap", "probe_gap", "{:.1e}"),
    ("generation_time", "gen", "{:.1f}s"),
    ("wait_time", "wait", "{:.1f}s"),
    ("train_time", "train", "{:.1f}s"),
    ("weight_sync_time", "sync", "{:.1f}s"),
    ("between_steps_time", "log/save/eval", "{:.1f}s"),
    ("step_time", "step", "{:.1f}s"),
)
_SHOWN_WHEN_NONZERO = {"between_steps_time", "rollouts_failed", "groups_dropped_on_error", "groups_stale_dropped"}


@dataclass
class SampleLine:
    """One rollout as printed: the last prompt message, the model's reply, its reward."""

    prompt: str
    completion: str
    reward: float


def last_text(messages: Any) -> str:
    """The text of a chat's last message, or the text itself."""
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        return str(messages[-1].get("content", ""))
    return "" if messages is None else str(messages)


def sample_lines(rollouts, count: int) -> list[SampleLine]:
    """The first rollout of each of the first ``count`` groups (different prompts read better than one prompt's
    group)."""
    seen, picked = set(), []
    for rollout in rollouts:
        if rollout.group_id in seen:
            continue
        seen.add(rollout.group_id)
        picked.append(SampleLine(last_text(rollout.prompt), last_text(rollout.completion), rollout.reward))
        if len(picked) == count:
            break
    return picked


def _shorten(text: str, width: int) -> str:
    text = repr(text)
    return text if len(text) <= width else text[: width - 3] + "..."


def format_step_line(step: int, max_steps: int, logs: dict[str, float]) -> str:
    """``step 12/60 | reward 0.231 ± 0.104 | is_ratio 1.000 | staleness 1 | gen 3.1s | wait 0.2s | train 4.1s | sync
    1.1s | step 5.4s``."""
    parts = [f"step {step}/{max_steps}"]
    for key, label, fmt in STEP_FIELDS:
        value = logs.get(key)
        if key in _SHOWN_WHEN_NONZERO and isinstance(value, (int, float)) and value < 0.05:
            continue
        if isinstance(value, (int, float)):
            if key == "reward_std":
                parts[-1] += f" ± {fmt.format(value)}"
            else:
                parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


def format_eval_line(step: int, logs: dict[str, float], prefix: str = "eval") -> str:
    """``eval at step 20 | reward 0.312 ± 0.101 | pass@1 0.100 | pass@4 0.250 | 100 prompts x 4 | 12.3s``."""
    get = lambda name: logs.get(f"{prefix}_{name}")  # noqa: E731
    parts = [f"{prefix} at step {step}", f"reward {get('reward'):.3f}"]
    std = get("reward_std")
    if isinstance(std, (int, float)) and math.isfinite(std):  # one sample has none (NaN): left out, as the step's
        parts[-1] += f" ± {std:.3f}"
    passes = sorted((int(key.rsplit("@", 1)[1]), value) for key, value in logs.items()
                    if key.startswith(f"{prefix}_pass@"))
    parts += [f"pass@{k} {value:.3f}" for k, value in passes]
    if get("num_prompts") is not None:
        parts.append(f"{get('num_prompts'):.0f} prompts x {get('samples_per_prompt'):.0f}")
    if get("runtime") is not None:
        parts.append(f"{get('runtime'):.1f}s")
    return " | ".join(parts)


def format_samples(step: int, samples: list[SampleLine], width: int = 100) -> str:
    lines = [f"--- sample completions at step {step} ---"]
    for sample in samples:
        lines.append(f"  [{sample.reward:.2f}] {_shorten(sample.prompt, width // 2)} -> {_shorten(sample.completion, width)}")
    return "\n".join(lines)


def format_summary(
    steps: int, seconds: float, rewards: list[float], window: int = 5, max_steps: int | None = None
) -> str:
    """``done: 60 steps in 612 s; mean reward 0.081 (first 5 logged steps) -> 0.287 (last 5)``; a run stopped early
    (preemption) says ``stopped at step 4 of 60 in ...``."""
    if max_steps is not None and steps < max_steps:
        line = f"stopped at step {steps} of {max_steps} in {seconds:.0f} s"
    else:
        line = f"done: {steps} steps in {seconds:.0f} s"
    if len(rewards) >= 2:
        window = min(window, len(rewards) // 2)
        first, last = rewards[:window], rewards[-window:]
        line += (
            f"; mean reward {sum(first) / len(first):.3f} (first {window} logged steps) -> "
            f"{sum(last) / len(last):.3f} (last {window})"
        )
    return line


class StepProgressCallback(TrainerCallback):
    """A progress bar, a line per logged step, and sample completions every ``print_samples_every`` steps
    (main process only). ``samples()`` returns the newest batch's sample lines (the trainer keeps them)."""

    def __init__(self, samples, show_bar: bool = True):
        self.samples = samples
        self.show_bar = show_bar
        self.bar = None
        self.sample_prints = 0  # how many print_samples_every boundaries have been printed
        self.rewards: list[float] = []  # the logged mean reward of every logged step

    def _write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.show_bar:
            self.bar = tqdm(total=state.max_steps, dynamic_ncols=True, desc="training")

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "reward" in logs:
            self.rewards.append(logs["reward"])
            self._write(format_step_line(state.global_step, state.max_steps, logs))
            every = getattr(args, "print_samples_every", 0)
            if every and state.global_step // every > self.sample_prints:
                samples = self.samples()
                if samples:
                    self.sample_prints = state.global_step // every
                    self._write(format_samples(state.global_step, samples))
        elif "eval_reward" in logs:
            self._write(format_eval_line(state.global_step, logs))
        if "train_runtime" in logs:  # with the last step's metrics when they were not logged at their step
            self._write(format_summary(state.global_step, logs["train_runtime"], self.rewards, max_steps=state.max_steps))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class RolloutProgress:
    """Progress through ``total`` rollouts (``verifiers-rl eval``): a tqdm bar on a terminal; on a redirected
    stderr a line every 10% (a bar's carriage returns garble logs). Call it with each finished group's size."""

    def __init__(self, total: int):
        self.total, self.done, self.printed = total, 0, 0
        self.start = time.perf_counter()
        self.bar = tqdm(total=total, desc="evaluating", unit="rollout", dynamic_ncols=True) if show_bar(False) else None

    def __call__(self, count: int) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(count)
        elif self.done * 10 // self.total > self.printed or self.done == self.total:
            self.printed = self.done * 10 // self.total
            print(f"evaluated {self.done}/{self.total} rollouts ({time.perf_counter() - self.start:.0f} s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def show_bar(disable_tqdm: bool, stream=None) -> bool:
    """A progress bar only on a terminal (``core.models.is_terminal``): redrawn with carriage returns, it would garble
    a log file (and interleave with the step lines) when stderr is redirected."""
    return not disable_tqdm and is_terminal(stream)


def plain_output_when_redirected() -> None:
    """Turn off transformers' and huggingface_hub's own progress bars (model loading, checkpoint writing) when stderr
    is not a terminal, where their carriage returns would garble the log."""
    if not show_bar(False):
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        disable_progress_bars()


def install(trainer, samples) -> None:
    """Swap transformers' printing callbacks on ``trainer`` for a ``StepProgressCallback``."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(StepProgressCallback(samples, show_bar=show_bar(trainer.args.disable_tqdm)))
    plain_output_when_redirected()
