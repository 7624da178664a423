"""Where the trainer's batches of rollouts come from.

A source runs on the main process and hands out one optimizer step's rollouts at a time. ``ReplaySource``
replays a JSON Lines file; live generation (an environment through an inference engine, k steps ahead)
implements the same two methods.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from .rollouts import Rollout, RolloutFormatError, read_rollouts

logger = logging.getLogger(__name__)


class RolloutSource(Protocol):
    def __len__(self) -> int:
        """Batches in one pass over the source."""

    def batch(self, index: int) -> list[Rollout]:
        """The rollouts of batch ``index`` (whole groups)."""


def split_into_batches(rollouts: list[Rollout], rollouts_per_step: int) -> list[list[Rollout]]:
    """Consecutive whole groups (in order of first appearance) of ``rollouts_per_step`` rollouts each.

    Advantages are computed within a group, so a group is never split between two batches. The last batch
    may be smaller; it is kept, not dropped.
    """
    groups: OrderedDict = OrderedDict()
    for rollout in rollouts:
        groups.setdefault(rollout.group_id, []).append(rollout)
    batches: list[list[Rollout]] = []
    current: list[Rollout] = []
    for group_id, members in groups.items():
        if len(members) > rollouts_per_step:
            raise RolloutFormatError(
                f"Group {group_id!r} has {len(members)} rollouts, more than rollouts_per_step={rollouts_per_step}."
            )
        if len(current) + len(members) > rollouts_per_step:
            raise RolloutFormatError(
                f"Group {group_id!r} ({len(members)} rollouts) does not fit the {rollouts_per_step - len(current)} "
                f"rollouts left in batch {len(batches)}: rollouts_per_step ({rollouts_per_step}) must be a sum of "
                "whole groups."
            )
        current.extend(members)
        if len(current) == rollouts_per_step:
            batches.append(current)
            current = []
    if current:
        logger.warning(
            "The last batch holds %d rollouts instead of %d; it is trained on as a smaller batch.",
            len(current),
            rollouts_per_step,
        )
        batches.append(current)
    return batches


class ReplaySource:
    """Replays a rollouts file (SPEC §4 line format) through the same batching and loss as live generation."""

    def __init__(self, path: str | Path, rollouts_per_step: int):
        self.path = Path(path)
        self.batches = split_into_batches(read_rollouts(self.path), rollouts_per_step)

    def __len__(self) -> int:
        return len(self.batches)

    def batch(self, index: int) -> list[Rollout]:
        return self.batches[index % len(self.batches)]
