"""Run a causal LM over a MicroBatch and return per-token log-probs of the tokens that are trained on.

The model's output layer is swapped, for the length of one forward, for ``target_logprobs`` applied to
the loss positions only: the full-vocabulary logits of the micro-batch never exist at once, and the forward
still goes through the (DDP / DeepSpeed) wrapper, so its hooks and gradient reduction work as usual.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from verifiers_rl.training.batching import MicroBatch
from verifiers_rl.compat import replaced_forward
from verifiers_rl.inference.kernels.cpu_matmul import plain_linear
from verifiers_rl.core.modeling import unwrap
from verifiers_rl.training.prefix import PADDING, ROOT
from verifiers_rl.training import segmented_attention
from verifiers_rl.training.segmented_attention import KEYWORD as RUNS_KEYWORD
from verifiers_rl.training.segmented_attention import Run, row_runs, run_by_run_cheaper
from verifiers_rl.training.segmented_attention import applies as runs_apply
from verifiers_rl.training.segmented_attention import install as install_run_attention


@dataclass
class PolicyOutput:
    logps: torch.Tensor  # [R, T]: log pi(x_t | x_<t) where loss_mask[t] = 1, else 0
    entropy: torch.Tensor  # [R, T], same positions; differentiable (detach it for metrics)


def splits_packed_rows(model: torch.nn.Module) -> bool:
    """Whether the attention kernel separates packed sequences by their restarted position ids (flash/varlen);
    other kernels take a block-diagonal mask (which sdpa attends run by run, ``segmented_attention``)."""
    return "flash" in str(getattr(unwrap(model).config, "_attn_implementation", "") or "")


def attends_run_by_run(model: torch.nn.Module) -> bool:
    """Whether packed and shared-prefix rows may attend run by run (``segmented_attention``), not densely over the
    row: an sdpa model on CPU, where it was measured (``RUN_OVERHEAD_CELLS``); on a GPU one dense masked call stays
    (a run's kernel launches cost differently there, unmeasured)."""
    inner = unwrap(model)
    return runs_apply(inner.config) and inner.get_input_embeddings().weight.device.type == "cpu"


def _row_runs(micro_batch: MicroBatch) -> list[Run] | None:
    if micro_batch.shared is not None:
        return row_runs(micro_batch.shared.block, micro_batch.shared.branch)
    if micro_batch.packed:  # one block per sequence (seq_index; -1 on padding: prefix.PADDING), no branches
        return row_runs(micro_batch.seq_index, torch.full_like(micro_batch.seq_index, -1))
    return None


def _forwarded_shape(micro_batch: MicroBatch) -> tuple[int, int]:
    return tuple((micro_batch.shared if micro_batch.shared is not None else micro_batch).input_ids.shape)


def micro_batch_runs(micro_batch: MicroBatch) -> list[Run] | None:
    """The runs (``segmented_attention.row_runs``) the forward attends a micro-batch's shared-prefix or packed rows
    by, when that is modelled cheaper than one dense call over them (``segmented_attention.cheaper_cells``); ``None``:
    dense (padded rows of one sequence each are causal over the row anyway)."""
    runs = _row_runs(micro_batch)
    if runs is None:
        return None
    real = [run for run in runs if run.before is not None]
    cells = sum(run.cells for run in real)
    rows, width = _forwarded_shape(micro_batch)
    return runs if run_by_run_cheaper(cells, len(real), rows, width) else None


def attention_cells(micro_batch: MicroBatch, run_attention: bool, with_overhead: bool = False) -> int:
    """Query-key cells the training forward's attention computes for ``micro_batch``: sum over runs of
    |run| x (|seen before| + |run|) where it attends run by run (``with_overhead``: plus
    ``segmented_attention.RUN_OVERHEAD_CELLS`` per run, the cost model's term), else rows x width^2 (dense)."""
    runs = micro_batch_runs(micro_batch) if run_attention else None
    if runs is None:
        rows, width = _forwarded_shape(micro_batch)
        return rows * width * width
    real = [run for run in runs if run.before is not None]
    overhead = segmented_attention.RUN_OVERHEAD_CELLS * len(real) if with_overhead else 0  # runs were cheaper
    return sum(run.cells for run in real) + overhead


def tree_attention_mask(block: torch.Tensor, branch: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [R, 1, T, T]: causal within a block (``prefix.PADDING``: padding); a position sees its
    block's shared positions (branch -1) and its own branch, never another branch nor padding; every position but
    padding sees the row's root (``prefix.ROOT``, the first positions of a packed row)."""
    length = block.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=block.device).tril()
    same = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)
    visible = (branch[:, None, :] < 0) | (branch[:, :, None] == branch[:, None, :])
    root = (block[:, None, :] == ROOT) & (block[:, :, None] != PADDING)
    # A padding position attends to itself only, so its softmax has a finite row.
    allowed = (same & visible & causal) | (root & causal) | torch.eye(length, dtype=torch.bool, device=block.device)
    zero = torch.zeros((), dtype=dtype, device=block.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def packed_attention_mask(seq_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [R, 1, T, T]: causal, and a position sees only its own sequence (never padding)."""
    return tree_attention_mask(seq_index, torch.full_like(seq_index, -1), dtype)


def attention_cost(model: torch.nn.Module) -> float:
    """One attention cell's forward cost relative to one token's (per layer, multiply-adds from the config):
    2 * heads * head_dim (scores and weighted values) over the q/k/v/o projections plus the MLP.

    ``prefix.modelled_cost`` uses it to decide how many sequences of a group share one row."""
    config = unwrap(model).config
    config = getattr(config, "get_text_config", lambda: config)()
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    projections = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate  # gated MLP (Llama, Qwen, SmolLM families)
    return 2 * heads * head_dim / (projections + mlp)


# ---------------------------------------------------------------------------------------------------------------
# Per-token log-probs at the sampling temperature, chunked so full-vocabulary logits exist for one chunk at a time.


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _ChunkedTargetLogProbs(torch.autograd.Function):
    """log softmax((h W^T + b) / T)[target] and the entropy, over token chunks, with a recomputing backward.

    Each chunk works in place on one [chunk, V] buffer (two at the peak), so memory is bounded by the chunk size.
    The last chunk's log-softmax buffer is kept from forward to backward (one [chunk, V] buffer), which then
    recomputes only the others: a micro-batch of at most ``chunk_size`` loss tokens computes its logits once.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        dtype = _compute_dtype(hidden.dtype)
        logps = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        entropy = torch.empty_like(logps)
        lse_all = torch.empty_like(logps)
        starts = range(0, hidden.shape[0], chunk_size)
        ctx.kept = None
        for start in starts:
            stop = start + chunk_size
            logsoftmax = _logits(hidden[start:stop], weight, bias, temperature, dtype)
            lse = torch.logsumexp(logsoftmax, dim=-1)
            logsoftmax.sub_(lse[:, None])
            logps[start:stop] = logsoftmax.gather(-1, targets[start:stop, None]).squeeze(-1)
            probs = logsoftmax.exp()
            entropy[start:stop] = -probs.mul_(logsoftmax).sum(-1)
            lse_all[start:stop] = lse
            if start == starts[-1] and any(ctx.needs_input_grad[:3]):
                ctx.kept = logsoftmax  # the last chunk's log p: its buffer is live now, the backward needs no recompute
            del logsoftmax, probs
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)  # an entropy that no loss uses costs nothing in backward
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, targets, lse_all, entropy = ctx.saved_tensors
        dtype = lse_all.dtype
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None  # the first chunk's product, then the others added (no zero-filled [V, H] buffer)
        grad_bias = (
            torch.zeros(bias.shape, dtype=dtype, device=bias.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        starts = list(range(0, hidden.shape[0], ctx.chunk_size))
        kept, ctx.kept = ctx.kept, None  # once: a second backward (retain_graph) recomputes every chunk
        for start in starts[-1:] + starts[:-1]:  # the kept chunk first, so at most one [chunk, V] buffer lives
            stop = min(start + ctx.chunk_size, hidden.shape[0])
            # d logp_target / d z = onehot(target) - p and d H / d z = -p (log p + H), z = logits / T; then / T.
            upstream = (grad_logps[start:stop, None].to(dtype) if grad_logps is not None
                        else torch.zeros((stop - start, 1), dtype=dtype, device=hidden.device))
            if kept is not None and start == starts[-1]:
                grad_logits, kept = kept, None  # log p, from the forward
            else:
                grad_logits = _logits(hidden[start:stop], weight, bias, ctx.temperature, dtype)
                grad_logits.sub_(lse_all[start:stop, None])  # log p
            if grad_entropy is not None:  # -p (g_logp + g_H (log p + H)); one more [chunk, V] buffer
                factor = (grad_logits + entropy[start:stop, None]).mul_(grad_entropy[start:stop, None].to(dtype))
                grad_logits.exp_().mul_(factor.add_(upstream).neg_())
                del factor
            else:
                grad_logits.exp_().mul_(-upstream)
            grad_logits.scatter_add_(-1, targets[start:stop, None], upstream)
            if ctx.temperature != 1:
                grad_logits.div_(ctx.temperature)
            # Matmuls in the parameters' dtype, so a bf16 weight is never copied to fp32 whole.
            grad_native = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = (grad_native @ weight).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                rows = hidden[start:stop].to(weight.dtype)
                if grad_weight is None:
                    grad_weight = (grad_native.T @ rows).to(dtype)
                elif weight.dtype == dtype:
                    grad_weight.addmm_(grad_native.T, rows)
                else:
                    grad_weight += (grad_native.T @ rows).to(dtype)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            del grad_logits, grad_native
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        elif ctx.needs_input_grad[1]:  # no rows
            grad_weight = torch.zeros_like(weight)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _logits(hidden, weight, bias, temperature, dtype):
    # The matmul runs in the weight's dtype (no fp32 copy of a bf16 vocabulary matrix); softmax math in ``dtype``.
    logits = plain_linear(hidden.to(weight.dtype), weight).to(dtype)
    if bias is not None:
        logits = logits + bias.to(dtype)
    return logits if temperature == 1 else logits / temperature


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
    computes all logits at once through autograd (the reference). Returns (logps, entropy), both differentiable:
    H = -sum_v p_v log p_v (an entropy bonus backpropagates through it).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if chunk_size:
        return _ChunkedTargetLogProbs.apply(hidden, weight, bias, targets, float(temperature), int(chunk_size))
    logits = _logits(hidden, weight, bias, temperature, _compute_dtype(hidden.dtype))
    logsoftmax = torch.log_softmax(logits, dim=-1)
    logps = logsoftmax.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logsoftmax.exp() * logsoftmax).sum(-1)
    return logps, entropy


@contextlib.contextmanager
def _output_layer_as_logprobs(model, targets, select, sources, temperature, chunk_size, sink):
    head = unwrap(model).get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"{type(unwrap(model)).__name__} has no output embedding layer with a weight.")

    def forward(hidden_states):
        # Token t is predicted from the hidden state of token t-1; only loss positions are computed.
        if sources is None:
            hidden = hidden_states[:, :-1][select]
        else:  # shared-prefix rows: a shared hidden state may predict several sequences' tokens
            hidden = hidden_states.flatten(0, 1)[sources]
        logps, entropy = target_logprobs(
            hidden, head.weight, targets, bias=head.bias, temperature=temperature, chunk_size=chunk_size
        )
        out = hidden_states.new_zeros(select.shape[0], select.shape[1] + 1, dtype=logps.dtype)
        out[:, 1:][select] = logps
        ent = torch.zeros_like(out)
        ent[:, 1:][select] = entropy
        sink["entropy"] = ent
        # Returned as "logits": the wrapper's autograd graph runs through it.
        return out

    with replaced_forward(head, forward):
        yield


def micro_batch_logprobs(
    model: torch.nn.Module,
    micro_batch: MicroBatch,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
) -> PolicyOutput:
    """Per-token log-probs of ``micro_batch`` under ``model`` at ``temperature``.

    The attention mask comes from real-token positions (``seq_index``), never from the loss mask or from
    ``input_ids != pad``; packed rows get a block-diagonal causal mask and restarted position ids; shared-prefix
    rows (``micro_batch.shared``) a tree mask (``tree_attention_mask``). The result is laid out like the
    micro-batch's per-token tensors either way.
    """
    select = micro_batch.loss_mask[:, 1:] > 0
    targets = micro_batch.input_ids[:, 1:][select]
    shared = micro_batch.shared
    sources = None
    if shared is not None:
        if splits_packed_rows(model):
            raise ValueError("Shared-prefix rows need a dense attention mask, which flash/varlen kernels do not take: "
                             "pass --share_prompt_training off (or an sdpa/eager attn_implementation).")
        sources = shared.source[:, :-1][select]
        kwargs = {"input_ids": shared.input_ids, "position_ids": shared.position_ids, "use_cache": False,
                  "attention_mask": tree_attention_mask(shared.block, shared.branch, unwrap(model).dtype)}
    else:
        kwargs = {"input_ids": micro_batch.input_ids, "position_ids": micro_batch.position_ids, "use_cache": False}
        if micro_batch.packed:
            if not splits_packed_rows(model):
                kwargs["attention_mask"] = packed_attention_mask(micro_batch.seq_index, unwrap(model).dtype)
        else:
            kwargs["attention_mask"] = (micro_batch.seq_index >= 0).long()
    runs = micro_batch_runs(micro_batch) if attends_run_by_run(model) else None
    if runs is not None:  # each run attends to what the mask allows, not the whole row (the mask: a fallback)
        install_run_attention()  # when first needed, not at import (the trainer removes it when training ends)
        kwargs[RUNS_KEYWORD] = runs
    sink: dict[str, torch.Tensor] = {}
    with _output_layer_as_logprobs(model, targets, select, sources, temperature, chunk_size, sink):
        output = model(**kwargs)
    logits = output.logits if hasattr(output, "logits") else output[0]
    return PolicyOutput(logps=logits, entropy=sink["entropy"])
