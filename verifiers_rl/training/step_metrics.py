"""Step metrics: the loss terms and batch counts of each optimizer step, and its wall time in parts.

Token metrics are sums over this rank's loss tokens, all-reduced once per step and divided by the global token
count N (so they are token-weighted over the whole batch, however it was split). The wall time of a step is the time
between the ends of two consecutive optimizer steps' weight syncs, and its logged parts add up to it:

    step_time = between_steps_time + wait_time + train_time + weight_sync_time + other_time
    weight_sync_time = weight_sync_wait_s + weight_sync_s + weight_sync_probe_s

``between_steps_time``: logging, checkpoints and evaluation after the previous step; ``wait_time``: waiting for the
rollout source; ``train_time``: planning, forwards, backwards and the optimizer step (from the start of the trainer's
``training_step`` to the end of the optimizer step, less the wait); the weight sync's three parts: waiting for the
generator (older batches, the batch in progress), loading into the engine, and the probe. Each is timed on its own;
``other_time`` is what none of them covers (the scheduler step and HF's bookkeeping around the optimizer step).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from transformers import TrainerCallback

from verifiers_rl.training.batching import MicroBatch, RankBatch

# TRL's clip_ratio/* are fractions of loss tokens, or of sequences at importance_sampling_level=sequence.
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
TOKEN_METRICS = ("entropy", *CLIP_METRICS, "is_weight", "is_ratio", "is_clipped_fraction", "kl")


class StepMetrics:
    """Collects one optimizer step's metrics into ``sink`` (the lists the trainer averages into each log entry).

    ``reduce_sum(tensor)`` / ``reduce_max(tensor)`` sum / take the maximum of a tensor over ranks (identity in one
    process). ``sequence_level``: the ratio is one per sequence (GSPO), so TRL's clip fractions count sequences.
    """

    def __init__(self, sink: Callable[[], dict[str, list[float]]], reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                 reduce_max: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, sequence_level: bool = False):
        self.sink = sink
        self.reduce_sum = reduce_sum
        self.reduce_max = reduce_max
        self.sequence_level = sequence_level
        self.sums: dict[str, torch.Tensor] = {}
        self.extremes: dict[str, torch.Tensor] = {}  # TRL's clip_ratio/low_min (negated) and high_max

    def log(self, name: str, value: float) -> None:
        # A NaN (one episode's std) is no value: a window of only NaN is left out of the log entry (TRL's log would
        # write None, which tensorboard refuses with a warning per key and step); a window with values averages them.
        if not math.isnan(value):
            self.sink()[name].append(float(value))

    def begin_step(self) -> None:
        self.sums, self.extremes = {}, {}

    def _add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.sums[name] = self.sums.get(name, torch.zeros((), dtype=torch.float64, device=value.device)) + value

    def _max(self, name: str, values: torch.Tensor) -> None:
        value = values.detach().double().max()
        self.extremes[name] = torch.maximum(self.extremes[name], value) if name in self.extremes else value

    def add_loss_terms(self, mb: MicroBatch, entropy: torch.Tensor, terms) -> None:
        """Token sums of one micro-batch's entropy, clipping, importance weights and KL (``loss.TokenLossTerms``)."""
        mask = mb.loss_mask
        self._add("entropy", (entropy * mask).sum())
        self._add_clipping(mb, terms.clip_low, terms.clip_high)
        if mb.sampler_logps is not None:
            self._add("is_weight", (terms.is_weight * mask).sum())
            self._add("is_ratio", (terms.is_ratio_raw * mask).sum())
            self._add("is_clipped_fraction", ((terms.is_weight != terms.is_ratio_raw).to(mask.dtype) * mask).sum())
        if terms.kl is not None:
            self._add("kl", (terms.kl.detach() * mask).sum())

    def _add_clipping(self, mb: MicroBatch, low: torch.Tensor, high: torch.Tensor) -> None:
        """TRL's clip fractions (token sums, or sequence counts at sequence level) and each sequence's low / high
        fraction for TRL's ``clip_ratio/low_min`` and ``high_max`` (sequences without loss tokens left out)."""
        mask = mb.loss_mask.to(low.dtype)
        weight = mask / mb.sequence_loss_tokens.clamp(min=1).to(low.dtype) if self.sequence_level else mask
        for name, value in zip(CLIP_METRICS, (low, high, torch.maximum(low, high))):
            self._add(name, (value * weight).sum())
        valid = (mb.seq_index >= 0) & (mask > 0)
        if valid.any():
            index = mb.seq_index[valid]
            count = int(index.max()) + 1
            per_sequence = [torch.zeros(count, dtype=torch.float64, device=low.device).index_add(0, index, v[valid].double())
                            for v in (low, high, mask)]
            trained = per_sequence[2] > 0
            self._max("clip_ratio/low_min", -(per_sequence[0] / per_sequence[2].clamp(min=1))[trained])
            self._max("clip_ratio/high_max", (per_sequence[1] / per_sequence[2].clamp(min=1))[trained])

    def end_step(self, rank_batch: RankBatch) -> None:
        """Log the step's token metrics (every rank takes part in the reductions) and the batch's counts. A batch
        without loss tokens (every completion masked) logs no token metric: a mean over nothing is no 0, and a
        step's missing key is left out of its log entry (as ``clip_ratio/low_min`` and ``high_max`` are)."""
        names = [name for name in TOKEN_METRICS if name in self.sums]
        if names:
            reduced = self.reduce_sum(torch.stack([self.sums[name] for name in names]))
            tokens, sequences = rank_batch.counts.loss_tokens, rank_batch.counts.valid_sequences  # global N and B_v
            for name, value in zip(names, reduced.tolist()):
                count = sequences if self.sequence_level and name in CLIP_METRICS else tokens
                if count:
                    self.log(name, value / count)
        self._log_extremes()
        stats = rank_batch.stats
        self.log("reward", stats.reward_mean)
        self.log("reward_std", stats.reward_std)
        self.log("frac_reward_zero_std", stats.zero_std_fraction)
        self.log("completions/clipped_ratio", stats.truncated_fraction)
        self.log("real_token_fraction", 1 - stats.padding_tokens / max(stats.computed_tokens, 1))
        self.log("tokens_forwarded", stats.computed_tokens)
        self.log("tokens_unique", stats.unique_tokens)
        self.log("micro_batches_per_rank", len(rank_batch.micro_batches))
        self.log("loss_tokens", rank_batch.counts.loss_tokens)
        for name, value in stats.extra.items():
            self.log(name, value)

    def _log_extremes(self) -> None:
        """``clip_ratio/low_min`` and ``high_max`` over every rank's sequences; a rank without loss tokens adds -inf,
        so every rank takes part in the reduction."""
        device = next(iter(self.sums.values())).device if self.sums else "cpu"
        names = ("clip_ratio/low_min", "clip_ratio/high_max")
        local = torch.stack([self.extremes.get(n, torch.tensor(-math.inf, dtype=torch.float64, device=device))
                             for n in names])
        low, high = self.reduce_max(local).tolist()
        if math.isfinite(low):
            self.log(names[0], -low)
            self.log(names[1], high)


class StepTimer(TrainerCallback):
    """Logs ``step_time`` and its parts (module docstring). Add it after the weight-sync callback: its
    ``on_step_end`` closes the step once the engine holds the new weights. ``wait_s()`` is the step's wait for
    rollouts; the weight sync reports its seconds through ``add_sync``."""

    def __init__(self, sink: Callable[[], dict[str, list[float]]], wait_s: Callable[[], float]):
        self.sink = sink
        self.wait_s = wait_s
        self.last_end: float | None = None  # when the previous step ended (None before the first)
        self.step_start = 0.0
        self.between = 0.0
        self.sync = 0.0
        self.training_from = 0.0  # when training_step began (it waits for the batch first)
        self.trained = 0.0  # the training window: training_step's start to the optimizer step's end

    def add_sync(self, seconds: float) -> None:
        self.sync += seconds

    def training_started(self) -> None:
        """Called as the trainer's ``training_step`` begins (before it waits for its batch)."""
        self.training_from = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trained = time.perf_counter() - self.training_from

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_end = None

    def on_step_begin(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.between = 0.0 if self.last_end is None else now - self.last_end
        self.step_start = now - self.between
        self.sync = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        sink = self.sink()
        sync = self.sync
        wait = self.wait_s()
        step = now - self.step_start
        train = self.trained - wait
        sink["between_steps_time"].append(self.between)
        sink["wait_time"].append(wait)
        sink["train_time"].append(train)
        sink["weight_sync_time"].append(sync)
        sink["other_time"].append(step - self.between - wait - train - sync)
        sink["step_time"].append(step)
        self.last_end = now
