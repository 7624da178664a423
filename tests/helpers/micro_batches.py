"""Per-sequence tensors laid out as a micro-batch's rows and back (the loss tests' independent references)."""

import itertools

import torch


def scatter_to_micro_batch(mb, per_sequence):
    """Lay per-sequence tensors (indexed by batch position, token position) out as the micro-batch's [R, T]."""
    out = torch.zeros(mb.input_ids.shape)
    for r, t in itertools.product(range(mb.input_ids.shape[0]), range(mb.input_ids.shape[1])):
        local = int(mb.seq_index[r, t])
        if local >= 0:
            out[r, t] = per_sequence[mb.batch_positions[local]][int(mb.position_ids[r, t])]
    return out


def gather_from_micro_batch(mb, leaf_logps):
    """Current log-probs in micro-batch layout, built from the per-sequence leaves so gradients flow to them."""
    rows = []
    for r in range(mb.input_ids.shape[0]):
        row = []
        for t in range(mb.input_ids.shape[1]):
            local = int(mb.seq_index[r, t])
            row.append(leaf_logps[mb.batch_positions[local]][int(mb.position_ids[r, t])] if local >= 0 else torch.zeros(()))
        rows.append(torch.stack(row))
    return torch.stack(rows)
