"""Pure tensor functions of the policy loss (docs/architecture.md). No framework state, nothing from the package.

Every tensor here is laid out as rows x positions ``[R, T]``. A row holds one sequence (padded micro-batches)
or several (packed micro-batches); ``seq_index[r, t]`` names the sequence a position belongs to within its
micro-batch (``-1`` on padding), so sequence reductions work the same in both layouts.

The aggregation rule that makes the update exact: a micro-batch returns

    partial = sum_{i,t} c_{i,t} z_{i,t},

with per-token weights ``c`` that depend only on the token's own sequence and on *global* counts
(``aggregation_weights``). Partials over any partition of the batch sum to the global loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifiers_rl.core.choices import (  # noqa: F401  (the loss's own names too)
    LOSS_TYPES,
    CorrectionMode,
    ImportanceSamplingLevel,
    LossType,
    SequenceLogRatio,
    check_choice,
)





@dataclass(frozen=True)
class GlobalCounts:
    """Counts over the whole optimizer-step batch on all ranks, taken once before splitting.

    ``loss_tokens`` = N = sum_i N_i; ``valid_sequences`` = B_v = #{i : N_i > 0}; ``horizon`` = H (DR-GRPO).
    """

    loss_tokens: int
    valid_sequences: int
    horizon: int

    def denominator(self, loss_type: LossType) -> float:
        """The global denominator of ``loss_type``: B_v (grpo, seq_mean_token_sum), B_v*H (dr_grpo), N (token_mean)."""
        if loss_type == "token_mean":
            value = self.loss_tokens
        elif loss_type == "dr_grpo":
            value = self.valid_sequences * self.horizon
        else:
            value = self.valid_sequences
        # An all-masked batch has a zero numerator too; dividing by 1 keeps the loss at 0 instead of NaN.
        return float(max(value, 1))


def aggregation_weights(
    loss_type: LossType, loss_mask: torch.Tensor, sequence_loss_tokens: torch.Tensor, counts: GlobalCounts
) -> torch.Tensor:
    """Per-token weights c with  global loss = sum over the whole batch of c * z.

    grpo: m / (N_i B_v);  dr_grpo: m / (B_v H);  token_mean: m / N;  seq_mean_token_sum: m / B_v.
    ``sequence_loss_tokens[r, t]`` is N_i of the sequence at that position (counted on the whole sequence).
    """
    mask = loss_mask.to(torch.float64 if loss_mask.dtype == torch.float64 else torch.float32)
    weights = mask / counts.denominator(loss_type)
    if loss_type == "grpo":
        weights = weights / sequence_loss_tokens.clamp(min=1).to(weights.dtype)
    return weights


def sequence_sum(values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """Masked sum of ``values`` over each sequence (its mean when ``mean``), broadcast back to its positions (0 on
    padding): sum_i = sum_t m_{i,t} v_{i,t}; mean_i = sum_i / max(sum_t m_{i,t}, 1). Differentiable in ``values``.
    """
    valid = seq_index >= 0
    num_sequences = int(seq_index.max().item()) + 1 if valid.any() else 0
    if num_sequences == 0:
        return torch.zeros_like(values)
    index = seq_index[valid]
    masked = (values * mask.to(values.dtype))[valid]
    sums = torch.zeros(num_sequences, dtype=values.dtype, device=values.device).index_add(0, index, masked)
    if mean:
        counts = torch.zeros(num_sequences, dtype=values.dtype, device=values.device).index_add(
            0, index, mask.to(values.dtype)[valid]
        )
        sums = sums / counts.clamp(min=1)
    return torch.where(valid, sums[seq_index.clamp(min=0)], torch.zeros_like(values))


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Masked mean of ``values`` over each sequence, broadcast back to its positions (0 on padding)."""
    return sequence_sum(values, mask, seq_index, mean=True)


def policy_ratio(logps, proximal_logps, loss_mask, seq_index, level: ImportanceSamplingLevel = "token") -> torch.Tensor:
    """r = exp(l - p) per token, or exp(mean_t m (l - p)) per sequence (GSPO), broadcast over its positions."""
    log_ratio = logps - proximal_logps
    if level == "sequence":
        log_ratio = sequence_mean(log_ratio, loss_mask, seq_index)
    return torch.exp(log_ratio)


def clipped_surrogate(
    logps: torch.Tensor,
    proximal_logps: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    level: ImportanceSamplingLevel = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate L = -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A).

    r = exp(l - p) per token, or exp(mean_t m (l - p)) per sequence (GSPO) broadcast over its positions.
    ``delta`` (INTELLECT-2's two-sided clip, TRL's ``delta``) bounds the unclipped ratio too; None = no bound.
    Returns (per-token loss, ratio).
    """
    ratio = policy_ratio(logps, proximal_logps, loss_mask, seq_index, level)
    bounded = ratio if delta is None else torch.clamp(ratio, max=delta)
    unclipped = bounded * advantages
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages
    return -torch.minimum(unclipped, clipped), ratio


@torch.no_grad()
def clipped_regions(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
                    epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's clip indicators (its ``clip_ratio/*`` metrics): low = r < 1 - eps_low with A < 0, high = r > 1 + eps_high
    with A > 0, on the unbounded ratio (``delta`` does not enter)."""
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return low.to(ratio.dtype), high.to(ratio.dtype)


@torch.no_grad()
def importance_weights(
    proximal_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    mode: CorrectionMode = "token_truncate",
    cap: float = 2.0,
    cap_min: float | None = None,
    sequence_log_ratio: SequenceLogRatio = "mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached importance weight between the proximal and the sampler policy.

    rho = exp(p - q) per token, or per sequence exp(mean_t m (p - q)) (length-normalised, our default) or
    exp(sum_t m (p - q)) (``sequence_log_ratio="sum"``: TRL's vllm_importance_sampling sequence modes).
    ``*_truncate``: w = min(rho, cap) (and max(., cap_min) when given); ``*_mask``: w = rho inside
    [cap_min, cap], 0 outside; ``none``: w = 1. Returns (w, rho before truncation).
    """
    log_rho = (proximal_logps - sampler_logps) * loss_mask.to(proximal_logps.dtype)
    if mode.startswith("sequence"):
        log_rho = sequence_sum(log_rho, loss_mask, seq_index, mean=sequence_log_ratio == "mean")
    rho = torch.exp(log_rho)
    if mode == "none":
        return torch.ones_like(rho), rho
    lower = cap_min if cap_min is not None else 0.0
    if mode.endswith("truncate"):
        return rho.clamp(min=lower, max=cap), rho
    inside = (rho <= cap) & (rho >= lower)
    return torch.where(inside, rho, torch.zeros_like(rho)), rho


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(ref - l) - (ref - l) - 1."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


@torch.no_grad()
def off_policy_keep(
    advantages: torch.Tensor,
    logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``), 1 = keep, per position:
    keep a sequence when A >= 0 or mean_t m (b - l) <= threshold, with b the behaviour (sampler) log-probs."""
    kl = sequence_mean(torch.nan_to_num(behaviour_logps - logps.detach(), nan=0.0), loss_mask, seq_index)
    return ((advantages >= 0) | (kl <= threshold)).to(logps.dtype)


@dataclass(frozen=True)
class LossSettings:
    """The knobs of the per-token loss (RLConfig's, TRL's names in brackets where they differ).

    ``delta``: bound on the unclipped ratio (two-sided clip); ``kl_ratio`` [use_bias_correction_kl]: the KL term is
    r * k3, importance-weighted to the proximal policy that sampled; ``off_policy_threshold``
    [off_policy_mask_threshold]: drop negative-advantage sequences whose mean sampler-to-policy KL exceeds it.
    """

    level: ImportanceSamplingLevel = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    correction: CorrectionMode = "token_truncate"
    correction_cap: float = 2.0
    correction_cap_min: float | None = None
    sequence_log_ratio: SequenceLogRatio = "mean"
    beta: float = 0.0
    kl_ratio: bool = False
    off_policy_threshold: float | None = None


@dataclass
class TokenLossTerms:
    """Per-token tensors of one micro-batch, before aggregation."""

    per_token_loss: torch.Tensor
    clip_low: torch.Tensor  # ``clipped_regions``
    clip_high: torch.Tensor
    is_weight: torch.Tensor
    is_ratio_raw: torch.Tensor
    kl: torch.Tensor | None


def per_token_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    *,
    proximal_logps: torch.Tensor | None = None,
    sampler_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    settings: LossSettings = LossSettings(),
    keep: torch.Tensor | None = None,
) -> TokenLossTerms:
    """z = keep * o * w * L (+ beta * k3-KL, times r when ``kl_ratio``): the per-token loss of docs/architecture.md.

    L the clipped surrogate, w the importance weight, o the off-policy sequence mask, ``keep`` any other token mask
    (the entropy mask); the KL term is never masked (as TRL). ``proximal_logps`` defaults to ``logps.detach()``
    (one update per batch). The correction is skipped (w = 1) when ``sampler_logps`` is None.
    """
    s = settings
    if proximal_logps is None:
        proximal_logps = logps.detach()
    surrogate, ratio = clipped_surrogate(
        logps, proximal_logps, advantages, loss_mask, seq_index, s.level, s.epsilon_low, s.epsilon_high, s.delta
    )
    if sampler_logps is not None and s.correction != "none":
        weight, rho = importance_weights(proximal_logps, sampler_logps, loss_mask, seq_index, s.correction,
                                         s.correction_cap, s.correction_cap_min, s.sequence_log_ratio)
    else:
        weight = torch.ones_like(surrogate)
        rho = torch.ones_like(surrogate)
    loss = weight * surrogate
    if s.off_policy_threshold is not None:
        behaviour = sampler_logps if sampler_logps is not None else proximal_logps
        loss = loss * off_policy_keep(advantages, logps, behaviour, loss_mask, seq_index, s.off_policy_threshold)
    if keep is not None:
        loss = loss * keep.to(loss.dtype)
    kl = None
    if s.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs.")
        kl = k3_kl(logps, ref_logps)
        loss = loss + s.beta * (kl * ratio if s.kl_ratio else kl)
    return TokenLossTerms(loss, *clipped_regions(ratio, advantages, s.epsilon_low, s.epsilon_high), weight, rho, kl)
