"""What the training side and the inference engines both need of a model: its name without wrappers, the bare
module, the probe's log-probs, and how to ask it for the last position's logits only. Neutral ground: the engines
import nothing from the training side."""

from __future__ import annotations

import inspect

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


def last_logits_only(model: torch.nn.Module) -> dict:
    """``{"logits_to_keep": 1}`` where ``model.forward`` takes it (the output layer on the last position only, as
    ``generate`` does), else ``{}``: keyword arguments for a prefill or decode forward."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, token_ids: list[int], device=None) -> torch.Tensor:
    """``log p(token_t | tokens_<t)`` for t = 1 .. n-1 at temperature 1: one plain forward of one sequence (the
    post-sync probe's quantity, computed the same way by the trainer and the embedded engine)."""
    ids = torch.tensor([token_ids], device=device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    return torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]


# Default probe tolerances (largest gap, nats). Measured on SmolLM2-135M's 32-token probe
# (tests/training/test_weight_sync.py):
# bf16 rounding alone (bf16 weights, or fp32 weights under bf16 autocast, vs fp32) moves a log-prob by up to
# 0.11-0.18, while one projection left unloaded (zeros) moves one by 0.8-18.
PROBE_TOLERANCE_FP32 = 1e-3
PROBE_TOLERANCE_16BIT = 0.5


def default_probe_tolerance(*dtypes) -> float:
    """``PROBE_TOLERANCE_16BIT`` if any side computes in bf16/fp16 (a dtype or its name), else the float32 one."""
    sixteen = {"bfloat16", "float16", "half", "bf16", "fp16"}
    low = any(str(dtype).removeprefix("torch.") in sixteen for dtype in dtypes if dtype)
    return PROBE_TOLERANCE_16BIT if low else PROBE_TOLERANCE_FP32
