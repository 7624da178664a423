"""Where the trainer's batches of rollouts come from.

A source runs on the main process and hands out one optimizer step's rollouts at a time. ``ReplaySource``
replays a JSON Lines file; live generation (an environment through an inference engine, k steps ahead)
implements the same two methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from verifiers_rl.core.curriculum import CurriculumSettings
from verifiers_rl.core.sampling import derive_seed, epoch_order
from verifiers_rl.core.settings import settings_from
from verifiers_rl.core.watched import run_watched
from verifiers_rl.core.rollout import (NOT_SAMPLED, Rollout, RolloutFormatError, group_by_id, group_episodes,
                                      read_rollouts)
from verifiers_rl.rollouts.curriculum import build_curriculum
from verifiers_rl.rollouts.groups import (GenerationError, GroupRollouts, count_by_environment, generation_failed,
                                          has_signal)

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    """What a rollout source hands the trainer for one batch: its rollouts (whole groups), the source's counts
    (``stats``: groups kept / dropped by the filter, refill rounds, reward errors; logged per step) and how long the
    batch took to generate (None when replayed)."""

    index: int
    rollouts: list[Rollout]
    stats: dict[str, float] = field(default_factory=dict)
    generation_s: float | None = None


class RolloutSource(Protocol):
    def __len__(self) -> int:
        """Batches in one pass over the source."""

    def batch(self, index: int) -> Batch | list[Rollout]:
        """Batch ``index`` (whole groups); a plain list of rollouts is taken as a ``Batch`` without stats."""


def dataset_rows(environment, prompts_per_batch: int) -> list:
    """The environment's training rows; none is an error, and fewer than a batch's prompts a warning (each batch then
    samples some prompt in more than one group)."""
    rows = list(environment.dataset)
    if not rows:
        raise ValueError(f"The dataset of {type(environment).__name__} is empty: nothing to generate from.")
    if len(rows) < prompts_per_batch:
        logger.warning("The dataset of %s has %d prompts, fewer than the %d a batch takes (--rollouts_per_step / "
                       "--num_generations): every batch repeats prompts in several groups.",
                       getattr(environment, "name", None) or type(environment).__name__, len(rows), prompts_per_batch)
    return rows


def as_batch(index: int, result: Batch | list[Rollout]) -> Batch:
    """A source's answer as a ``Batch`` with its reward-error count (sources of the user's may return a list)."""
    batch = result if isinstance(result, Batch) else Batch(index, list(result))
    batch.stats.setdefault("reward_errors", float(sum(r.metrics.get("reward_errors", 0.0) for r in batch.rollouts)))
    return batch


def split_into_batches(rollouts: list[Rollout], rollouts_per_step: int) -> list[list[Rollout]]:
    """Consecutive whole groups (in order of first appearance) of ``rollouts_per_step`` EPISODES each
    (``group_episodes``: a rollout, or all the branches of a multi-branch episode), as live generation makes them:
    a batch of branching episodes holds more rollouts than ``rollouts_per_step``.

    Advantages are computed within a group, over its episodes, so neither a group nor an episode is ever split
    between two batches. The last batch may be smaller; it is kept, not dropped.
    """
    batches: list[list[Rollout]] = []
    current: list[Rollout] = []
    episodes = 0  # in ``current``
    for members in group_by_id(rollouts):
        group_id = members[0].group_id
        size = len(group_episodes(members))
        of = f"{size} episodes" if size == len(members) else f"{size} episodes in {len(members)} rollouts"
        if size > rollouts_per_step:
            raise RolloutFormatError(
                f"Group {group_id!r} has {of}, more than rollouts_per_step={rollouts_per_step} (which counts "
                "episodes: an episode's branches count once)."
            )
        if episodes + size > rollouts_per_step:
            raise RolloutFormatError(
                f"Group {group_id!r} ({of}) does not fit the {rollouts_per_step - episodes} episodes left in batch "
                f"{len(batches)}: rollouts_per_step ({rollouts_per_step}) must be a sum of whole groups' episodes."
            )
        current.extend(members)
        episodes += size
        if episodes == rollouts_per_step:
            batches.append(current)
            current, episodes = [], 0
    if current:
        logger.warning(
            "The last batch holds %d episodes instead of %d; it is trained on as a smaller batch.",
            episodes,
            rollouts_per_step,
        )
        batches.append(current)
    return batches


def drop_zero_variance_groups(rollouts: list[Rollout], stats: dict[str, float] | None = None,
                              ) -> tuple[list[Rollout], int]:
    """The rollouts of the groups with signal (``has_signal``), in order, and how many groups were dropped; a
    mixture's dropped groups are counted per environment in ``stats`` (``count_by_environment``)."""
    groups = group_by_id(rollouts)
    kept = [group for group in groups if has_signal(group)]
    if stats is not None:
        count_by_environment(stats, [group for group in groups if not has_signal(group)])
    return [rollout for group in kept for rollout in group], len(groups) - len(kept)


class ReplaySource:
    """Replays a rollouts file (the rollout line format) through the same batching and loss as live generation:
    batches of ``rollouts_per_step`` episodes in whole groups (``split_into_batches``), so a file a live run saved
    replays as the batches it trained.

    With ``filter_groups`` (DAPO's dynamic sampling) each batch keeps only its groups with reward variance; there is
    nothing to refill from, so a batch loses them (and one without any is trained unfiltered, with a warning).
    """

    def __init__(self, path: str | Path, rollouts_per_step: int, filter_groups: bool = False):
        self.path = Path(path)
        self.batches = split_into_batches(read_rollouts(self.path), rollouts_per_step)
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()  # a resumed run checks it is the same file
        self.filter_groups = filter_groups

    def __len__(self) -> int:
        return len(self.batches)

    def batch(self, index: int) -> Batch:
        rollouts = self.batches[index % len(self.batches)]
        if not self.filter_groups:
            return Batch(index, rollouts)
        stats: dict[str, float] = {}
        kept, dropped = drop_zero_variance_groups(rollouts, stats)
        if not kept:
            logger.warning("Batch %d: no group has reward variance; training on it unfiltered.", index)
        stats.update(groups_kept=float(len({r.group_id for r in kept})), groups_dropped=float(dropped))
        return Batch(index, kept or rollouts, stats)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close ``loop`` after ending the tasks engines may leave behind (a batching queue's drain)."""
    leftovers = asyncio.all_tasks(loop)
    for task in leftovers:
        task.cancel()
    if leftovers:
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
    loop.close()


class GenerationTimeout(GenerationError):
    """No batch arrived in time: the engine or an environment is stuck."""


class PositionDraws:
    """Which dataset row the group at each position of the run samples (position p: the p-th group drawn): the
    environment's own draw where it has one (a mixture draws its entries by weight), else the rows in a seeded
    shuffle per epoch. A function of the position and the seed alone, so batch-at-a-time and continuous generation
    draw the same rows, and a resumed run draws what the uninterrupted one drew."""

    def __init__(self, environment, size: int, seed: int, shuffle: bool):
        self.draw_rows = getattr(environment, "draw_rows", None)
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self._order: list[int] = []  # the epochs' orders one after another, as far as drawn

    def rows_at(self, positions: list[int]) -> list[int]:
        """The row index of each of ``positions``."""
        if self.draw_rows is not None:
            return list(self.draw_rows(positions, self.seed, self.shuffle))
        while len(self._order) <= max(positions, default=-1):
            self._order.extend(epoch_order(self.size, len(self._order) // self.size, self.seed, self.shuffle))
        return [self._order[position] for position in positions]


class GeneratorThread:
    """The generator thread's life, the same in both modes: ``start`` runs ``self._run`` on a daemon thread; ``close``
    sets ``self._stop``, wakes whoever waits on ``self._condition``, cancels ``self._task`` on ``self._loop`` and
    joins the thread (at most ``timeout_s``)."""

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="verifiers_rl-generator", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop generating: cancel what is in progress and join the thread."""
        self._stop.set()
        with self._condition:
            self._condition.notify_all()
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(task.cancel)
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                logger.warning("The generator thread did not stop within %.0f s (a generate call is still running).",
                               timeout_s)
            self._thread = None


class AsyncGenerator(GeneratorThread):
    """Produces batches of rollouts ``max_off_policy_steps`` (k) batches ahead, on a thread of the main process.

    The schedule is exact: batch b is generated by policy version ``required_version(b) = max(0, b - k) * m``
    (m = ``steps_per_batch``, the optimizer steps each batch trains), no newer and no older. The generator waits
    for that version before it starts batch b, and a weight load to version v waits until every batch that needs
    an older version is generated. Each group samples with a seed derived from the run's
    seed and its position in the run (``RolloutSampling``), so a batch is a function of the seed and the weights
    alone: a resumed run regenerates exactly what the uninterrupted run generated. k = 0 is synchronous, on the
    caller's thread. A batch is generated under one lock, which ``hold_weights`` takes too, so a weight load never
    lands in the middle of a batch. (``wait_for_older_batches(v)`` is the trainer's wait before a load.)
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
        steps_per_batch: int = 1,
        filter_groups: bool = False,
        max_refill_batches: int = 3,
        max_rollout_retries: int = 2,
        max_failed_rollouts_fraction: float = 0.0,
        shuffle: bool = True,
        curriculum=None,
    ):
        # rollouts_per_step % num_generations == 0 and max_off_policy_steps >= 0 are RLConfig's rules.
        self.prompts_per_batch = rollouts_per_step // num_generations
        rows = dataset_rows(environment, self.prompts_per_batch)
        self.environment = environment
        self.engine = engine
        self.rows = rows
        self.num_generations = num_generations
        self.max_off_policy_steps = max_off_policy_steps
        self.steps_per_batch = steps_per_batch
        self.filter_groups = filter_groups
        self.max_refill_batches = max_refill_batches
        self.max_rollout_retries = max_rollout_retries
        self.max_failed_rollouts_fraction = max_failed_rollouts_fraction
        # batch index -> its counts: groups kept / dropped by the filter, refill rounds, failed rollouts
        self._stats: dict[int, dict[str, float]] = {}
        self.groups = GroupRollouts(environment, engine, rows, num_generations, self.prompts_per_batch, seed,
                                    max_refill_batches, max_rollout_retries, max_failed_rollouts_fraction)
        self.timeout_s = timeout_s
        self.seed = seed
        self.shuffle = shuffle  # False: the dataset's order, epoch after epoch (TRL's shuffle_dataset)
        self.total_batches: int | None = None  # batches the run will train on; none is generated beyond them
        self._ready: dict[int, list[Rollout]] = {}
        self._next_index = 0  # the next batch to generate; every batch before it is generated
        self._generation_s: dict[int, float] = {}  # batch index -> seconds its generation took
        self._error: BaseException | None = None
        self._condition = threading.Condition()
        self._batch_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.draws = PositionDraws(environment, len(rows), seed, shuffle)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        # rollouts/curriculum.py: the state after every generated batch; a batch works on a copy (its draft), which
        # replaces it when the batch is published, so a checkpoint sees the state of exactly its pending batches.
        self.curriculum = curriculum
        self._drafts: dict[int, object] = {}

    def __len__(self) -> int:
        return max(len(self.rows) // self.prompts_per_batch, 1)

    def required_version(self, index: int) -> int:
        """The policy version that generates batch ``index``."""
        return max(0, index - self.max_off_policy_steps) * self.steps_per_batch

    # --- the trainer's side -------------------------------------------------------------------------------------

    def batch(self, index: int) -> Batch:
        """Batch ``index``; waits at most ``timeout_s``; re-raises what went wrong in generation.

        With k = 0 there is nothing to run ahead: the batch is generated here, on the caller's thread.
        """
        if self.max_off_policy_steps == 0 and index not in self._ready:
            rollouts = self._generate_here(index)
        else:
            self.start()
            with self._condition:
                self._wait(lambda: index in self._ready, index)
                rollouts = self._ready.pop(index)
        return Batch(index, rollouts, self._stats.pop(index, {}), self._generation_s.pop(index, None))

    def _wait(self, done, index: int) -> None:
        """Wait (holding the condition) until ``done()``, the generator's error, or ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if self._error is not None:
                raise generation_failed(self._error)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(index)
            self._condition.wait(timeout=min(remaining, 1.0))

    def _generate_here(self, index: int) -> list[Rollout]:
        started = time.perf_counter()
        try:
            with self._batch_lock:  # on a thread of its own: a hanging synchronous reward cannot stop the bound
                rollouts = run_watched(lambda progress: self._generate(index), self.timeout_s,
                                       lambda: self._timeout(index), name="verifiers_rl-generate")
        except Exception as error:  # a GenerationTimeout stays itself
            raise generation_failed(error)
        self._generation_s[index] = time.perf_counter() - started
        self._next_index = max(self._next_index, index + 1)
        self._publish_curriculum(index)
        return rollouts

    def _publish_curriculum(self, index: int) -> None:
        if index in self._drafts:
            self.curriculum = self._drafts.pop(index)

    def _timeout(self, index: int) -> GenerationTimeout:
        return GenerationTimeout(
            f"No rollouts for batch {index} within {self.timeout_s:.0f} s (engine policy version "
            f"{self.engine.policy_version}); the engine or an environment is stuck (--generation_timeout_s sets this "
            "bound)."
        )

    def wait_for_older_batches(self, version: int) -> None:
        """Before a weight load to ``version``: wait until every batch that an older version generates is done (the
        exact schedule). Raises what went wrong in generation, or ``GenerationTimeout``."""
        last = self.max_off_policy_steps + math.ceil(version / self.steps_per_batch) - 1
        if self.total_batches is not None:
            last = min(last, self.total_batches - 1)
        # Only what the engine's weights can generate: equal to ``last`` in a run, less where a resumed one goes past
        # the checkpointed run's last batch (nothing older than the checkpoint's weights is left to generate it).
        last = min(last, self.max_off_policy_steps + self.engine.policy_version // self.steps_per_batch)
        if self.max_off_policy_steps == 0 or last < self._next_index:
            return
        self.start()
        with self._condition:
            self._wait(lambda: self._next_index > last or self._stop.is_set(), last)

    def hold_weights(self):
        """Context manager for a weight load: waits for the batch in progress, blocks the next one."""
        return self._batch_lock

    def weights_updated(self) -> None:
        with self._condition:
            self._condition.notify_all()

    # --- checkpoints --------------------------------------------------------------------------------------------

    def pending(self) -> dict[int, list[Rollout]]:
        """The batches generated and not yet handed out, by index (a checkpoint keeps them: they were sampled by
        weights older than the checkpoint's)."""
        with self._condition:
            return {index: list(rollouts) for index, rollouts in sorted(self._ready.items())}

    def snapshot(self) -> tuple[dict[int, list[Rollout]], dict | None, dict[int, dict[str, float]]]:
        """``pending()``, the curriculum's state after those batches (None without one) and their generation counts
        (``Batch.stats``, by index), taken together."""
        with self._condition:
            pending = self.pending()
            curriculum = None if self.curriculum is None else self.curriculum.to_json()
            return pending, curriculum, {index: dict(self._stats.get(index, {})) for index in pending}

    def restore(self, next_batch: int, pending: dict[int, list[Rollout]], curriculum: dict | None = None,
                where: str = "the checkpoint", stats: dict[int, dict[str, float]] | None = None) -> None:
        """Continue a run whose next batch to train is ``next_batch`` with the ``pending`` batches it had generated
        ahead, their generation counts (``stats``, logged as they are trained) and its ``curriculum`` state after
        them (before ``start``)."""
        if curriculum is not None:
            self.curriculum.load_json(curriculum, where)
        if self._thread is not None:
            raise RuntimeError("restore() must come before the generator starts.")
        expected = list(range(next_batch, next_batch + len(pending)))
        if sorted(pending) != expected:
            raise ValueError(f"Pending batches {sorted(pending)} do not follow batch {next_batch} without gaps.")
        self._ready = dict(pending)
        self._stats.update({index: dict(counts) for index, counts in (stats or {}).items() if index in pending})
        self._next_index = next_batch + len(pending)

    # --- the generator thread -----------------------------------------------------------------------------------

    def _rows_of(self, index: int) -> list[tuple[int, int]]:
        positions = [index * self.prompts_per_batch + k for k in range(self.prompts_per_batch)]
        return list(zip(positions, self.draws.rows_at(positions)))

    def _wait_for_version(self, index: int) -> bool:
        needed = self.required_version(index)
        with self._condition:
            while not self._stop.is_set() and (
                self.engine.policy_version < needed or (self.total_batches is not None and index >= self.total_batches)
            ):
                self._condition.wait(timeout=0.5)
        return not self._stop.is_set()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            while self._wait_for_version(self._next_index):
                index = self._next_index
                with self._batch_lock:
                    started = time.perf_counter()
                    self._task = self._loop.create_task(self._generate(index))
                    rollouts = self._loop.run_until_complete(self._task)
                with self._condition:
                    self._ready[index] = rollouts
                    self._generation_s[index] = time.perf_counter() - started
                    self._next_index = index + 1
                    self._publish_curriculum(index)
                    self._condition.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it on every rank
            with self._condition:
                self._error = error
                self._condition.notify_all()
        finally:
            self._task = None
            _close_loop(self._loop)

    async def _generate(self, index: int) -> list[Rollout]:
        version = self.engine.policy_version
        draft = None if self.curriculum is None else self.curriculum.copy()
        if draft is None:
            rows = self._rows_of(index)
        else:
            rows = draft.draw([index * self.prompts_per_batch + k for k in range(self.prompts_per_batch)])
        picks = [(f"b{index}-p{position}", self.rows[row], derive_seed(self.seed, "train", position))
                 for position, row in rows]
        stats = self._stats.setdefault(index, {})
        record = None if draft is None else draft.record_group
        groups = await self.groups.of(picks, stats, index, on_group=record)
        if self.filter_groups:
            groups = await self.groups.keep_with_signal(index, groups, stats, curriculum=draft)
        if draft is not None:
            stats.update(draft.metrics())
            self._drafts = {index: draft}  # kept when the batch is published (an abandoned batch's is dropped)
        rollouts = [rollout for group in groups for rollout in group]
        for rollout in rollouts:
            rollout.policy_version = version
            if rollout.completion_versions is None:  # batch at a time: every sampled token is the batch's version
                rollout.completion_versions = [version if m else NOT_SAMPLED for m in rollout.completion_mask]
        return rollouts


def make_source(args, given: RolloutSource | None, environment, engine) -> RolloutSource:
    """The run's rollout source (main process): live generation from ``environment`` through ``engine`` as ``args``
    (an ``RLConfig``) says (batch at a time, or continuous with ``--groups_in_flight``), ``given``, or a replay of
    ``args.rollouts_path``."""
    filter_groups = args.filter_groups == "zero_variance"
    if environment is None:
        if given is not None and settings_from(args, CurriculumSettings).active:
            raise ValueError("--curriculum_easy_above / --curriculum_hard_below steer live generation from an "
                             "environment; a rollout_source generates nothing to steer. Leave them unset.")
        if given is not None and args.groups_in_flight:
            raise ValueError(f"--groups_in_flight {args.groups_in_flight} sets how live generation from an environment "
                             "runs; a rollout_source makes its own batches. Leave it 0.")
        return given or ReplaySource(args.rollouts_path, args.rollouts_per_step, filter_groups=filter_groups)
    if engine is None:
        raise ValueError("Generating from an environment needs an inference engine on the main process.")
    curriculum = build_curriculum(args, environment, list(environment.dataset))  # refuses tuning without a threshold
    if args.groups_in_flight:  # RLConfig refused what continuous generation does not combine with
        from verifiers_rl.rollouts.continuous import ContinuousGenerator  # it builds on this module

        if curriculum is not None:  # the flags' thresholds are refused by RLConfig: a mixture entry's set it
            raise ValueError(f"--groups_in_flight {args.groups_in_flight} (continuous generation) does not combine "
                             "with a curriculum (--env entries' curriculum: thresholds): its per-batch state assumes "
                             "batches generated as a unit. Use --groups_in_flight 0 (batch at a time) for it.")

        return ContinuousGenerator(
            environment, engine, rollouts_per_step=args.rollouts_per_step, num_generations=args.num_generations,
            groups_in_flight=args.groups_in_flight, max_off_policy_steps=args.max_off_policy_steps,
            timeout_s=args.generation_timeout_s, seed=args.seed, steps_per_batch=args.num_iterations,
            max_rollout_retries=args.max_rollout_retries,
            max_failed_rollouts_fraction=args.max_failed_rollouts_fraction, shuffle=args.shuffle_dataset,
        )
    return AsyncGenerator(
        environment, engine, rollouts_per_step=args.rollouts_per_step, num_generations=args.num_generations,
        max_off_policy_steps=args.max_off_policy_steps, timeout_s=args.generation_timeout_s, seed=args.seed,
        steps_per_batch=args.num_iterations, filter_groups=filter_groups, max_refill_batches=args.max_refill_batches,
        max_rollout_retries=args.max_rollout_retries, max_failed_rollouts_fraction=args.max_failed_rollouts_fraction,
        shuffle=args.shuffle_dataset, curriculum=curriculum,
    )
