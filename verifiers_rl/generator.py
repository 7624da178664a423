"""Where the trainer's batches of rollouts come from.

A source runs on the main process and hands out one optimizer step's rollouts at a time. ``ReplaySource``
replays a JSON Lines file; live generation (an environment through an inference engine, k steps ahead)
implements the same two methods.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
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


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close ``loop`` after ending the tasks engines may leave behind (a batching queue's drain)."""
    leftovers = asyncio.all_tasks(loop)
    for task in leftovers:
        task.cancel()
    if leftovers:
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
    loop.close()


class GenerationError(RuntimeError):
    """Generation, an environment or a reward function failed; raised where the trainer waits for a batch."""


class GenerationTimeout(GenerationError):
    """No batch arrived in time: the engine or an environment is stuck."""


class AsyncGenerator:
    """Produces batches of rollouts ``max_off_policy_steps`` (k) optimizer steps ahead, on a thread of the main process.

    Batch b is started only once the engine holds policy version >= b - k, so every rollout of batch b is at most
    k versions behind the weights that train on it (k = 0 is synchronous, on the caller's thread). A batch is
    generated under one lock, and ``hold_weights()`` takes the same lock, so a weight load never lands in the middle
    of a batch.
    """

    def __init__(
        self,
        environment,
        engine,
        rollouts_per_step: int,
        num_generations: int,
        max_off_policy_steps: int = 1,
        timeout_s: float = 600.0,
        seed: int = 0,
    ):
        if rollouts_per_step % num_generations:
            raise ValueError(
                f"rollouts_per_step ({rollouts_per_step}) must be a multiple of num_generations ({num_generations})."
            )
        if max_off_policy_steps < 0:
            raise ValueError("max_off_policy_steps must be >= 0.")
        rows = list(environment.dataset)
        if not rows:
            raise ValueError(f"The dataset of {type(environment).__name__} is empty: nothing to generate from.")
        self.environment = environment
        self.engine = engine
        self.rows = rows
        self.prompts_per_batch = rollouts_per_step // num_generations
        self.num_generations = num_generations
        self.max_off_policy_steps = max_off_policy_steps
        self.timeout_s = timeout_s
        self.seed = seed
        self._ready: dict[int, list[Rollout]] = {}
        self.generation_seconds: dict[int, float] = {}  # batch index -> seconds its generation took
        self._error: BaseException | None = None
        self._condition = threading.Condition()
        self._batch_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._order: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        return max(len(self.rows) // self.prompts_per_batch, 1)

    # --- the trainer's side -------------------------------------------------------------------------------------

    def batch(self, index: int) -> list[Rollout]:
        """Batch ``index``; waits at most ``timeout_s``; re-raises what went wrong in generation.

        With k = 0 there is nothing to run ahead: the batch is generated here, on the caller's thread.
        """
        if self.max_off_policy_steps == 0:
            return self._generate_here(index)
        self.start()
        deadline = time.monotonic() + self.timeout_s
        with self._condition:
            while index not in self._ready:
                if self._error is not None:
                    raise GenerationError(f"Generation failed: {type(self._error).__name__}: {self._error}") from self._error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timeout(index)
                self._condition.wait(timeout=min(remaining, 1.0))
            return self._ready.pop(index)

    def _generate_here(self, index: int) -> list[Rollout]:
        loop = asyncio.new_event_loop()
        started = time.perf_counter()
        try:
            with self._batch_lock:
                task = loop.create_task(asyncio.wait_for(self._generate(index), self.timeout_s))
                rollouts = loop.run_until_complete(task)
        except asyncio.TimeoutError:
            raise self._timeout(index) from None
        except Exception as error:
            raise GenerationError(f"Generation failed: {type(error).__name__}: {error}") from error
        finally:
            _close_loop(loop)
        self.generation_seconds[index] = time.perf_counter() - started
        return rollouts

    def _timeout(self, index: int) -> GenerationTimeout:
        return GenerationTimeout(
            f"No rollouts for batch {index} within {self.timeout_s:.0f} s (engine policy version "
            f"{self.engine.policy_version}); the engine or an environment is stuck."
        )

    def hold_weights(self):
        """Context manager for a weight load: waits for the batch in progress, blocks the next one."""
        return self._batch_lock

    def weights_updated(self) -> None:
        with self._condition:
            self._condition.notify_all()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="verifiers_rl-generator", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop generating: cancel the batch in progress and join the thread."""
        self._stop.set()
        with self._condition:
            self._condition.notify_all()
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                logger.warning("The generator thread did not stop within %.0f s (a generate call is still running).", timeout_s)
            self._thread = None

    # --- the generator thread -----------------------------------------------------------------------------------

    def _rows_of(self, index: int) -> list[tuple[int, dict]]:
        picked = []
        for k in range(self.prompts_per_batch):
            position = index * self.prompts_per_batch + k
            epoch, offset = divmod(position, len(self.rows))
            while len(self._order) <= epoch * len(self.rows) + offset:
                order = list(range(len(self.rows)))
                random.Random(self.seed + len(self._order) // len(self.rows)).shuffle(order)
                self._order.extend(order)
            row_index = self._order[epoch * len(self.rows) + offset]
            picked.append((position, row_index))
        return picked

    def _wait_for_version(self, index: int) -> bool:
        needed = index - self.max_off_policy_steps
        with self._condition:
            while self.engine.policy_version < needed and not self._stop.is_set():
                self._condition.wait(timeout=0.5)
        return not self._stop.is_set()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            index = 0
            while self._wait_for_version(index):
                with self._batch_lock:
                    started = time.perf_counter()
                    self._task = self._loop.create_task(self._generate(index))
                    rollouts = self._loop.run_until_complete(self._task)
                with self._condition:
                    self._ready[index] = rollouts
                    self.generation_seconds[index] = time.perf_counter() - started
                    self._condition.notify_all()
                index += 1
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it on every rank
            with self._condition:
                self._error = error
                self._condition.notify_all()
        finally:
            self._task = None
            _close_loop(self._loop)

    async def _generate(self, index: int) -> list[Rollout]:
        version = self.engine.policy_version
        groups = await asyncio.gather(
            *(
                self.environment.rollout_group(self.engine, self.rows[row_index], f"b{index}-p{position}", self.num_generations)
                for position, row_index in self._rows_of(index)
            )
        )
        rollouts = [rollout for group in groups for rollout in group]
        for rollout in rollouts:
            rollout.policy_version = version
        return rollouts
