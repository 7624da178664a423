"""One batch's groups: a group per picked row, failed groups retried under the same seeds, refusals dropped at once,
and DAPO's dynamic sampling (groups without reward variance replaced by more, drawn by a seeded shuffle)."""

from __future__ import annotations

import asyncio
import logging
import re

from verifiers_rl.core.rollout import Rollout
from verifiers_rl.core.sampling import derive_seed, refill_sample
from verifiers_rl.envs.rubric import ERRORS_METRIC
from verifiers_rl.envs.environment import RolloutError, RolloutRefused

logger = logging.getLogger("verifiers_rl.rollouts.generator")  # the generator's log, as before the split


def refill_group_id(index: int, rounds: int, j: int) -> str:
    """The id of dynamic sampling's ``j``-th refill group of batch ``index``, round ``rounds`` (no position)."""
    return f"b{index}-r{rounds}-{j}"


def is_refill_group_id(group_id: str) -> bool:
    """Whether ``group_id`` is a refill group's (``refill_group_id``)."""
    return re.fullmatch(r"b\d+-r\d+-\d+", str(group_id)) is not None


class GenerationError(RuntimeError):
    """Generation, an environment or a reward function failed; raised where the trainer waits for a batch."""


def generation_failed(error: BaseException) -> GenerationError:
    """``error`` as what the trainer raises: itself when it is a GenerationError already (it says which batch and
    why), else one that names it."""
    if isinstance(error, GenerationError):
        return error
    failed = GenerationError(f"Generation failed: {type(error).__name__}: {error}")
    failed.__cause__ = error
    return failed


def has_signal(group: list[Rollout]) -> bool:
    """Whether a group's rewards differ: a group of equal rewards has advantage 0 under every reward scaling, so it
    adds nothing to the gradient (only compute)."""
    return len({rollout.reward for rollout in group}) > 1


def _server_lost(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) says the inference server is gone for good (``VLLMEngine`` waited
    ``reconnect_timeout_s`` for it): retrying the rollout would only wait again."""
    seen = set()
    while error is not None and id(error) not in seen:
        if getattr(error, "server_lost", False):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


# Errors of the environment's code: a retry runs the same code on the same seeds, so it would raise them again.
CODE_ERRORS = (TypeError, AttributeError, NameError, NotImplementedError, ImportError)


def not_retried(error: BaseException | None) -> str | None:
    """Why a failed group is dropped at once (None: it is retried): a refusal, or an error of the environment's code
    (what a ``RolloutError`` says it was caused by)."""
    if isinstance(error, RolloutRefused):
        return "were refused (not retried: the same seeds would refuse them again)"
    if isinstance(error, RolloutError) and isinstance(error.__cause__, CODE_ERRORS):
        return (f"raised {type(error.__cause__).__name__} in the environment's code (not retried: the same seeds "
                "would raise it again)")
    return None


def dropped_how(errors: list[BaseException], max_rollout_retries: int) -> str:
    """How the groups whose last errors are ``errors`` came to be dropped: "failed 3 time(s) each", "were refused
    ...", or each kind with its count."""
    retried = f"failed {max_rollout_retries + 1} time(s) each (--max_rollout_retries {max_rollout_retries})"
    kinds: dict[str, int] = {}
    for error in errors:
        kind = not_retried(error) or retried
        kinds[kind] = kinds.get(kind, 0) + 1
    if len(kinds) == 1:
        return next(iter(kinds))
    return "were dropped: " + "; ".join(f"{n} {kind}" for kind, n in kinds.items())


class GroupRollouts:
    """Rolls out the groups of a batch on ``engine``: ``num_generations`` samples of each picked row.

    Counts (in the ``stats`` dict it is given): ``rollouts_failed`` (failed attempts), ``groups_dropped_on_error``,
    ``reward_errors`` (of every group generated, dynamic sampling's dropped and refill groups included; per mixture
    entry too), and with dynamic sampling ``groups_kept``, ``groups_dropped``, ``refill_generations``.
    """

    def __init__(self, environment, engine, rows: list, num_generations: int, prompts_per_batch: int, seed: int,
                 max_refill_batches: int, max_rollout_retries: int, max_failed_rollouts_fraction: float):
        self.environment = environment
        self.engine = engine
        self.rows = rows
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.seed = seed
        self.max_refill_batches = max_refill_batches
        self.max_rollout_retries = max_rollout_retries
        self.max_failed_rollouts_fraction = max_failed_rollouts_fraction

    async def of(self, picks: list[tuple[str, object, int]], stats: dict[str, float], index: int,
                 on_group=None) -> list[list[Rollout]]:
        """The groups of ``picks``; a group whose rollout raised is generated again (same seeds) up to
        ``max_rollout_retries`` times, then dropped (at once where ``not_retried`` says the same seeds would fail
        again). Counted in the batch's ``rollouts_failed`` (failed attempts) and ``groups_dropped_on_error``; more
        than ``max_failed_rollouts_fraction`` of the groups dropped (or all of them) fails the batch with the last
        error. ``on_group(row, group)`` sees each generated group (a curriculum)."""
        results = await asyncio.gather(*(self.attempt(row, group_id, seed) for group_id, row, seed in picks))
        if on_group is not None:
            for (_, row, _), (group, _, _) in zip(picks, results):
                if group is not None:
                    on_group(row, group)
        groups = [group for group, _, _ in results if group is not None]
        count_reward_errors(stats, groups)  # here, not from the batch: dynamic sampling may drop these groups
        failures = sum(failed for _, failed, _ in results)
        dropped = len(results) - len(groups)
        stats["rollouts_failed"] = stats.get("rollouts_failed", 0.0) + failures
        stats["groups_dropped_on_error"] = stats.get("groups_dropped_on_error", 0.0) + dropped
        if dropped and (not groups or dropped > self.max_failed_rollouts_fraction * len(results)):
            errors = [error for group, _, error in results if group is None]
            # Name the rule that stopped it: with none left, the fraction (up to 1) is not the reason.
            why = ("none of the batch is left, which stops the run whatever --max_failed_rollouts_fraction allows"
                   if not groups else f"more than --max_failed_rollouts_fraction "
                   f"{self.max_failed_rollouts_fraction:g} of the batch")
            raise GenerationError(
                f"Batch {index}: {dropped} of {len(results)} groups {dropped_how(errors, self.max_rollout_retries)}, "
                f"{why}. Last error: {errors[0]}"
            ) from errors[0]
        if dropped:
            logger.warning("Batch %d: dropped %d of %d groups whose rollouts kept failing (%d failed attempts).",
                           index, dropped, len(results), failures)
        return groups

    async def attempt(self, row, group_id: str, seed: int) -> tuple[list[Rollout] | None, int, Exception | None]:
        """One group of ``row``, retried as ``of`` says: (the group or None when dropped, failed attempts, the last
        error). Raises what a retry cannot mend (the inference server is gone)."""
        error = None
        for attempt in range(self.max_rollout_retries + 1):
            try:
                group = await self.environment.rollout_group(self.engine, row, group_id, self.num_generations, seed=seed)
                return group, attempt, None
            except RolloutRefused as refused:  # a function of the seeds, which a retry reuses: it would refuse again
                logger.warning("Group %s refused (not retried: the same seeds would refuse it again): %s", group_id,
                               refused)
                return None, attempt + 1, refused
            except RolloutError as failed:
                if _server_lost(failed):  # not a flaky environment: the engine already waited for its server
                    raise
                why = not_retried(failed)
                if why:
                    logger.warning("Group %s %s: %s", group_id, why.replace("were ", "was ", 1), failed)
                    return None, attempt + 1, failed
                error = failed
                logger.warning("Group %s, attempt %d of %d: %s", group_id, attempt + 1, self.max_rollout_retries + 1,
                               failed)
        return None, self.max_rollout_retries + 1, error

    async def keep_with_signal(self, index: int, groups: list[list[Rollout]], stats: dict[str, float],
                               curriculum=None) -> list[list[Rollout]]:
        """DAPO's dynamic sampling: drop the groups whose rewards are all equal and generate more (rounds of a batch's
        worth of prompts, drawn by a seeded shuffle of the rows, so a resumed run draws the same) until the batch
        holds ``prompts_per_batch`` groups with signal, or ``max_refill_batches`` rounds are spent. Runs under the
        batch lock with the batch's weights: refills are as fresh as the batch. A ``curriculum`` draws the refill rows
        (none set aside) and records every refill group's pass rate."""
        kept = [group for group in groups if has_signal(group)]
        dropped, rounds = len(groups) - len(kept), 0
        count_by_environment(stats, [group for group in groups if not has_signal(group)])
        while len(kept) < self.prompts_per_batch and rounds < self.max_refill_batches:
            rounds += 1
            order = (self._refill_rows(index, rounds) if curriculum is None else
                     curriculum.refill(index, rounds, min(self.prompts_per_batch, len(self.rows))))
            more = await self.of([(refill_group_id(index, rounds, j), self.rows[row],
                                   derive_seed(self.seed, "refill", index, rounds, j)) for j, row in enumerate(order)],
                                 stats, index,
                                 on_group=None if curriculum is None else curriculum.record_group)
            useful = [group for group in more if has_signal(group)]
            dropped += len(more) - len(useful)
            count_by_environment(stats, [group for group in more if not has_signal(group)])
            kept += useful[: self.prompts_per_batch - len(kept)]
        stats.update(
            groups_kept=float(len(kept)), groups_dropped=float(dropped), refill_generations=float(rounds))
        if len(kept) < self.prompts_per_batch:
            logger.warning(
                "Batch %d: %d of %d groups have reward variance after %d refill round(s) (--max_refill_batches); %s.",
                index, len(kept), self.prompts_per_batch, rounds,
                "training on them" if kept else "none has any, so the unfiltered batch is trained (zero advantages)",
            )
        return kept or groups

    def _refill_rows(self, index: int, rounds: int) -> list[int]:
        """A refill round's rows: the environment's own draw where it has one (a mixture's, by weight), else a
        seeded sample of the rows."""
        count = min(self.prompts_per_batch, len(self.rows))
        draw_refill = getattr(self.environment, "draw_refill", None)
        if draw_refill is not None:
            return draw_refill(index, rounds, count, self.seed)
        return refill_sample(range(len(self.rows)), count, self.seed, index, rounds)


def count_by_environment(stats: dict[str, float], dropped: list[list[Rollout]]) -> None:
    """Add the ``dropped`` groups to ``env/<name>/groups_dropped`` (a mixture's entries; rollouts without
    ``env`` are counted only overall)."""
    for group in dropped:
        if group[0].env is not None:
            key = f"env/{group[0].env}/groups_dropped"
            stats[key] = stats.get(key, 0.0) + 1


def count_reward_errors(stats: dict[str, float], groups: list[list[Rollout]]) -> None:
    """Add the reward functions that failed in ``groups``' rollouts to ``reward_errors`` and, for a mixture's entries,
    ``env/<name>/reward_errors``."""
    stats.setdefault("reward_errors", 0.0)
    for rollout in (rollout for group in groups for rollout in group):
        errors = rollout.metrics.get(ERRORS_METRIC, 0.0)
        stats["reward_errors"] += errors
        if rollout.env is not None:
            key = f"env/{rollout.env}/reward_errors"
            stats[key] = stats.get(key, 0.0) + errors
