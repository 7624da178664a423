"""Pure tensor functions of the policy loss (SPEC §3). No framework state, nothing from the package.

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

LOSS_TYPES = ("grpo", "dr_grpo", "token_mean", "seq_mean_token_sum")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")


@dataclass(frozen=True)
class GlobalCounts:
    """Counts over the whole optimizer-step batch on all ranks, taken once before splitting.

    ``loss_tokens`` = N = sum_i N_i; ``valid_sequences`` = B_v = #{i : N_i > 0}; ``horizon`` = H (DR-GRPO).
    """

    loss_tokens: int
    valid_sequences: int
    horizon: int

    def denominator(self, loss_type: str) -> float:
        """The global denominator of ``loss_type``: B_v (grpo, seq_mean_token_sum), B_v*H (dr_grpo), N (token_mean)."""
        check_loss_type(loss_type)
        if loss_type == "token_mean":
            value = self.loss_tokens
        elif loss_type == "dr_grpo":
            value = self.valid_sequences * self.horizon
        else:
            value = self.valid_sequences
        # An all-masked batch has a zero numerator too; dividing by 1 keeps the loss at 0 instead of NaN.
        return float(max(value, 1))


def check_loss_type(loss_type: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; expected one of {', '.join(LOSS_TYPES)}.")


def aggregation_weights(
    loss_type: str, loss_mask: torch.Tensor, sequence_loss_tokens: torch.Tensor, counts: GlobalCounts
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


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Masked mean of ``values`` over each sequence, broadcast back to its positions (0 on padding).

    mean_i = sum_t m_{i,t} v_{i,t} / max(sum_t m_{i,t}, 1). Differentiable in ``values``.
    """
    valid = seq_index >= 0
    num_sequences = int(seq_index.max().item()) + 1 if valid.any() else 0
    if num_sequences == 0:
        return torch.zeros_like(values)
    index = seq_index[valid]
    masked = (values * mask.to(values.dtype))[valid]
    sums = torch.zeros(num_sequences, dtype=values.dtype, device=values.device).index_add(0, index, masked)
    counts = torch.zeros(num_sequences, dtype=values.dtype, device=values.device).index_add(
        0, index, mask.to(values.dtype)[valid]
    )
    means = sums / counts.clamp(min=1)
    return torch.where(valid, means[seq_index.clamp(min=0)], torch.zeros_like(values))


def clipped_surrogate(
    logps: torch.Tensor,
    proximal_logps: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    level: str = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A).

    r = exp(l - p) per token, or exp(mean_t m (l - p)) per sequence (GSPO) broadcast over its positions.
    Returns (per-token loss, ratio, clip-active indicator).
    """
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"Unknown importance_sampling_level {level!r}; expected token or sequence.")
    log_ratio = logps - proximal_logps
    if level == "sequence":
        log_ratio = sequence_mean(log_ratio, loss_mask, seq_index)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages
    clip_active = (clipped < unclipped).to(logps.dtype)
    return -torch.minimum(unclipped, clipped), ratio, clip_active


@torch.no_grad()
def importance_weights(
    proximal_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    mode: str = "token_truncate",
    cap: float = 2.0,
    cap_min: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached importance weight between the proximal and the sampler policy.

    rho = exp(p - q) per token, or exp(mean_t m (p - q)) per sequence (length-normalised, never the sum).
    ``*_truncate``: w = min(rho, cap) (and max(., cap_min) when given); ``*_mask``: w = rho inside
    [cap_min, cap], 0 outside; ``none``: w = 1. Returns (w, rho before truncation).
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"Unknown importance correction {mode!r}; expected one of {', '.join(CORRECTION_MODES)}.")
    log_rho = (proximal_logps - sampler_logps) * loss_mask.to(proximal_logps.dtype)
    if mode.startswith("sequence"):
        log_rho = sequence_mean(log_rho, loss_mask, seq_index)
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


@dataclass
class TokenLossTerms:
    """Per-token tensors of one micro-batch, before aggregation."""

    per_token_loss: torch.Tensor
    ratio: torch.Tensor
    clip_active: torch.Tensor
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
    level: str = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    correction: str = "token_truncate",
    correction_cap: float = 2.0,
    correction_cap_min: float | None = None,
    beta: float = 0.0,
) -> TokenLossTerms:
    """z = w * L (+ beta * k3-KL): the per-token loss of SPEC §3.

    ``proximal_logps`` defaults to ``logps.detach()`` (one update per batch). The correction is skipped
    (w = 1) when ``sampler_logps`` is None.
    """
    if proximal_logps is None:
        proximal_logps = logps.detach()
    surrogate, ratio, clip_active = clipped_surrogate(
        logps, proximal_logps, advantages, loss_mask, seq_index, level, epsilon_low, epsilon_high
    )
    if sampler_logps is not None and correction != "none":
        weight, rho = importance_weights(
            proximal_logps, sampler_logps, loss_mask, seq_index, correction, correction_cap, correction_cap_min
        )
    else:
        weight = torch.ones_like(surrogate)
        rho = torch.ones_like(surrogate)
    loss = weight * surrogate
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs.")
        kl = k3_kl(logps, ref_logps)
        loss = loss + beta * kl
    return TokenLossTerms(loss, ratio.detach(), clip_active, weight, rho, kl)


# ---------------------------------------------------------------------------------------------------------------
# Per-token log-probs at the sampling temperature, chunked so full-vocabulary logits exist for one chunk at a time.


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _ChunkedTargetLogProbs(torch.autograd.Function):
    """log softmax((h W^T + b) / T)[target] and the entropy, over token chunks, with a recomputing backward.

    Each chunk works in place on one [chunk, V] buffer (two at the peak), so memory is bounded by the chunk size.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        dtype = _compute_dtype(hidden.dtype)
        logps = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        entropy = torch.empty_like(logps)
        lse_all = torch.empty_like(logps)
        for start in range(0, hidden.shape[0], chunk_size):
            stop = start + chunk_size
            logsoftmax = _logits(hidden[start:stop], weight, bias, temperature, dtype)
            lse = torch.logsumexp(logsoftmax, dim=-1)
            logsoftmax.sub_(lse[:, None])
            logps[start:stop] = logsoftmax.gather(-1, targets[start:stop, None]).squeeze(-1)
            probs = logsoftmax.exp()
            entropy[start:stop] = -probs.mul_(logsoftmax).sum(-1)
            lse_all[start:stop] = lse
            del logsoftmax, probs
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, bias, targets, lse_all = ctx.saved_tensors
        dtype = lse_all.dtype
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros(bias.shape, dtype=dtype, device=bias.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            stop = start + ctx.chunk_size
            upstream = grad_logps[start:stop, None].to(dtype)
            # d logp_target / d logits = (onehot(target) - softmax) / T, built in place in the logits buffer.
            grad_logits = _logits(hidden[start:stop], weight, bias, ctx.temperature, dtype)
            grad_logits.sub_(lse_all[start:stop, None]).exp_().mul_(-upstream)
            grad_logits.scatter_add_(-1, targets[start:stop, None], upstream)
            grad_logits.div_(ctx.temperature)
            # Matmuls in the parameters' dtype, so a bf16 weight is never copied to fp32 whole.
            grad_native = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = (grad_native @ weight).to(hidden.dtype)
            if grad_weight is not None:
                if weight.dtype == dtype:
                    grad_weight.addmm_(grad_native.T, hidden[start:stop].to(dtype))
                else:
                    grad_weight += (grad_native.T @ hidden[start:stop].to(weight.dtype)).to(dtype)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            del grad_logits, grad_native
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _logits(hidden, weight, bias, temperature, dtype):
    # The matmul runs in the weight's dtype (no fp32 copy of a bf16 vocabulary matrix); softmax math in ``dtype``.
    logits = (hidden.to(weight.dtype) @ weight.T).to(dtype)
    if bias is not None:
        logits = logits + bias.to(dtype)
    return logits / temperature


def target_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(target | h) at ``temperature`` and the entropy of pi(. | h), for hidden states ``[N, H]``.

    logp = (h W^T + b)[target] / T - logsumexp((h W^T + b) / T). With ``chunk_size``, logits exist for
    ``chunk_size`` tokens at a time in forward and backward (the backward recomputes them); ``None`` or 0
    computes all logits at once through autograd (the reference). Returns (logps, detached entropy).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if chunk_size:
        return _ChunkedTargetLogProbs.apply(hidden, weight, bias, targets, float(temperature), int(chunk_size))
    logits = _logits(hidden, weight, bias, temperature, _compute_dtype(hidden.dtype))
    logsoftmax = torch.log_softmax(logits, dim=-1)
    logps = logsoftmax.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logsoftmax.exp() * logsoftmax).sum(-1)
    return logps, entropy
