"""One micro-batch's loss, and the forwards of a step that do not train (proximal and reference log-probs).

``StepLoss.partial`` is the micro-batch's numerator over the global denominator (``loss.aggregation_weights``), so
partials over ranks and micro-batches sum to the single-device loss of the batch (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from verifiers_rl import compat
from verifiers_rl.training.batching import MicroBatch, RankBatch
from verifiers_rl.training.entropy_terms import EntropyTerms
from verifiers_rl.training.loss import GlobalCounts, LossSettings, aggregation_weights, per_token_loss
from verifiers_rl.core.modeling import unwrap
from verifiers_rl.core.settings import settings_from
from verifiers_rl.training.forward import micro_batch_logprobs
from verifiers_rl.training.step_metrics import StepMetrics


@dataclass
class LossInputs:
    """What a custom loss function receives for one micro-batch (tensors [R, T], zeros off the loss mask).

    ``global_stats`` maps a mask name to its counts over the whole step batch on all ranks (tokens N, valid
    sequences B_v, horizon H). ``aggregate(per_token, loss_type)`` turns per-token losses into this
    micro-batch's partial loss under the global denominator, so partials over ranks and micro-batches sum to
    the single-device loss.
    """

    logps: torch.Tensor
    proximal_logps: torch.Tensor
    sampler_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    seq_index: torch.Tensor
    sequence_loss_tokens: torch.Tensor
    global_stats: dict[str, GlobalCounts]
    loss_type: str

    def aggregate(self, per_token: torch.Tensor, loss_type: str | None = None) -> torch.Tensor:
        """This micro-batch's partial loss of ``per_token`` under ``loss_type`` (default: the config's), any name
        registered with ``loss.loss_type`` (an unknown one: ValueError naming loss_type)."""
        weights = aggregation_weights(
            loss_type or self.loss_type, self.loss_mask, self.sequence_loss_tokens, self.global_stats["loss_mask"]
        )
        return (per_token * weights.to(per_token.dtype)).sum()


CustomLoss = Callable[[LossInputs], torch.Tensor]


@contextlib.contextmanager
def without_dropout(model: torch.nn.Module):
    """``model`` in eval mode (dropout off) inside the block; each module's own mode back after it."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def loss_settings(args) -> LossSettings:
    """The per-token loss's settings from ``args`` (an ``RLConfig``); ``epsilon_high`` None is ``epsilon``, as in
    TRL's GRPOTrainer."""
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    return settings_from(args, LossSettings, epsilon_high=high)


class StepLoss:
    """The trainer's loss: ``partial`` for one micro-batch (the built-in clipped surrogate with its importance
    correction and KL, or ``loss_fn``), ``fill_fixed_logprobs`` once per batch, ``logprobs`` for any forward.

    ``reference()`` returns the trainer's ``(ref_model, adapter_reference)``: either may be None (then a PEFT model's
    base is the reference, or TRL's copy of the adapters of a ``PeftModel`` given: ``compat.peft_reference``).
    ``args`` supplies the log-prob temperature and chunk size, ``num_iterations`` and ``loss_type``.
    """

    def __init__(self, args, settings: LossSettings, entropy: EntropyTerms, metrics: StepMetrics,
                 loss_fn: CustomLoss | None, reference: Callable[[], tuple]):
        self.args = args
        self.settings = settings
        self.entropy = entropy
        self.metrics = metrics
        self.loss_fn = loss_fn
        self.reference = reference

    def partial(self, model, mb: MicroBatch) -> torch.Tensor:
        output = self.logprobs(model, mb)
        logps = output.logps
        proximal = mb.proximal_logps if mb.proximal_logps is not None else logps.detach()
        terms = per_token_loss(
            logps,
            mb.advantages.to(logps.dtype),
            mb.loss_mask,
            mb.seq_index,
            proximal_logps=proximal,
            sampler_logps=mb.sampler_logps,
            ref_logps=mb.ref_logps,
            settings=self.settings,
            keep=self.entropy.keep(mb),
        )
        inputs = LossInputs(
            logps=logps,
            proximal_logps=proximal,
            sampler_logps=mb.sampler_logps,
            ref_logps=mb.ref_logps,
            advantages=mb.advantages,
            loss_mask=mb.loss_mask,
            seq_index=mb.seq_index,
            sequence_loss_tokens=mb.sequence_loss_tokens,
            global_stats={"loss_mask": mb.counts},
            loss_type=self.args.loss_type,
        )
        if self.loss_fn is None:
            partial = inputs.aggregate(terms.per_token_loss)
        else:
            result = self.loss_fn(inputs)
            partial = result if result.dim() == 0 else inputs.aggregate(result)
        if self.entropy.coef:
            partial = partial - self.entropy.bonus(mb, output.entropy)
        # Anchor every parameter in the graph, even for a micro-batch without loss tokens.
        partial = partial + 0.0 * logps.sum()
        self.metrics.add_loss_terms(mb, output.entropy, terms)
        return partial

    @torch.no_grad()
    def fill_fixed_logprobs(self, model, rank_batch: RankBatch) -> None:
        """Reference log-probs (beta > 0) and, with several updates per batch, proximal log-probs: once per batch,
        before the first update, on every rank for the same number of micro-batches."""
        for mb in rank_batch.micro_batches:
            if self.args.num_iterations > 1:
                mb.proximal_logps = self.logprobs(model, mb).logps.detach()
            if self.settings.beta != 0.0:
                mb.ref_logps = self.reference_logprobs(model, mb)

    def reference_logprobs(self, model, mb: MicroBatch) -> torch.Tensor:
        ref_model, adapter_reference = self.reference()
        if ref_model is not None:
            return self.logprobs(ref_model, mb).logps
        # PEFT's reference is the policy's own forward: without dropout, as TRL's separate reference model (eval mode)
        if adapter_reference is not None:  # PEFT with sync_ref_model: the base and the mixed adapters
            with adapter_reference.swapped(), without_dropout(model):
                return self.logprobs(model, mb).logps
        with compat.peft_reference(unwrap(model)), without_dropout(model):  # the base, or TRL's copy of given adapters
            return self.logprobs(model, mb).logps

    def logprobs(self, model, mb: MicroBatch):
        return micro_batch_logprobs(model, mb, self.args.temperature, self.args.logprob_chunk_size or None)
