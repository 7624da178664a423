"""Pure tensor functions of the policy loss (docs/architecture.md). No framework state; of the package only its choices.

Every tensor here is laid out as rows x positions ``[R, T]``. A row holds one sequence (padded micro-batches)
or several (packed micro-batches); ``seq_index[r, t]`` names the sequence a position belongs to within its
micro-batch (``-1`` on padding), so sequence reductions work the same in both layouts.

The aggregation rule that makes the update exact: a micro-batch returns

    partial = sum_{i,t} c_{i,t} z_{i,t},

with per-token weights ``c`` that depend only on the token's own sequence and on *global* counts
(``aggregation_weights``). Partials over any partition of the batch sum to the global loss.

Loss types, importance levels and importance corrections are registered functions (``@loss_type``,
``@importance_level``, ``@importance_correction``): adding one is one decorated function, found by its name wherever
the loss is computed. One the config offers also has its name in core/choices.py's ``Literal`` (the config sits below
this module); the registries are checked against those names at import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from verifiers_rl.core.choices import (  # noqa: F401  (the loss's own names too)
    LOSS_TYPES,
    CorrectionMode,
    ImportanceSamplingLevel,
    LossType,
    Registry,
    SequenceLogRatio,
    check_choice,
)

LOSS_TYPE_WEIGHTS = Registry("loss_type", LossType)
IMPORTANCE_LEVELS = Registry("importance_sampling_level", ImportanceSamplingLevel)
IMPORTANCE_CORRECTIONS = Registry("importance_correction", CorrectionMode)


@dataclass(frozen=True)
class GlobalCounts:
    """Counts over the whole optimizer-step batch on all ranks, taken once before splitting.

    ``loss_tokens`` = N = sum_i N_i; ``valid_sequences`` = B_v = #{i : N_i > 0}; ``horizon`` = H (DR-GRPO).
    """

    loss_tokens: int
    valid_sequences: int
    horizon: int


def loss_type(name: str) -> Callable[[Callable], Callable]:
    """Register ``weights(mask, sequence_loss_tokens, counts) -> c`` as the loss type ``name``: the per-token weights
    with  global loss = sum over the whole batch of c * z  (``aggregation_weights``). c may depend only on the token's
    own sequence (``sequence_loss_tokens``: its N_i) and the ``GlobalCounts``, so partials over any split of the batch
    sum to the global loss. One the config offers also needs its name in core/choices.py's ``LossType``."""
    return LOSS_TYPE_WEIGHTS.register(name)


def _at_least_one(count: int) -> float:
    # An all-masked batch has a zero numerator too; dividing by 1 keeps the loss at 0 instead of NaN.
    return float(max(count, 1))


@loss_type("grpo")
def grpo_weights(mask: torch.Tensor, sequence_loss_tokens: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
    """Sequence mean of token means: c = m / (N_i B_v)."""
    return mask / _at_least_one(counts.valid_sequences) / sequence_loss_tokens.clamp(min=1).to(mask.dtype)


@loss_type("dr_grpo")
def dr_grpo_weights(mask: torch.Tensor, sequence_loss_tokens: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
    """Dr. GRPO, token sums over a fixed horizon H: c = m / (B_v H)."""
    return mask / _at_least_one(counts.valid_sequences * counts.horizon)


@loss_type("token_mean")
def token_mean_weights(mask: torch.Tensor, sequence_loss_tokens: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
    """DAPO, the mean over every loss token of the batch (TRL's dapo and bnpo): c = m / N."""
    return mask / _at_least_one(counts.loss_tokens)


@loss_type("seq_mean_token_sum")
def seq_mean_token_sum_weights(mask: torch.Tensor, sequence_loss_tokens: torch.Tensor,
                               counts: GlobalCounts) -> torch.Tensor:
    """Sequence mean of token sums: c = m / B_v."""
    return mask / _at_least_one(counts.valid_sequences)


def aggregation_weights(
    loss_type: str, loss_mask: torch.Tensor, sequence_loss_tokens: torch.Tensor, counts: GlobalCounts
) -> torch.Tensor:
    """Per-token weights c with  global loss = sum over the whole batch of c * z, by the function registered as
    ``loss_type`` (an unknown name: ValueError naming --loss_type). ``sequence_loss_tokens[r, t]`` is N_i of the
    sequence at that position (counted on the whole sequence)."""
    weights = LOSS_TYPE_WEIGHTS.get(loss_type).function
    mask = loss_mask.to(torch.float64 if loss_mask.dtype == torch.float64 else torch.float32)
    return weights(mask, sequence_loss_tokens, counts)


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


def importance_level(name: str, *, one_per_sequence: bool) -> Callable[[Callable], Callable]:
    """Register ``log_ratio(log_ratio, loss_mask, seq_index, mean) -> the log-ratio at each position`` as the level
    ``name`` of the PPO ratio and of the importance corrections (``mean``: a sequence's log-ratio is the mean over its
    loss tokens, else their sum); ``one_per_sequence``: the ratio is one per sequence, so TRL's clip fractions count
    sequences (``ratio_is_per_sequence``). One the config offers also needs its name in ``ImportanceSamplingLevel``."""
    return IMPORTANCE_LEVELS.register(name, one_per_sequence=one_per_sequence)


def ratio_is_per_sequence(level: str) -> bool:
    """Whether the registered ``level`` gives one ratio per sequence (the clip metrics then count sequences)."""
    return IMPORTANCE_LEVELS.get(level).options["one_per_sequence"]


@importance_level("token", one_per_sequence=False)
def token_log_ratio(log_ratio: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor,
                    mean: bool = True) -> torch.Tensor:
    """Each token its own ratio: log r_t."""
    return log_ratio


@importance_level("sequence", one_per_sequence=True)
def sequence_log_ratio(log_ratio: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor,
                       mean: bool = True) -> torch.Tensor:
    """One ratio per sequence (GSPO), broadcast over its positions: mean_t m log r (sum_t when not ``mean``)."""
    return sequence_sum(log_ratio, loss_mask, seq_index, mean=mean)


def policy_ratio(logps, proximal_logps, loss_mask, seq_index, level: ImportanceSamplingLevel = "token") -> torch.Tensor:
    """r = exp(l - p) at the registered ``level``: per token, or exp(mean_t m (l - p)) per sequence (GSPO),
    broadcast over its positions."""
    log_ratio = IMPORTANCE_LEVELS.get(level).function(logps - proximal_logps, loss_mask, seq_index, mean=True)
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


def importance_correction(name: str, level: str | None) -> Callable[[Callable], Callable]:
    """Register ``weight(rho, cap, cap_min) -> w`` as the correction ``name``: rho the detached ratio between the
    proximal and the sampler policy at ``level`` (a registered ``importance_level``; None: no ratio, rho = 1), cap and
    cap_min the --importance_cap[_min] bounds. One the config offers also needs its name in ``CorrectionMode``."""
    if level is not None:
        IMPORTANCE_LEVELS.get(level)  # an unknown level fails here, not at the first step
    return IMPORTANCE_CORRECTIONS.register(name, level=level)


@importance_correction("sequence_truncate", level="sequence")
@importance_correction("token_truncate", level="token")
def truncate(rho: torch.Tensor, cap: float, cap_min: float | None) -> torch.Tensor:
    """w = min(max(rho, cap_min), cap) (no lower bound when cap_min is None)."""
    return rho.clamp(min=cap_min if cap_min is not None else 0.0, max=cap)


@importance_correction("sequence_mask", level="sequence")
@importance_correction("token_mask", level="token")
def mask_outside(rho: torch.Tensor, cap: float, cap_min: float | None) -> torch.Tensor:
    """w = rho inside [cap_min, cap] (cap_min None: 0), 0 outside."""
    inside = (rho <= cap) & (rho >= (cap_min if cap_min is not None else 0.0))
    return torch.where(inside, rho, torch.zeros_like(rho))


@importance_correction("none", level=None)
def no_correction(rho: torch.Tensor, cap: float, cap_min: float | None) -> torch.Tensor:
    """w = 1."""
    return torch.ones_like(rho)


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
    """Detached importance weight between the proximal and the sampler policy, by the correction registered as
    ``mode`` (an unknown name: ValueError naming --importance_correction).

    rho = exp(p - q) per token, or per sequence exp(mean_t m (p - q)) (length-normalised, our default) or
    exp(sum_t m (p - q)) (``sequence_log_ratio="sum"``: TRL's vllm_importance_sampling sequence modes).
    ``*_truncate``: w = min(rho, cap) (and max(., cap_min) when given); ``*_mask``: w = rho inside
    [cap_min, cap], 0 outside; ``none``: w = rho = 1 (no ratio taken). Returns (w, rho before truncation).
    """
    correction = IMPORTANCE_CORRECTIONS.get(mode)
    level = correction.options["level"]
    if level is None:
        ones = torch.ones_like(proximal_logps)
        return ones, ones
    log_rho = (proximal_logps - sampler_logps) * loss_mask.to(proximal_logps.dtype)
    log_rho = IMPORTANCE_LEVELS.get(level).function(log_rho, loss_mask, seq_index, mean=sequence_log_ratio == "mean")
    rho = torch.exp(log_rho)
    return correction.function(rho, cap, cap_min), rho


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

    # "from": the RLConfig field each is filled from (core.settings.settings_from); the others share its name.
    level: ImportanceSamplingLevel = field(default="token", metadata={"from": "importance_sampling_level"})
    epsilon_low: float = field(default=0.2, metadata={"from": "epsilon"})
    epsilon_high: float = 0.2  # TRL's: epsilon_high, or epsilon when that is None (step_loss.loss_settings)
    delta: float | None = None
    correction: CorrectionMode = field(default="token_truncate", metadata={"from": "importance_correction"})
    correction_cap: float = field(default=2.0, metadata={"from": "importance_cap"})
    correction_cap_min: float | None = field(default=None, metadata={"from": "importance_cap_min"})
    sequence_log_ratio: SequenceLogRatio = field(default="mean", metadata={"from": "importance_sequence_log_ratio"})
    beta: float = 0.0
    kl_ratio: bool = field(default=False, metadata={"from": "use_bias_correction_kl"})
    off_policy_threshold: float | None = field(default=None, metadata={"from": "off_policy_mask_threshold"})


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
    if sampler_logps is not None:
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


for _registry in (LOSS_TYPE_WEIGHTS, IMPORTANCE_LEVELS, IMPORTANCE_CORRECTIONS):
    _registry.check_builtins()  # every name the config offers has its function, and no built-in lacks its name
