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


def padded_rows(rows: int) -> int:
    """How many rows to give MKL for ``rows`` rows (zero rows added): its sgemm time on this project's CPU is far
    from monotone in the row count of ``W x^T`` (odd counts and 12-15 slow, multiples of 8 fast; SmolLM2's
    1536 x 576 layer, 2 threads: 1 row 0.37 ms, 4 rows 0.25, 13 rows 0.99, 16 rows 0.71, 19 rows 1.31, 24 rows
    0.92), and a row's product does not depend on the rows beside it."""
    if rows <= 3:
        return 4
    if rows in (4, 5, 9, 10, 11):
        return rows
    return -(-rows // 8) * 8


def weight_major(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``x W^T + b`` for ``x`` ``[rows, in]``, computed as ``(W x^T)^T`` with the rows padded (``padded_rows``);
    row-major like ``x`` (MKL runs ``W x^T`` several times slower when x is a column-major view: 0.8 ms instead
    of 0.24 for SmolLM2's 4-row MLP down-projection)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded > rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    y = torch.mm(layer.weight, x.T).T[:rows].contiguous()
    return y if layer.bias is None else y + layer.bias


def _weight_major(layer: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = weight_major(x.reshape(-1, x.shape[-1]), layer)
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
