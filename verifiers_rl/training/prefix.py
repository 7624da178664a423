"""Prompt once per group: the rows a micro-batch forwards when its sequences share a token prefix.

The completions of a group share their prompt (and multi-turn rollouts sometimes more). Instead of one row per
sequence, a *shared-prefix row* holds a part of a group as its longest common token prefix, once, followed by the
rest of every sequence (its *branch*)::

    [ prefix (P tokens) | branch of sequence 1 | branch of sequence 2 | ... ]

Position ids run 0..P-1 over the prefix and restart at P in every branch. The attention mask (``policy.
tree_attention_mask``) lets a prefix position see the prefix causally and a branch position see the prefix and its
own branch causally, so every hidden state is the one the sequence's own row would give (rotary embeddings depend on
position ids only): exact to float rounding. The prefix is forwarded once; its keys and values, with their
gradient, serve every branch, and the backward sums the branches' gradients into them.

What the loss sees does not change: per-token tensors stay laid out per (sequence, token), in the micro-batch's
padded or packed rows. ``SharedPrefixRows.source`` maps each of those slots to the forwarded slot holding its token,
so token t of a sequence is predicted from the hidden state at the source of its token t-1, shared or not. Loss
tokens inside a shared prefix (multi-turn rollouts whose first turns agree) stay one target per sequence, with that
sequence's advantage, mask and sampler log-prob, all predicted from the one shared hidden state.

A packed row of several parts also holds their common prefix (a system prompt every group starts with) once, as the
row's *root*: ``[ root | part 1's prefix after the root | its branches | part 2's ... ]``, position ids continuing
from the root in every part, and every position of the row sees the root. Exact in the same way.

The shared prefix is the common prefix of token ids, compared, never assumed from the rollout's prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def common_prefix_length(token_lists: list[list[int]]) -> int:
    """Length of the longest common prefix of the lists (the whole length for a single list)."""
    if len(token_lists) == 1:
        return len(token_lists[0])
    shortest = min(len(tokens) for tokens in token_lists)
    if shortest == 0:
        return 0
    stacked = torch.tensor([tokens[:shortest] for tokens in token_lists])
    differs = (stacked != stacked[0]).any(dim=0).nonzero()
    return int(differs[0]) if len(differs) else shortest



def unique_tokens(token_lists: list[list[int]]) -> int:
    """Tokens of one group with its common prefix counted once: what one shared row forwards."""
    prefix = common_prefix_length(token_lists)
    return prefix + sum(len(tokens) - prefix for tokens in token_lists)

@dataclass
class Part:
    """Sequences forwarded as one shared-prefix row segment: ``members`` (batch indices) share ``prefix_len`` tokens."""

    members: list[int]
    prefix_len: int
    tokens: int  # forwarded tokens: the prefix once plus every branch
    branch_cells: int = 0  # sum over members of (length - prefix_len) * length: the branches' cells, run by run
    branches: int = 0  # members longer than the prefix (a branch run each)

    @classmethod
    def of(cls, members: list[int], token_lists: list[list[int]]) -> "Part":
        prefix = common_prefix_length([token_lists[i] for i in members])
        lengths = [len(token_lists[i]) for i in members]
        return cls(list(members), prefix, prefix + sum(n - prefix for n in lengths),
                   sum((n - prefix) * n for n in lengths), sum(n > prefix for n in lengths))

    def runs(self, root: int = 0) -> int:
        """Its runs in a row whose first ``root`` tokens are the root: the prefix past the root, then each branch."""
        return int(self.prefix_len > root) + self.branches

    def cells(self, root: int = 0) -> int:
        """Attention cells of the part attended run by run (``segmented_attention``) in a row whose first ``root``
        tokens are its root: the prefix past the root sees the root and itself, (P - R) x P, and each branch its
        prefix and itself, (L - P) x L (a single sequence, P = L: (L - R) x L)."""
        return (self.prefix_len - root) * self.prefix_len + self.branch_cells

    @property
    def shared(self) -> bool:
        return len(self.members) > 1


def modelled_cost(tokens: int, attention_cost: float, cells: int | None = None) -> float:
    """Forward/backward cost of a row of ``tokens`` tokens, in units of one token's per-layer projections and MLP:
    tokens + attention_cost * cells, where cells = tokens^2 when the attention is dense over the whole row (a
    padded row; any row of a kernel other than sdpa) and the runs' cells when it attends run by run (``Part.cells``)."""
    return tokens + attention_cost * (tokens * tokens if cells is None else cells)


def best_part_size(prefix_len: int, branch_lengths: list[int], attention_cost: float, runs: bool = False) -> int:
    """Sequences per shared row that minimise the modelled cost of a group: ceil(G / g) rows of
    P + g * mean(branch) tokens each. With dense attention and long branches one row per group costs more attention
    than the shared prefix saves, and smaller parts (down to g = 1, one row per sequence) win. Attended run by run
    (``runs``), a branch's cells do not depend on its row-mates: the whole group, its prefix once, is cheapest."""
    count = len(branch_lengths)
    if runs:
        return count
    mean_branch = sum(branch_lengths) / count
    costs = {
        size: math.ceil(count / size) * modelled_cost(prefix_len + size * mean_branch, attention_cost)
        for size in range(1, count + 1)
    }
    return min(costs, key=lambda size: (costs[size], -size))


def first_fit_decreasing(indices: list[int], lengths, weights, capacity: int,
                         max_items: int | None = None, base: int = 0) -> list[list[int]]:
    """Bins of at most ``capacity`` total weight (and ``max_items`` items); items sorted by decreasing length, each
    into the first bin with room. A bin's weight starts at ``base`` (a shared prefix every member forwards once); an
    item too heavy for any bin gets one of its own."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if (max_items is None or len(bins[b]) < max_items) and load + weights[index] <= capacity:
                bins[b].append(index)
                loads[b] += weights[index]
                break
        else:
            bins.append([index])
            loads.append(base + weights[index])
    return bins


def split_group(
    members: list[int], token_lists: list[list[int]], prefix: int, max_size: int, max_tokens: int
) -> list[Part]:
    """A group whose sequences share ``prefix`` tokens, as parts of at most ``max_size`` sequences and ``max_tokens``
    forwarded tokens (a single sequence is always a part), first-fit decreasing by length. Each part then shares its
    own common prefix, which may be longer than the group's."""
    lengths = {i: len(token_lists[i]) for i in members}
    branches = {i: lengths[i] - prefix for i in members}
    bins = first_fit_decreasing(members, lengths, branches, max_tokens, max_items=max_size, base=prefix)
    return [Part.of(sorted(b), token_lists) for b in bins]


def split_for_ranks(parts: list[Part], world_size: int, token_lists: list[list[int]]) -> list[Part]:
    """Halve the largest shared parts until every rank can get one (or no part can be split)."""
    parts = list(parts)
    while len(parts) < world_size:
        splittable = [p for p in parts if p.shared]
        if not splittable:
            break
        largest = max(splittable, key=lambda p: (p.tokens, -p.members[0]))
        parts.remove(largest)
        half = (len(largest.members) + 1) // 2
        parts += [Part.of(largest.members[:half], token_lists), Part.of(largest.members[half:], token_lists)]
    return parts


PADDING, ROOT = -1, -2  # ``SharedPrefixRows.block`` on padding and on a packed row's root


def row_root(token_lists: list[list[int]], parts: list[tuple[int, int]], packed: bool) -> int:
    """Tokens of a micro-batch's row root: the common prefix of all its sequences when they are packed into one row
    of shared-prefix parts (of (size, prefix length); several, one at least shared), else 0 (a padded row holds one
    part, whose prefix is already held once)."""
    shared = packed and len(parts) > 1 and any(size > 1 for size, _ in parts)
    return common_prefix_length(token_lists) if shared else 0


@dataclass
class SharedPrefixRows:
    """The rows a micro-batch forwards when some of its sequences share a prefix ([R, W] each).

    ``block`` numbers the row segments (``PADDING`` on padding, ``ROOT`` on a packed row's root); ``branch`` is -1
    on a segment's shared prefix (and the root) and the micro-batch-local index of the sequence on its branch.
    ``source`` has the shape of the micro-batch's per-token tensors: for each (sequence, token) slot, the flat index
    (row * W + column) of the forwarded slot holding that token (-1 on padding).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    block: torch.Tensor
    branch: torch.Tensor
    source: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def padding(self) -> int:
        return int((self.block == PADDING).sum())

    def to(self, device: torch.device) -> "SharedPrefixRows":
        return SharedPrefixRows(**{name: value.to(device) for name, value in self.__dict__.items()})


def shared_prefix_rows(
    token_lists: list[list[int]],
    parts: list[tuple[int, int]],
    packed: bool,
    pad_token_id: int,
    target_seq_index: torch.Tensor,
) -> SharedPrefixRows:
    """Forwarded rows for a micro-batch whose sequences (``token_lists``, in micro-batch order) come in consecutive
    ``parts`` of (size, prefix length): one row per part (padded), or all parts in one row (packed), after the row's
    root (``row_root``)."""
    root = row_root(token_lists, parts, packed)
    segments = []  # (ids, positions, branch) per part
    slots: list[tuple[int, list[int]]] = []  # per sequence: its segment, the columns of its tokens past the root
    local = 0
    for size, prefix in parts:
        ids, positions = list(token_lists[local][root:prefix]), list(range(root, prefix))
        branch = [-1] * (prefix - root)
        for j in range(local, local + size):
            tokens = token_lists[j]
            start = len(ids)
            ids += tokens[prefix:]
            positions += range(prefix, len(tokens))
            branch += [j] * (len(tokens) - prefix)
            slots.append((len(segments), list(range(prefix - root)) + list(range(start, start + len(tokens) - prefix))))
        segments.append((ids, positions, branch))
        local += size
    # Where each segment starts: (row, column); a packed row's segments follow its root.
    lengths = [len(ids) for ids, _, _ in segments]
    if packed:
        starts = [(0, root + sum(lengths[:k])) for k in range(len(segments))]
        width = root + sum(lengths)
    else:
        starts = [(k, 0) for k in range(len(segments))]
        width = max(lengths)
    shape = (1 if packed else len(segments), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    block = torch.full(shape, PADDING, dtype=torch.long)
    branch_t = torch.full(shape, -1, dtype=torch.long)
    if root:
        input_ids[0, :root] = torch.tensor(token_lists[0][:root], dtype=torch.long)
        position_ids[0, :root] = torch.arange(root)
        block[0, :root] = ROOT
    for k, ((ids, positions, branch), (row, column)) in enumerate(zip(segments, starts)):
        span = slice(column, column + len(ids))
        input_ids[row, span] = torch.tensor(ids, dtype=torch.long)
        position_ids[row, span] = torch.tensor(positions, dtype=torch.long)
        block[row, span] = k
        branch_t[row, span] = torch.tensor(branch, dtype=torch.long)
    source = torch.full(target_seq_index.shape, -1, dtype=torch.long)
    flat_target = target_seq_index.reshape(-1)
    flat_source = source.view(-1)
    for j, (segment, columns) in enumerate(slots):
        row, column = starts[segment]
        where = (flat_target == j).nonzero().flatten()  # the sequence's slots, in token order
        flat_source[where] = torch.cat([torch.arange(root, dtype=torch.long),  # its first tokens: the root's
                                        row * width + column + torch.tensor(columns, dtype=torch.long)])
    return SharedPrefixRows(input_ids, position_ids, block, branch_t, source)
