"""Run a causal LM over a MicroBatch and return per-token log-probs of the tokens that are trained on.

The model's output layer is swapped, for the length of one forward, for ``loss.target_logprobs`` applied to
the loss positions only: the full-vocabulary logits of the micro-batch never exist at once, and the forward
still goes through the (DDP / DeepSpeed) wrapper, so its hooks and gradient reduction work as usual.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .batching import MicroBatch
from .loss import target_logprobs


@dataclass
class PolicyOutput:
    logps: torch.Tensor  # [R, T]: log pi(x_t | x_<t) where loss_mask[t] = 1, else 0
    entropy: torch.Tensor  # [R, T], detached, same positions


# Prefixes that wrappers (DDP / DeepSpeed ``module.``, torch.compile ``_orig_mod.``) put before parameter names.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_wrappers(name: str) -> str:
    """A parameter name without the wrapper prefixes ``unwrap`` removes from the module."""
    while name.startswith(WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, token_ids: list[int], device=None) -> torch.Tensor:
    """``log p(token_t | tokens_<t)`` for t = 1 .. n-1 at temperature 1: one plain forward of one sequence (the
    post-sync probe's quantity, computed the same way by the trainer and the embedded engine)."""
    ids = torch.tensor([token_ids], device=device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    return torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP / DeepSpeed / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def splits_packed_rows(model: torch.nn.Module) -> bool:
    """Whether the attention kernel separates packed sequences by their restarted position ids (flash/varlen);
    other kernels need a dense block-diagonal mask and attend over the whole packed row."""
    return "flash" in str(getattr(unwrap(model).config, "_attn_implementation", "") or "")


def tree_attention_mask(block: torch.Tensor, branch: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [R, 1, T, T]: causal within a block (-1: padding); a position sees its block's shared
    positions (branch -1) and its own branch, never another branch nor padding."""
    length = block.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=block.device).tril()
    same = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)
    visible = (branch[:, None, :] < 0) | (branch[:, :, None] == branch[:, None, :])
    # A padding position attends to itself only, so its softmax has a finite row.
    allowed = (same & visible & causal) | torch.eye(length, dtype=torch.bool, device=block.device)
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

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


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
    sink: dict[str, torch.Tensor] = {}
    with _output_layer_as_logprobs(model, targets, select, sources, temperature, chunk_size, sink):
        output = model(**kwargs)
    logits = output.logits if hasattr(output, "logits") else output[0]
    return PolicyOutput(logps=logits, entropy=sink["entropy"])
