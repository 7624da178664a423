"""Attention over packed and shared-prefix rows, run by run, instead of densely over the whole row.

A packed row's mask (``policy.tree_attention_mask``) lets a position see the row's root, its block's shared prefix
and its own branch, causally. Dense SDPA scores every pair of the row's positions and masks most of them: a
1024-token row of 16 completions computes ~7x the allowed cells. Here each *run* of a row (consecutive positions of
one block and branch) attends to exactly what it may see:

    keys(run) = [the columns before the run that its mask allows (root, block prefix)] ++ [the run itself]
    out(run)  = softmax(q K^T * scale + bottom-right causal) V        (a run's earlier keys are visible to all of it)

which is the dense masked softmax over the same cells (the masked cells add exp(-inf) = 0 there), to float rounding.
Padding positions get zero output (nothing reads them: no real position attends to padding, no loss is on it).

Hooked in as transformers' ``sdpa`` attention function with a ``verifiers_rl_runs`` keyword (the model's forward
passes unknown keywords down to its attention function): a call without it is transformers' own ``sdpa``, so other
models in the process and the engine are unaffected, and activation checkpointing recomputes along the same path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verifiers_rl.training.prefix import PADDING, ROOT

KEYWORD = "verifiers_rl_runs"
# What a run costs beyond its cells, in cells: its SDPA calls, slices and concatenations in forward and backward
# (the ratio of a run's fixed cost to a cell's, profiled on a CPU; an upper bound). A row of short sequences is
# cheaper as one dense call.
RUN_OVERHEAD_CELLS = 10_000


@dataclass(frozen=True)
class Run:
    """Query columns ``[start, stop)`` of one row; ``before``: the column ranges left of ``start`` they all see
    (``None`` on padding)."""

    row: int
    start: int
    stop: int
    before: tuple[tuple[int, int], ...] | None

    @property
    def cells(self) -> int:
        """Query-key cells it computes: |run| x (|before| + |run|) (none on padding)."""
        if self.before is None:
            return 0
        return (self.stop - self.start) * (sum(b - a for a, b in self.before) + self.stop - self.start)


def _ranges(columns: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The maximal ``[a, b)`` ranges of the True entries of a 1-D bool tensor."""
    edges = torch.diff(torch.cat([columns.new_zeros(1), columns, columns.new_zeros(1)]).to(torch.int8))
    starts, stops = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
    return tuple(zip(starts, stops))


def row_runs(block: torch.Tensor, branch: torch.Tensor) -> list[Run]:
    """The runs of ``[R, T]`` rows of ``block`` / ``branch`` ids (``prefix.SharedPrefixRows``' meaning; a packed
    row of unshared sequences: block = sequence, branch = -1), each with what ``policy.tree_attention_mask`` lets
    it see before it."""
    block, branch = block.cpu(), branch.cpu()
    runs = []
    for row in range(block.shape[0]):
        b, r = block[row], branch[row]
        change = ((b[1:] != b[:-1]) | (r[1:] != r[:-1])).nonzero().flatten().add(1).tolist()
        for start, stop in zip([0] + change, change + [b.shape[0]]):
            k, j = int(b[start]), int(r[start])
            if k == PADDING:
                runs.append(Run(row, start, stop, None))
                continue
            seen = b[:start] == ROOT
            if k >= 0:
                seen |= (b[:start] == k) & ((r[:start] == -1) | (r[:start] == j))
            runs.append(Run(row, start, stop, _ranges(seen)))
    return runs


def run_by_run_cheaper(cells: int, runs: int, rows: int, width: int) -> bool:
    """Whether ``runs`` runs of ``cells`` cells in all cost less than one dense call over ``rows`` rows of ``width``:
    cells + RUN_OVERHEAD_CELLS x runs < rows x width^2 (``policy.micro_batch_runs`` decides with it)."""
    return cells + RUN_OVERHEAD_CELLS * runs < rows * width * width


def cheaper_cells(cells: int, runs: int, rows: int, width: int) -> int:
    """The modelled attention cost, in cells, of the way ``run_by_run_cheaper`` picks: the smaller of the two
    (``batching`` models layouts with it)."""
    return min(cells + RUN_OVERHEAD_CELLS * runs, rows * width * width)


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scaling: float) -> torch.Tensor:
    """One run's output ``[1, H, L, D]`` from its queries ``[1, H, L, D]`` and its key/value column pieces (what it
    sees before it, then itself: ``[1, KVH, *, D]`` each)."""
    if len(keys) == 1:  # keys = the run itself: plain causal attention
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, scale=scaling, enable_gqa=True)
    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    length = q.shape[2]
    causal = torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - length)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scaling, enable_gqa=True)


def _run_by_run(query, key, value, runs: list[Run], scaling: float, columns=None) -> torch.Tensor:
    """``columns(which, row, a, b)``: the tensor standing for columns ``[a, b)`` of ``row`` of input ``which``
    (0 query, 1 key, 2 value); default: a view of them."""
    inputs = (query, key, value)
    columns = columns or (lambda which, row, a, b: inputs[which][row : row + 1, :, a:b])
    rows = []
    for row in range(query.shape[0]):
        parts = []
        for run in runs:
            if run.row != row:
                continue
            if run.before is None:
                parts.append(query.new_zeros(1, query.shape[1], run.stop - run.start, value.shape[-1]))
                continue
            seen = [*run.before, (run.start, run.stop)]
            parts.append(_attend(columns(0, row, run.start, run.stop), [columns(1, row, a, b) for a, b in seen],
                                 [columns(2, row, a, b) for a, b in seen], scaling))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows)


class _RunAttention(torch.autograd.Function):
    """One autograd node from (q, k, v) to the output, as SDPA is. Its forward records the runs' own graph (their
    SDPA calls and concatenations) on detached views of the column pieces each run reads (leaves of that graph), and
    its backward goes through it and adds each piece's gradient into place: no recompute of the forward, and no
    backward of a slice, which zero-fills a whole row's gradient per piece (both were a visible part of a training
    step).

    Dozens of per-run nodes would finish the q/k/v gradients in an order that depends on the row's layout, and
    ZeRO-3 reduce-scatters parameter gradients in the order they finish: two ranks with different layouts would
    then exchange buckets of different sizes."""

    @staticmethod
    def forward(ctx, query, key, value, runs, scaling):
        needed = ctx.needs_input_grad[:3]
        if not any(needed):  # no gradient wanted (no_grad, inputs that need none): no graph to keep
            return _run_by_run(query, key, value, runs, scaling)
        inputs, leaves = (query, key, value), []

        def columns(which, row, a, b):
            piece = inputs[which][row : row + 1, :, a:b].detach()
            if needed[which]:
                piece.requires_grad_()
                leaves.append((which, row, a, b, piece))
            return piece

        with torch.enable_grad():
            output = _run_by_run(query, key, value, runs, scaling, columns)
        ctx.graph = leaves, output
        ctx.shapes = [(t.shape, t.dtype, t.device) if n else None for t, n in zip(inputs, needed)]
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        leaves, output = ctx.graph
        del ctx.graph  # the runs' saved tensors go with the graph, as a node's saved tensors do after backward
        grads = [None if spec is None else torch.zeros(spec[0], dtype=spec[1], device=spec[2]) for spec in ctx.shapes]
        if leaves and output.requires_grad:  # else a row of padding only (an empty rank's micro-batch): zeros
            pieces = torch.autograd.grad(output, [leaf[-1] for leaf in leaves], grad_output, allow_unused=True)
            for (which, row, a, b, _), piece in zip(leaves, pieces):
                if piece is not None:
                    grads[which][row : row + 1, :, a:b] += piece
        return (*grads, None, None)


def run_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: list[Run],
                  scaling: float) -> torch.Tensor:
    """Attention of ``[R, H, T, D]`` queries over ``[R, KVH, T, D]`` keys/values, run by run; ``[R, T, H, D]``
    (transformers' attention-function layout)."""
    return _RunAttention.apply(query, key, value, runs, scaling).transpose(1, 2).contiguous()


def _sdpa_with_runs(transformers_sdpa):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        runs = kwargs.get(KEYWORD)
        if runs is None or dropout:  # attention dropout (off in Llama/Qwen configs) is not recomputable: dense
            return transformers_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return run_attention(query, key, value, runs, scale), None

    attention.transformers_sdpa = transformers_sdpa
    return attention


def install() -> None:
    """Make transformers' ``sdpa`` attention function take ``verifiers_rl_runs`` (idempotent; through
    transformers' public ``AttentionInterface``). The policy's forward installs it when it first passes runs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not hasattr(current, "transformers_sdpa"):
        AttentionInterface.register("sdpa", _sdpa_with_runs(current))


def uninstall() -> None:
    """Give transformers its own ``sdpa`` back (the trainer does when training ends); a later forward with runs
    installs it again."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if hasattr(current, "transformers_sdpa"):
        AttentionInterface.register("sdpa", current.transformers_sdpa)


def installed() -> bool:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return hasattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "transformers_sdpa")


def applies(model_config) -> bool:
    """Whether the model attends through transformers' ``sdpa`` function (the one ``install`` extends)."""
    return getattr(model_config, "_attn_implementation", None) == "sdpa"
