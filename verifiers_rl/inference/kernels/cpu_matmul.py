"""CPU matmuls against large weights: ``x W^T + b`` computed faster than ``F.linear``, for the engine (few rows) and
the training output layer's logits (``plain_linear``).

Two ways, both equal to ``F.linear`` to float rounding (another summation order; a row's product never depends on
the rows beside it):

- ``PackedWeights`` (the engine's default where torch has oneDNN, as its x86 CPU builds do): each weight reordered
  once into oneDNN's blocked layout, multiplied by oneDNN's kernels: the fastest of the three at decode shapes and
  at training's many rows (benchmarks/embedded_decode.py). The price: a second copy of the weights, re-packed after
  each weight load.
- ``weight_major``: ``(W x^T)^T``. ``F.linear`` hands MKL ``x @ W^T`` (a transposed weight), and with few rows
  against a large weight MKL's sgemm is slow in that layout.

Neutral ground, like ``modeling`` (the engine generates with it).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from verifiers_rl import compat
from verifiers_rl.compat import replaced_forward


def padded_rows(rows: int) -> int:
    """How many rows to give MKL for ``rows`` rows (zero rows added): its sgemm time is far from monotone in the
    row count of ``W x^T`` (odd counts and 12-15 slow, multiples of 8 fast, as profiled on an x86 CPU), and a row's
    product does not depend on the rows beside it."""
    if rows <= 3:
        return 4
    if rows in (4, 5, 9, 10, 11):
        return rows
    return -(-rows // 8) * 8


def weight_major(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``x W^T + b`` for ``x`` ``[rows, in]``, computed as ``(W x^T)^T`` with the rows padded (``padded_rows``);
    row-major like ``x`` (MKL runs ``W x^T`` several times slower when x is a column-major view)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded > rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    y = torch.mm(layer.weight, x.T).T[:rows].contiguous()
    return y if layer.bias is None else y + layer.bias


# x [rows, in], a linear layer -> x W^T + b [rows, out]
Linear = Callable[[torch.Tensor, torch.nn.Linear], torch.Tensor]


packs_available = compat.onednn_available
_onednn_linear = compat.onednn_linear


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b``, through oneDNN with the weight as it is (not packed) where that applies: fp32 CPU tensors and
    no autograd graph to record (oneDNN's op has no backward). Else ``F.linear``. The training output layer's
    logits (``policy``: hundreds of rows times the vocabulary matrix) run faster this way than as ``x @ W^T``; equal
    to float rounding."""
    tracked = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if (tracked or not packs_available() or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32):
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = _onednn_linear(flat, weight, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class PackedWeights:
    """oneDNN-packed copies of the weights of ``model``'s linear layers that ``applies`` admits, for ``linear``.

    ``refresh`` re-packs a layer when its weight is another tensor or was changed in place since its pack (torch's
    version counter: a weight load's ``copy_`` counts), so a pack never serves stale weights. Tied weights (the
    output layer is the input embedding) are packed once, under the output layer. The layers are those ``applies``
    admits at each ``refresh`` (a model moved off the CPU has none).
    """

    ROWS_HINT = 64  # oneDNN picks the blocked layout for this many rows; any count >= 4 ran as fast, 1 slower

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._packs: dict[torch.nn.Linear, tuple[torch.Tensor, int, torch.Tensor]] = {}
        # The model's linear layers, found at the first refresh: an engine's model keeps its modules (loads copy
        # into their weights), and a walk over every module at each of a running batch's steps cost ~5% of the step.
        self._layers: list[torch.nn.Linear] | None = None

    def _current(self, layer: torch.nn.Linear) -> bool:
        weight, version, _ = self._packs.get(layer, (None, -1, None))
        return weight is layer.weight and version == compat.tensor_version(layer.weight)

    @torch.no_grad()
    def refresh(self) -> int:
        """Pack the weights changed since their last pack (all, the first time); how many were packed."""
        if self._layers is None:
            self._layers = [layer for layer in self.model.modules() if applies(layer)]
        layers = [layer for layer in self._layers if applies(layer)]
        admitted = set(layers)
        self._packs = {layer: pack for layer, pack in self._packs.items() if layer in admitted}
        stale = [layer for layer in layers if not self._current(layer)]
        for layer in stale:
            packed = compat.onednn_pack(layer.weight, self.ROWS_HINT)
            self._packs[layer] = (layer.weight, compat.tensor_version(layer.weight), packed)
        return len(stale)

    def linear(self, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        """``x W^T + b`` for ``x`` ``[rows, in]`` with the layer's packed weight (no gradient)."""
        if not self._current(layer):
            raise RuntimeError("A linear layer's weight changed after its pack: call PackedWeights.refresh first.")
        return _onednn_linear(x.contiguous(), self._packs[layer][2], layer.bias)


def _replacement(layer: torch.nn.Linear, linear: Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = linear(x.reshape(-1, x.shape[-1]), layer)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return forward


def plain(layer: torch.nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a subclass: quantized and adapter layers have their own forward) whose forward
    nothing replaced (TRL's fp32 output-layer patch, ours)."""
    return type(layer) is torch.nn.Linear and "forward" not in layer.__dict__


def applies(layer: torch.nn.Module) -> bool:
    """``plain`` fp32 ``nn.Linear`` layers on CPU."""
    return plain(layer) and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32


@contextlib.contextmanager
def cpu_linears(model: torch.nn.Module, linear: Linear | None = weight_major):
    """For the length of the block every layer of ``model`` that ``applies`` computes ``linear(x, layer)``
    (``weight_major`` or a ``PackedWeights``' ``linear``; None: leave them all); yields how many layers that is.
    The engine generates inside it; its post-sync probe does not (it compares with the trainer's forward)."""
    layers = [layer for layer in model.modules() if applies(layer)] if linear is not None else []
    with contextlib.ExitStack() as stack:
        for layer in layers:
            stack.enter_context(replaced_forward(layer, _replacement(layer, linear)))
        yield len(layers)
