"""Matmuls against a large weight in the layout MKL runs fastest on CPU: ``(W x^T)^T``, equal to ``x W^T``.

``F.linear`` hands MKL ``x @ W^T`` (a transposed weight). With few rows against a large weight MKL's sgemm is slow in
that layout on this project's CPU (AMD EPYC, AVX2, torch 2.13's MKL): SmolLM2-135M's output layer (49152 x 576)
times 16 rows took 64 ms as ``F.linear`` and 26 ms as ``W @ x^T`` (228 against 297 ms at 256 rows); a whole
16-row decode step 358 ms against 204 ms. The two differ at float rounding only (another summation order).
Neutral ground, like ``modeling`` (the engine generates with it).
"""

from __future__ import annotations

import contextlib

import torch

from .compat import replaced_forward


def _weight_major(layer: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = torch.mm(layer.weight, x.reshape(-1, x.shape[-1]).T).T  # [N, out]: a view of the [out, N] product
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return forward


def applies(layer: torch.nn.Module) -> bool:
    """Plain fp32 ``nn.Linear`` layers on CPU (not subclasses: quantized and adapter layers have their own forward),
    left alone when something already replaced the layer's forward (TRL's fp32 output-layer patch, ours)."""
    return (type(layer) is torch.nn.Linear and "forward" not in layer.__dict__
            and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32)


@contextlib.contextmanager
def weight_major_linears(model: torch.nn.Module, enabled: bool = True):
    """For the length of the block every layer of ``model`` that ``applies`` computes ``(W x^T)^T + b``; yields how
    many layers that is. The engine generates inside it; its post-sync probe does not (it compares with the
    trainer's forward)."""
    layers = [layer for layer in model.modules() if applies(layer)] if enabled else []
    with contextlib.ExitStack() as stack:
        for layer in layers:
            stack.enter_context(replaced_forward(layer, _weight_major(layer)))
        yield len(layers)
