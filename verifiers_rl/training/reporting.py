"""Tables of sample completions for the ``--report_to`` backends, every ``--log_completions_steps`` steps.

The per-step metrics reach every backend through transformers' own callbacks (``TensorBoardCallback``,
``WandbCallback``, ``TrackioCallback``). TRL's completion tables read buffers that only TRL's own generation fills,
so this callback logs the trained batch instead, through the same backends' already-open runs: a markdown table as
text for tensorboard, a ``Table`` for wandb and trackio (with ``train/global_step``, as their metric logs have).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback, TrackioCallback, WandbCallback

from verifiers_rl.compat import reporting_backend
from verifiers_rl.envs.rubric import ERRORS_METRIC
from verifiers_rl.training.progress import last_text

logger = logging.getLogger(__name__)

TABLE_KEY = "completions"


def completion_columns(rollouts, step: int) -> dict[str, list[Any]]:
    """One row per rollout: step, group, reward, each reward function's value, the prompt (its last message) and
    the completion (last: the free text)."""
    names = [name for name in (rollouts[0].metrics if rollouts else {}) if name != ERRORS_METRIC]
    columns: dict[str, list[Any]] = {
        "step": [step] * len(rollouts),
        "group": [str(r.group_id) for r in rollouts],
        "reward": [float(r.reward) for r in rollouts],
    }
    for name in names:
        columns[name] = [float(r.metrics.get(name, 0.0)) for r in rollouts]
    columns["prompt"] = [last_text(r.prompt) for r in rollouts]
    columns["completion"] = [last_text(r.completion) for r in rollouts]
    return columns


def markdown_table(columns: dict[str, list[Any]]) -> str:
    """The columns as a markdown table (tensorboard renders text summaries as markdown)."""

    def cell(value: Any) -> str:
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    names = list(columns)
    rows = zip(*(columns[name] for name in names))
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class CompletionTableCallback(TrainerCallback):
    """Every ``every`` optimizer steps (main process), log ``rollouts()`` (the batch just trained) as a table to each
    reporting backend the trainer has."""

    def __init__(self, handler, rollouts: Callable[[], list | None], every: int):
        self.handler = handler  # the trainer's CallbackHandler: the backends' callbacks live there
        self.rollouts = rollouts
        self.every = every

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or state.global_step % self.every:
            return
        rollouts = self.rollouts()
        if rollouts:
            self.log_table(completion_columns(rollouts, state.global_step), state.global_step)

    def log_table(self, columns: dict[str, list[Any]], step: int, key: str = TABLE_KEY) -> None:
        for callback in self.handler.callbacks:
            if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
                callback.tb_writer.add_text(key, markdown_table(columns), step)
                callback.tb_writer.flush()
            elif reporting_backend(callback) is not None:  # trackio, wandb
                self._log_frame(reporting_backend(callback), columns, step, key)

    @staticmethod
    def _log_frame(backend, columns: dict[str, list[Any]], step: int, key: str) -> None:
        import pandas as pd

        backend.log({key: backend.Table(dataframe=pd.DataFrame(columns)), "train/global_step": step})


def install(trainer, rollouts: Callable[[], list | None]) -> None:
    """Add the completion tables to ``trainer`` when ``--log_completions_steps`` asks for them."""
    every = trainer.args.log_completions_steps
    if every:
        if not any(isinstance(c, (TensorBoardCallback, TrackioCallback, WandbCallback))
                   for c in trainer.callback_handler.callbacks):
            logger.warning("--log_completions_steps %d: no --report_to backend (tensorboard, trackio, wandb) to log to.",
                           every)
        trainer.add_callback(CompletionTableCallback(trainer.callback_handler, rollouts, every))
