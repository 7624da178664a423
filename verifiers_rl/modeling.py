"""What the training side and the inference engines both need of a model: its name without wrappers, the bare
module, and the probe's log-probs. Neutral ground: the engines import nothing from the training side."""

from __future__ import annotations

import torch

# Prefixes that wrappers (DDP / DeepSpeed ``module.``, torch.compile ``_orig_mod.``) put before parameter names.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_wrappers(name: str, keep=lambda name: False) -> str:
    """A parameter name without the wrapper prefixes ``unwrap`` removes from the module; stops early at a name
    ``keep`` accepts (a model whose own submodule is called ``module``)."""
    while not keep(name) and name.startswith(WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP / DeepSpeed / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, token_ids: list[int], device=None) -> torch.Tensor:
    """``log p(token_t | tokens_<t)`` for t = 1 .. n-1 at temperature 1: one plain forward of one sequence (the
    post-sync probe's quantity, computed the same way by the trainer and the embedded engine)."""
    ids = torch.tensor([token_ids], device=device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    return torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
