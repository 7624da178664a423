"""Step batches: which rollouts each optimizer step trains, laid out as this rank's micro-batches.

The main process takes batch ``b`` from the rollout source (a ``generator.Batch``), plans it over ranks
(``batching.plan_batch``) and scatters each rank its ``RankBatch``; that slice is trained ``num_iterations`` times
before the next batch. The position (``batch_index``, ``iteration``, the slice in hand) is what a checkpoint records.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Callable

from verifiers_rl.training.batching import BatchingConfig, RankBatch, plan_batch
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.training.distributed import main_process_outcome
from verifiers_rl.envs.rubric import ERRORS_METRIC
from verifiers_rl.rollouts.generator import RolloutSource, as_batch
from verifiers_rl.training.forward import attends_run_by_run, attention_cost, splits_packed_rows
from verifiers_rl.training.progress import sample_lines
from verifiers_rl.core.rollout import Rollout, append_rollouts, group_episodes, metric_values
from verifiers_rl.core.settings import settings_from

logger = logging.getLogger(__name__)


def batching_config(args: RLConfig, model, world_size: int, pad_token_id: int,
                    reward_functions: tuple[tuple[str, float], ...] = ()) -> BatchingConfig:
    """The run's ``BatchingConfig``: the config's knobs, resolved against the model's attention kernel (a
    flash/varlen kernel splits packed rows by position ids, but cannot take the shared rows' tree mask);
    ``reward_functions``: what normalize_then_sum standardises (``trainer._normalized_reward_functions``)."""
    varlen = splits_packed_rows(model)
    share = args.share_prompt_training
    return settings_from(
        args, BatchingConfig,
        world_size=world_size,
        mode=micro_batching_mode(args.micro_batching, varlen),
        reward_functions=reward_functions,
        pad_token_id=pad_token_id,
        # "on" with a varlen kernel is left as asked: it then fails with the flag's name.
        share_prompt_training="off" if share == "auto" and varlen else share,
        attention_cost=attention_cost(model),
        run_attention=attends_run_by_run(model),
    )


def micro_batching_mode(requested: str, varlen: bool) -> str:
    """``auto`` packs when the attention kernel splits packed rows by position ids (flash/varlen); otherwise a
    packed row's mask is dense over the row, and ``batching.cheapest_layout`` picks per batch by modelled cost."""
    if requested != "auto":
        return requested
    return "packed" if varlen else "auto"


def first_branches(rollouts: list[Rollout]) -> list[Rollout]:
    """One rollout per episode (its first branch, which carries the episode's reward and metrics)."""
    return [episode[0] for episode in group_episodes(rollouts)]


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """A batch's completion lengths, each reward function's values and what reward functions logged, under TRL's
    metric names: ``completions/{mean,min,max}_length`` (sampled tokens: mask 1, as TRL counts with an env mask),
    ``completions/{mean,min,max}_terminated_length`` (of the rollouts not truncated; 0 when none, as TRL's),
    ``rewards/<name>/{mean,std}`` (over the episodes that have the metric, an episode of several branches once;
    std with Bessel's correction, NaN for one episode, as TRL's ``nanstd``) and each ``log_metric`` name (its
    mean)."""
    lengths = [sum(r.completion_mask) for r in rollouts]
    out = length_metrics("completions/{}_length", lengths)
    out.update(length_metrics("completions/{}_terminated_length",
                              [n for n, r in zip(lengths, rollouts) if not r.truncated] or [0]))
    for name, found in metric_values(first_branches(rollouts)).items():
        if name == ERRORS_METRIC:
            continue
        out[f"rewards/{name}/mean"] = statistics.fmean(found)
        # NaN for one value, as TRL's nanstd: no spread is measured (0.0 would read as "every episode agreed").
        out[f"rewards/{name}/std"] = statistics.stdev(found) if len(found) > 1 else math.nan
    out.update({name: statistics.fmean(found) for name, found in metric_values(rollouts, "logged_metrics").items()})
    return out


def environment_metrics(rollouts: list[Rollout], stats: dict[str, float]) -> dict[str, float]:
    """A mixture's batch per environment (``Rollout.env``; nothing for rollouts without one), under
    ``env/<name>/``: ``reward``, ``reward_std`` (over episodes; Bessel's correction, NaN for one, as the overall
    one), ``completions/*_length``, ``completions/clipped_ratio`` (truncated fraction), ``reward_errors`` (the
    source's count in ``stats`` where it has one: every group generated, dynamic sampling's dropped ones too),
    ``rollouts``; and, where dynamic sampling ran (``stats`` holds ``groups_dropped``), ``groups_dropped`` (0 for
    an environment none was dropped of)."""
    out: dict[str, float] = {}
    by_env: dict[str, list[Rollout]] = {}
    for rollout in rollouts:
        if rollout.env is not None:
            by_env.setdefault(rollout.env, []).append(rollout)
    for name, members in by_env.items():
        rewards = [r.reward for r in first_branches(members)]
        prefix = f"env/{name}/"
        out[prefix + "reward"] = statistics.fmean(rewards)
        out[prefix + "reward_std"] = statistics.stdev(rewards) if len(rewards) > 1 else math.nan
        out.update(length_metrics(prefix + "completions/{}_length", [sum(r.completion_mask) for r in members]))
        out[prefix + "completions/clipped_ratio"] = statistics.fmean(float(r.truncated) for r in members)
        # The source's count where it kept one (every group generated, dropped ones too), else the batch's.
        out[prefix + "reward_errors"] = stats.get(prefix + "reward_errors",
                                                  float(sum(r.metrics.get(ERRORS_METRIC, 0.0) for r in members)))
        out[prefix + "rollouts"] = float(len(members))
        if "groups_dropped" in stats:
            out[prefix + "groups_dropped"] = stats.get(prefix + "groups_dropped", 0.0)
    return out


def length_metrics(pattern: str, lengths: list[int]) -> dict[str, float]:
    """Mean, min and max of ``lengths`` named by ``pattern`` (``{}`` the statistic)."""
    return {pattern.format("mean"): statistics.fmean(lengths), pattern.format("min"): float(min(lengths)),
            pattern.format("max"): float(max(lengths))}


class StepBatches:
    """Hands ``training_step`` this rank's slice of the current batch: a new batch every ``num_iterations`` steps.

    ``config`` is the run's ``BatchingConfig`` (computed once). ``global_step`` reads the trainer's step (staleness
    is measured against it). ``wait_s`` is the time the last ``next`` waited for the rollout source.
    """

    def __init__(self, source: RolloutSource, args: RLConfig, config: BatchingConfig, device,
                 global_step: Callable[[], int]):
        self.source = source
        self.args = args
        self.config = config
        self.device = device
        self.global_step = global_step
        self.batch_index = 0  # the next batch to take from the source
        self.iteration = 0  # updates done on ``rank_batch``
        self.rank_batch: RankBatch | None = None
        self.latest_rollouts: list[Rollout] | None = None  # the newest batch (main process), for samples and tables
        self.wait_s = 0.0

    def next(self, fill: Callable[[RankBatch], None]) -> RankBatch:
        """This rank's slice for the coming optimizer step; ``fill`` computes a new slice's fixed log-probs."""
        self.wait_s = 0.0
        if self.rank_batch is None or self.iteration == self.args.num_iterations:
            index = self.batch_index
            rank_batch = main_process_outcome(lambda: self.plan(index), scatter=True)
            rank_batch.micro_batches = [mb.to(self.device) for mb in rank_batch.micro_batches]
            self.wait_s = rank_batch.stats.extra.pop("wait_time", 0.0)  # logged by the step timer, once
            self.batch_index += 1
            self.iteration = 0
            fill(rank_batch)
            self.rank_batch = rank_batch
        self.iteration += 1
        return self.rank_batch

    def restore(self, batch_index: int, iteration: int, rank_batch: RankBatch | None) -> None:
        """Continue at a checkpoint's position (``rank_batch``: the slice part-way through its updates, or None)."""
        self.batch_index, self.iteration = batch_index, iteration
        if rank_batch is not None:
            rank_batch.micro_batches = [mb.to(self.device) for mb in rank_batch.micro_batches]
        self.rank_batch = rank_batch

    def mid_batch(self) -> RankBatch | None:
        """The slice in hand when it has updates left (its proximal log-probs predate a checkpoint), else None."""
        return self.rank_batch if self.rank_batch is not None and 0 < self.iteration < self.args.num_iterations else None

    def plan(self, index: int) -> list[RankBatch]:
        """Main process: batch ``index`` from the source, saved if asked, planned into one slice per rank."""
        waited = time.perf_counter()
        batch = as_batch(index, self.source.batch(index))
        waited = time.perf_counter() - waited
        rollouts = batch.rollouts
        self.latest_rollouts = rollouts
        if self.args.save_rollouts_path:
            append_rollouts(self.args.save_rollouts_path, rollouts)
        rank_batches = plan_batch(rollouts, self.config, index)
        extra = dict(batch.stats)
        extra.update(rollout_metrics(rollouts))
        extra.update(environment_metrics(rollouts, batch.stats))
        versions = [v for v in (r.oldest_version() for r in rollouts) if v is not None]
        if versions:
            # Staleness: optimizer steps between the weights that sampled a rollout's oldest token and the weights
            # it trains.
            staleness = [self.global_step() - v for v in versions]
            extra.update(staleness_max=float(max(staleness)), staleness_mean=sum(staleness) / len(staleness))
        if batch.generation_s is not None:
            # Time the trainer sat waiting for rollouts (0 when generation ran ahead), and the batch's generation.
            extra.update(generation_time=batch.generation_s)
        extra.update(wait_time=waited)
        for rank_batch in rank_batches:
            rank_batch.stats.extra.update(extra)
        return rank_batches

    def sample_completions(self) -> list:
        """A few completions of the newest batch, for the progress output (main process; empty elsewhere)."""
        count = self.args.num_completions_to_print or 3
        return sample_lines(self.latest_rollouts, count) if self.latest_rollouts else []
