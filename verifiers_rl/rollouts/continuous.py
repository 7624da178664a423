"""Continuous generation (``--groups_in_flight N``): groups are generated one by one, up to N at once, and a batch is
made of finished whole groups, so a long episode holds up its own group and, at most, the batch of its deadline.

Positions are drawn in the order and with the seeds of batch-at-a-time generation (position p: the row
``PositionDraws`` gives, seed ``derive_seed(seed, "train", p)``), but a batch holds finished groups, the earliest
due first, and weights are loaded while groups are in flight (the engine orders a load between its decode steps), so
a group's tokens may come from several policy versions (``Rollout.completion_versions``). Staleness is bounded as
in the exact schedule: batch b trains only groups whose oldest sampled token is from version
``required_version(b)`` or newer. A group started with the engine at version v is therefore due by batch
``v // m + k`` (its deadline; m = ``steps_per_batch``, k = ``max_off_policy_steps``), and the scheduler never lets
it miss it: a group starts only while every batch up to its deadline has room for the groups due by then (as many as
batch-at-a-time keeps in flight), and a batch takes the finished groups with the earliest deadlines, waiting only
while a group still running is due by a batch that taking later-due groups now would overfill. A long group thus
slides to a later batch, up to its deadline, instead of being dropped (dropping it would bias training against long
episodes; its next try would be as long). A group older than its batch's bound all the same (a resumed checkpoint's)
is dropped, counted (``groups_stale_dropped``) and its position generated again under a new seed (derived from the
retry count). What is exact and what is not across a resume: docs/durability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from verifiers_rl.core.rollout import NOT_SAMPLED, Rollout, group_by_id
from verifiers_rl.core.sampling import derive_seed
from verifiers_rl.rollouts.generator import (Batch, GenerationTimeout, GeneratorThread, PositionDraws, _close_loop,
                                             dataset_rows)
from verifiers_rl.rollouts.groups import (GenerationError, GroupRollouts, dropped_how, generation_failed,
                                          is_refill_group_id)

logger = logging.getLogger("verifiers_rl.rollouts.generator")  # the generator's log, as batch at a time


@dataclass
class InFlight:
    """A group being generated: its attempt (``retry``) and the last batch it may join (``deadline``)."""

    retry: int
    deadline: int


@dataclass
class FinishedGroup:
    """A generated group waiting for its batch: its rollouts, and when it started and finished (None: restored from
    a checkpoint)."""

    rollouts: list[Rollout]
    deadline: int  # the last batch it may join (``ContinuousGenerator.deadline``)
    failures: int = 0  # failed attempts before it was generated (``rollouts_failed``)
    started: float | None = None
    finished: float | None = None

    def oldest_version(self) -> int:
        """Its oldest sampled token's version (0 where a restored record says none: as old as can be)."""
        return min((v for v in (r.oldest_version() for r in self.rollouts) if v is not None), default=0)


def group_id_of(position: int, retry: int) -> str:
    """A group's id: its position, and how many times it was generated again after being dropped as stale."""
    return f"p{position}" if retry == 0 else f"p{position}-retry{retry}"


def group_seed(seed: int, position: int, retry: int) -> int:
    """The seed of position ``position``'s ``retry``-th generation: batch-at-a-time's at first, then new draws."""
    return derive_seed(seed, "train", position) if retry == 0 else derive_seed(seed, "train", position, "stale", retry)


def stamp_versions(rollouts: list[Rollout], version: int) -> None:
    """Where the environment recorded no per-token versions: every sampled token gets ``version``, the policy's when
    the group started (the oldest it can have been sampled by, so staleness is never under-counted)."""
    for rollout in rollouts:
        if rollout.completion_versions is None:
            rollout.completion_versions = [version if m else NOT_SAMPLED for m in rollout.completion_mask]
        if rollout.policy_version is None:  # the oldest token's (a rollout's staleness is its oldest token's)
            rollout.policy_version = version if rollout.oldest_version() is None else rollout.oldest_version()


def staleness_stats(rollouts: list[Rollout], trained_version: int, bound: int) -> dict[str, float]:
    """Per sampled token, the optimizer steps between the version that sampled it and ``trained_version``: mean,
    max and the fraction at each staleness 0..``bound`` (``staleness/token_*``)."""
    ages = [trained_version - v for r in rollouts for v, m in zip(r.completion_versions or (), r.completion_mask)
            if m and v != NOT_SAMPLED]
    counts = Counter(ages)
    stats = {f"staleness/token_fraction_{age}": counts[age] / max(len(ages), 1)
             for age in sorted(set(range(bound + 1)) | set(counts))}
    if ages:
        stats.update({"staleness/token_mean": sum(ages) / len(ages), "staleness/token_max": float(max(ages))})
    return stats


def stop_reason(size: int, fraction: float, dropped_positions: set[int]) -> str | None:
    """Why groups dropped on errors stop the run (None: they do not), judged as batch at a time judges a batch, on the
    ``size`` positions it would draw together (position p in block p // size): every group of a block dropped, or more
    than ``fraction`` x ``size`` of them. Not on the drops since the last batch: with many groups in flight, those
    that fail at once outnumber a batch while the good ones are still sampling."""
    for block, dropped in sorted(Counter(p // size for p in dropped_positions).items()):
        first = block * size
        where = f"positions {first}-{first + size - 1} (the {size} a batch draws together)"
        if dropped == size:
            return (f"among them every group of {where}: none of them is left, which stops the run whatever "
                    "--max_failed_rollouts_fraction allows")
        if dropped > fraction * size:
            return f"among them {dropped} of the {size} groups of {where}, more than --max_failed_rollouts_fraction " \
                   f"{fraction:g} of them"
    return None


class ContinuousGenerator(GeneratorThread):
    """Keeps up to ``groups_in_flight`` groups in flight as asyncio tasks on its own thread and hands out batches of
    ``prompts_per_batch`` finished groups (the rollout-source interface of ``AsyncGenerator``).

    Never more than k = ``max_off_policy_steps`` batches ahead: with the engine at version v, groups are started
    only while the groups handed out, waiting and in flight number fewer than (v // m + k + 1) batches' worth (m =
    ``steps_per_batch``), since a group started at v fits no batch after v // m + k. ``hold_weights`` holds nothing
    and ``wait_for_older_batches`` returns at once: a weight load does not wait for a batch. A checkpoint keeps the
    finished groups not yet trained (``pending``) and the positions in flight, generated again on resume.
    """

    def __init__(self, environment, engine, rollouts_per_step: int, num_generations: int, groups_in_flight: int,
                 max_off_policy_steps: int = 1, timeout_s: float = 600.0, seed: int = 0, steps_per_batch: int = 1,
                 max_rollout_retries: int = 2, max_failed_rollouts_fraction: float = 0.0, shuffle: bool = True):
        if groups_in_flight < 1 or max_off_policy_steps < 1:
            raise ValueError(f"Continuous generation needs --groups_in_flight >= 1 and --max_off_policy_steps >= 1 "
                             f"(groups are generated while the trainer trains), got {groups_in_flight} and "
                             f"{max_off_policy_steps}.")
        self.prompts_per_batch = rollouts_per_step // num_generations
        rows = dataset_rows(environment, self.prompts_per_batch)
        self.environment, self.engine, self.rows = environment, engine, rows
        self.num_generations = num_generations
        self.groups_in_flight = groups_in_flight
        self.max_off_policy_steps = max_off_policy_steps
        self.steps_per_batch = steps_per_batch
        self.timeout_s, self.seed = timeout_s, seed
        self.max_failed_rollouts_fraction = max_failed_rollouts_fraction
        self.max_rollout_retries = max_rollout_retries
        self.draws = PositionDraws(environment, len(rows), seed, shuffle)
        self.groups = GroupRollouts(environment, engine, rows, num_generations, self.prompts_per_batch, seed, 0,
                                    max_rollout_retries, max_failed_rollouts_fraction)
        self.curriculum = None  # refused in this mode (RLConfig)
        self.total_batches: int | None = None  # batches the run will train on; no group is started beyond them
        self._condition = threading.Condition()  # guards everything below that both threads touch
        self._finished: list[FinishedGroup] = []  # in the order they finished
        self._in_flight: dict[int, InFlight] = {}  # by position, started
        self._redo: list[tuple[int, int]] = []  # (position, retry) to start first: stale drops, restored positions
        self._next_position = 0
        self._handed = 0  # batches handed out
        self._counts: dict[str, float] = {}  # since the last batch: stale drops, failed attempts, groups dropped
        self._errors: list[Exception] = []  # of the groups dropped since the last batch
        self._dropped_positions: set[int] = set()  # positions whose group was dropped on errors, over the run
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    def __len__(self) -> int:
        return max(len(self.rows) // self.prompts_per_batch, 1)

    def required_version(self, index: int) -> int:
        """The oldest policy version batch ``index`` may train a token of."""
        return max(0, index - self.max_off_policy_steps) * self.steps_per_batch

    def deadline(self, version: int) -> int:
        """The last batch a group sampled from version ``version`` on may join: b <= version // m + k, the inverse of
        ``required_version``."""
        return version // self.steps_per_batch + self.max_off_policy_steps

    # --- the trainer's side -------------------------------------------------------------------------------------

    def batch(self, index: int) -> Batch:
        """Batch ``index`` (batches are handed out in order): ``prompts_per_batch`` finished groups, the earliest due
        first (``_choose``); waits at most ``timeout_s``; re-raises what went wrong in generation."""
        if index != self._handed:
            raise ValueError(f"Continuous generation hands out batches in order: batch {self._handed} is next, "
                             f"batch {index} was asked for.")
        self.start()
        deadline = time.monotonic() + self.timeout_s
        with self._condition:
            while True:
                self._drop_stale(index)
                self._check_failures(index)
                taken = self._choose(index)
                if taken is not None:
                    break
                if self._error is not None:
                    raise generation_failed(self._error)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise GenerationTimeout(
                        f"No rollouts for batch {index} within {self.timeout_s:.0f} s ({self._waiting_for(index)}; "
                        f"engine policy version {self.engine.policy_version}); the engine or an environment is "
                        "stuck (--generation_timeout_s sets this bound).")
                self._condition.wait(timeout=min(remaining, 1.0))
            chosen = {id(group) for group in taken}
            self._finished = [group for group in self._finished if id(group) not in chosen]
            stats = {name: self._counts.get(name, 0.0)
                     for name in ("groups_stale_dropped", "rollouts_failed", "groups_dropped_on_error")}
            stats["rollouts_failed"] += sum(group.failures for group in taken)
            stats["groups_in_flight"] = float(len(self._in_flight))
            self._counts, self._errors = {}, []
            self._handed += 1
        self._wake_loop()
        rollouts = [rollout for group in taken for rollout in group.rollouts]
        stats.update(staleness_stats(rollouts, index * self.steps_per_batch,
                                     self.max_off_policy_steps * self.steps_per_batch))
        times = [(group.started, group.finished) for group in taken]
        generation_s = (None if any(t is None for pair in times for t in pair)
                        else max(end for _, end in times) - min(start for start, _ in times))
        return Batch(index, rollouts, stats, generation_s)

    def _waiting_for(self, index: int) -> str:
        """(Holding the condition.) What batch ``index`` waits for, in words: too few finished groups, or (enough
        finished) the groups in flight due by it."""
        finished, size = len(self._finished), self.prompts_per_batch
        flying, due = len(self._in_flight), sum(flight.deadline <= index for flight in self._in_flight.values())
        if finished < size:
            return f"{finished} of the {size} groups it takes finished, {flying} in flight, {due} of them due by it"
        return (f"{finished} groups finished (it takes {size}), but {due} of the {flying} in flight are due by this "
                "batch, which waits for them")

    def _choose(self, index: int) -> list[FinishedGroup] | None:
        """(Holding the condition.) Batch ``index``'s groups: the ``prompts_per_batch`` finished ones with the
        earliest deadlines (then in the order they finished), or None to wait. With G groups a batch and U(b) the
        groups not yet handed out (finished or in flight) due by batch b, batches index..b hold (b - index + 1) G:
        taking a group due after b is allowed only while the groups due by b still fit the batches after this one,
        i.e. the taken groups due after b number at most (b - index + 1) G - U(b). Where no running group is due by
        such a b, waiting cannot help (a resumed checkpoint's groups): the batch is taken, and a group that misses its
        deadline is dropped as stale."""
        size = self.prompts_per_batch
        if len(self._finished) < size:
            return None
        taken = sorted(self._finished, key=lambda group: group.deadline)[:size]  # a stable sort: finish order
        running = [flight.deadline for flight in self._in_flight.values()]
        due = [group.deadline for group in self._finished] + running
        for b in range(index, max(due)):
            later = sum(group.deadline > b for group in taken)
            if later > (b - index + 1) * size - sum(d <= b for d in due) and any(
                    d <= b for d in running):
                return None
        return taken

    def _drop_stale(self, index: int) -> None:
        """(Holding the condition.) Drop the waiting groups older than batch ``index``'s bound; their positions are
        generated again under new seeds."""
        bound = self.required_version(index)
        stale = [group for group in self._finished if group.oldest_version() < bound]
        if not stale:
            return
        self._finished = [group for group in self._finished if group.oldest_version() >= bound]
        for group in stale:
            place = position_of(group.rollouts[0].group_id)
            if place is not None:  # a refill group has no position: a new position takes its place (``_to_start``)
                self._redo.append((place[0], place[1] + 1))
        self._counts["groups_stale_dropped"] = self._counts.get("groups_stale_dropped", 0.0) + len(stale)
        logger.info("Batch %d: %d group(s) older than policy version %d dropped, generated again.", index, len(stale),
                    bound)
        self._wake_loop()

    def _check_failures(self, index: int) -> None:
        """(Holding the condition.) Stop with the last error where the groups dropped on errors say so
        (``stop_reason``)."""
        dropped = int(self._counts.get("groups_dropped_on_error", 0))
        why = stop_reason(self.prompts_per_batch, self.max_failed_rollouts_fraction, self._dropped_positions)
        if why is not None:
            if not self._errors:  # every drop came before the resume: their errors were not kept
                raise GenerationError(f"Batch {index}: {dropped} groups dropped on errors before the resume, {why}.")
            how = dropped_how(self._errors, self.max_rollout_retries)
            raise GenerationError(f"Batch {index}: {dropped} groups {how}, {why}. Last error: {self._errors[-1]}"
                                  ) from self._errors[-1]

    def wait_for_older_batches(self, version: int) -> None:
        """Nothing to wait for: weights are loaded while groups are in flight."""

    def hold_weights(self):
        """A context that holds nothing: a load does not wait for a batch (the engine orders it between decode
        steps)."""
        return contextlib.nullcontext()

    def weights_updated(self) -> None:
        """A newer version may start more groups."""
        with self._condition:
            self._condition.notify_all()
        self._wake_loop()

    # --- checkpoints --------------------------------------------------------------------------------------------

    def checkpoint_state(self) -> tuple[dict[int, list[Rollout]], None, dict]:
        """Taken together: the finished groups not yet handed out (as one pending batch, the next one's index), no
        curriculum, and the positions: the next to draw and those in flight with their retry counts, and the drops
        (counts since the last batch, positions dropped on errors)."""
        with self._condition:
            pending = {self._handed: [r for group in self._finished for r in group.rollouts]} if self._finished else {}
            in_flight = sorted([*((p, flight.retry) for p, flight in self._in_flight.items()), *self._redo])
            # The drops since the last batch are the next batch's counts, and those of the run judge when to stop.
            return pending, None, {"next_position": self._next_position, "in_flight": [list(p) for p in in_flight],
                                   "counts": dict(self._counts), "dropped_positions": sorted(self._dropped_positions)}

    def pending(self) -> dict[int, list[Rollout]]:
        return self.checkpoint_state()[0]

    def restore(self, next_batch: int, pending: dict[int, list[Rollout]], curriculum: dict | None = None,
                where: str = "the checkpoint", positions: dict | None = None) -> None:
        """Continue a run whose next batch is ``next_batch``: the ``pending`` groups wait for their batches, and the
        ``positions`` in flight are generated again under their seeds. A checkpoint of batch-at-a-time generation
        (``positions`` None) continues after its pending batches."""
        if self._thread is not None:
            raise RuntimeError("restore() must come before the generator starts.")
        rollouts = [rollout for index in sorted(pending) for rollout in pending[index]]
        self._finished = [FinishedGroup(members, 0) for members in group_by_id(rollouts)]
        for group in self._finished:
            group.deadline = self.deadline(group.oldest_version())
        self._handed = next_batch
        if positions is None:
            self._next_position = (next_batch + len(pending)) * self.prompts_per_batch
        else:
            self._next_position = int(positions["next_position"])
            self._redo = [(int(p), int(r)) for p, r in positions["in_flight"]]
            self._counts = {name: float(n) for name, n in positions.get("counts", {}).items()}  # older: none kept
            self._dropped_positions = {int(p) for p in positions.get("dropped_positions", [])}

    # --- the generator thread -----------------------------------------------------------------------------------

    def _wake_loop(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._task = self._loop.create_task(self._main())
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it on every rank
            with self._condition:
                self._error = error
                self._condition.notify_all()
        finally:
            self._task = None
            _close_loop(self._loop)

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        while not self._stop.is_set():
            self._wake.clear()
            for position, retry in self._to_start():
                task = asyncio.get_running_loop().create_task(self._roll(position, retry))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.5)

    def _to_start(self) -> list[tuple[int, int]]:
        """The (position, retry) pairs to start now: slots free and within k batches of the engine's version."""
        with self._condition:
            if self._error is not None:
                return []
            limit = (self.engine.policy_version // self.steps_per_batch + self.max_off_policy_steps + 1)
            if self.total_batches is not None:
                limit = min(limit, self.total_batches)
            alive = self._handed * self.prompts_per_batch + len(self._finished) + len(self._in_flight) + len(self._redo)
            starts = []
            while len(self._in_flight) < self.groups_in_flight and (
                    self._redo or alive < limit * self.prompts_per_batch):
                if self._redo:
                    position, retry = self._redo.pop(0)
                else:
                    position, retry = self._next_position, 0
                    self._next_position += 1
                    alive += 1
                self._in_flight[position] = InFlight(retry, self.deadline(self.engine.policy_version))
                starts.append((position, retry))
            return starts

    async def _roll(self, position: int, retry: int) -> None:
        """Generate one group and queue it (or count it dropped); an error no retry mends stops the generator."""
        version, started = self.engine.policy_version, time.perf_counter()
        try:
            row = self.rows[self.draws.rows_at([position])[0]]
            group, failures, error = await self.groups.attempt(row, group_id_of(position, retry),
                                                               group_seed(self.seed, position, retry))
        except asyncio.CancelledError:
            raise
        except BaseException as failure:  # noqa: BLE001 - raised where the trainer waits for a batch
            with self._condition:
                self._error = failure
                self._condition.notify_all()
            return
        with self._condition:
            flight = self._in_flight.pop(position, None)
            deadline = self.deadline(version) if flight is None else flight.deadline
            if group is None:
                self._counts["groups_dropped_on_error"] = self._counts.get("groups_dropped_on_error", 0.0) + 1
                self._counts["rollouts_failed"] = self._counts.get("rollouts_failed", 0.0) + failures
                self._errors.append(error)
                self._dropped_positions.add(position)
            else:
                stamp_versions(group, version)
                self._finished.append(FinishedGroup(group, deadline, failures, started, time.perf_counter()))
            self._condition.notify_all()
        self._wake.set()


def position_of(group_id: str) -> tuple[int, int] | None:
    """(position, retry) of a continuous group's id (``group_id_of``), or of a batch-at-a-time one (``b<i>-p<p>``,
    retry 0); None for a batch-at-a-time refill group (``b<i>-r<round>-<j>``, dynamic sampling's: a batch-at-a-time
    checkpoint's pending batches may hold one), which stands for no position."""
    if is_refill_group_id(group_id):
        return None
    text = str(group_id)
    retry = 0
    if "-retry" in text:
        text, retry_text = text.rsplit("-retry", 1)
        retry = int(retry_text)
    return int(text.rsplit("p", 1)[1]), retry
