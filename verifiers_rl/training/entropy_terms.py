"""TRL's entropy knobs over the whole step batch: ``top_entropy_quantile`` (train only the highest-entropy tokens)
and ``entropy_coef`` (an entropy bonus), both exact however the batch is split over ranks and micro-batches.

TRL takes the entropy quantile over each micro-batch (gathered over ranks) and averages the bonus per micro-batch;
here both are over the step's whole batch, which is what they equal with one micro-batch on one process (the case
``tests/integration/test_trl_numbers.py`` compares). The threshold needs every loss token's entropy before the first
backward, so a quantile below 1 costs one gradient-free forward of the batch per step.
"""

from __future__ import annotations

from typing import Callable

import torch

from verifiers_rl.training.batching import MicroBatch, RankBatch

GATHER_PAD = -1.0  # entropies are >= 0: the padding of the cross-rank gather


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> float:
    """The (1 - quantile) quantile of ``entropies`` (1-D, fp32, torch.quantile's linear interpolation, as TRL's
    ``get_high_entropy_mask``): tokens with H >= it are the top ``quantile`` of the batch. +inf for no tokens."""
    if entropies.numel() == 0:
        return float("inf")
    return float(torch.quantile(entropies.float(), 1.0 - quantile))


class EntropyTerms:
    """Per step: ``prepare`` finds the threshold over all ranks' loss tokens; per micro-batch: ``keep`` (the mask of
    tokens the policy loss trains) and ``bonus`` (coef * sum_eff H / N_eff, N_eff the effective tokens of the
    whole batch, eff = loss mask x keep), which the loss subtracts: L = L_policy - coef * mean H."""

    def __init__(self, quantile: float, coef: float, gather: Callable[[torch.Tensor], torch.Tensor]):
        self.quantile, self.coef, self.gather = quantile, coef, gather
        self._keep: dict[int, torch.Tensor] = {}
        self._effective_tokens: int | None = None

    @property
    def masks(self) -> bool:
        return self.quantile < 1.0

    @property
    def active(self) -> bool:
        return self.masks or self.coef != 0.0

    @torch.no_grad()
    def prepare(self, rank_batch: RankBatch, entropy_of: Callable[[MicroBatch], torch.Tensor]) -> None:
        """Every rank, the same number of forwards (the micro-batches of a step are equal in number on all ranks)."""
        self._keep.clear()
        self._effective_tokens = None
        if not self.masks:
            return
        entropies = [entropy_of(mb) for mb in rank_batch.micro_batches]
        local = torch.cat([h[mb.loss_mask > 0].float() for h, mb in zip(entropies, rank_batch.micro_batches)])
        everything = self.gather(local)
        everything = everything[everything != GATHER_PAD]
        threshold = entropy_threshold(everything, self.quantile)
        self._effective_tokens = int((everything >= threshold).sum())
        for h, mb in zip(entropies, rank_batch.micro_batches):
            self._keep[id(mb)] = ((h >= threshold) & (mb.loss_mask > 0)).to(mb.loss_mask.dtype)

    def keep(self, mb: MicroBatch) -> torch.Tensor | None:
        return self._keep.get(id(mb)) if self.masks else None

    def bonus(self, mb: MicroBatch, entropy: torch.Tensor) -> torch.Tensor:
        """coef * sum over this micro-batch's effective tokens of H / N_eff (global): partials sum to coef * mean H."""
        keep = self.keep(mb)
        effective = mb.loss_mask if keep is None else keep
        count = self._effective_tokens if keep is not None else mb.counts.loss_tokens
        return self.coef * (entropy * effective.to(entropy.dtype)).sum() / max(count, 1)
