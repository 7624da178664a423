"""The forwards that admit rows into a running batch (``RunningBatch``): prompts from scratch, several of similar
lengths in one left-padded forward, or continued from the keys/values a finished row left behind (``KeptTurns``).

A multi-turn episode sends each turn as a new request whose prompt is the last turn's prompt and tokens and then the
environment's reply; admitted from scratch, every turn forwards the whole conversation again (on the long-tail
benchmark's three-turn episodes, over half the engine's time). So a row that finishes leaves its keys/values (its
prompt and every token but the last, which no forward has seen yet), and a request whose prompt extends them forwards
only the rest (the decode loop queues an episode's later turns first, so few rows finish in between). At most as many
finished rows are kept as the batch has run at once, the oldest dropped first: at most the running batch's own
key/value memory again. As for a row in flight across a weight load, the kept keys/values may be earlier weights' (no older than the
episode's first token, whose version the staleness bound checks); each token's log-prob is the one it was drawn with
and its version that of the weights that drew it. Without a load in between, a continued row draws the tokens it
draws prefilled whole, to float rounding (its earlier positions were computed a step at a time rather than in one
forward).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F

from verifiers_rl.core.modeling import last_logits_only

# The most padding in one prefill forward, a fraction of its tokens: compute-bound (CPU), padding costs as real tokens.
MAX_PREFILL_PADDING = 0.25

Prompt = tuple[int, ...]
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, keys and values [rows, kv_heads, positions, head_dim]


def padded_runs(prompts: list[Prompt]) -> list[list[Prompt]]:
    """``prompts`` (sorted by length) cut into runs, each prefilled in one left-padded forward: a run grows while its
    padding stays within ``MAX_PREFILL_PADDING`` of its tokens."""
    runs: list[list[Prompt]] = []
    for prompt in prompts:
        run = runs[-1] if runs else []
        if run and (len(run) + 1) * len(prompt) * (1 - MAX_PREFILL_PADDING) <= sum(map(len, run)) + len(prompt):
            run.append(prompt)
        else:
            runs.append([prompt])
    return runs


def left_padded(prompts: list[Prompt], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` right-aligned in one ``[prompts, longest]`` tensor, left-padded with ``pad_token_id``, and its
    attention mask (1 on real tokens)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


class KeptTurns:
    """Finished rows' keys/values by their tokens (prompt and every token but the last), the newest ``max_turns``."""

    def __init__(self, max_turns: int):
        self.max_turns = max_turns
        self.turns: OrderedDict[Prompt, LayerKV] = OrderedDict()

    def keep(self, tokens: Prompt, kv: LayerKV) -> None:
        """Keep a copy of ``kv`` (per layer ``[1, kv_heads, positions, head_dim]``; the running batch's buffers are
        reused) for ``tokens``."""
        self.turns[tokens] = [(k.clone(), v.clone()) for k, v in kv]
        self.turns.move_to_end(tokens)
        while len(self.turns) > self.max_turns:
            self.turns.popitem(last=False)

    def take(self, prompt: Prompt) -> tuple[int, LayerKV] | None:
        """The longest kept turn that ``prompt`` extends (by at least its last token), out of the store, and its
        length; None if there is none."""
        best = max((t for t in self.turns if len(t) < len(prompt) and prompt[: len(t)] == t), key=len, default=None)
        return None if best is None else (len(best), self.turns.pop(best))


class Prefiller:
    """Forwards the prompts a running batch admits: their last positions' logits and, per prompt, its keys/values
    per layer ``[1, kv_heads, prompt, head_dim]`` (its real positions only: padding's are never read again).

    ``kept``: finished rows' keys/values; a prompt that extends one forwards only its new tokens (counted in
    ``stats``: ``continued`` prompts, ``reused_positions`` not forwarded again).
    """

    def __init__(self, model, pad_token_id: int, max_kept: int, stats):
        self.model, self.pad_token_id, self.stats = model, pad_token_id, stats
        self.device = model.get_input_embeddings().weight.device
        self.last_logits_only = last_logits_only(model)
        self.kept = KeptTurns(max_kept)

    def forward(self, prompts: list[Prompt]) -> tuple[torch.Tensor, list[LayerKV]]:
        """Logits ``[prompts, vocab]`` and keys/values of ``prompts`` (sorted by length), in their order: those that
        extend a kept turn continued from it (one forward), the others in ``padded_runs``."""
        found = {prompt: self.kept.take(prompt) for prompt in prompts}
        fresh = [prompt for prompt in prompts if found[prompt] is None]
        continued = [(prompt, *found[prompt]) for prompt in prompts if found[prompt] is not None]
        out: dict[Prompt, tuple[torch.Tensor, LayerKV]] = {}
        if fresh:
            out.update(zip(fresh, self._parts(self._forward, padded_runs(fresh))))
        if continued:
            self.stats.continued += len(continued)
            new = max(len(prompt) - length for prompt, length, _ in continued)  # what ``_continue`` feeds a row
            self.stats.reused_positions += sum(max(len(prompt) - new, 0) for prompt, _, _ in continued)
            out.update(zip([p for p, _, _ in continued], self._parts(self._continue, [continued])))
        return torch.stack([out[p][0] for p in prompts]), [out[p][1] for p in prompts]

    @staticmethod
    def _parts(forward, runs: list[list]) -> list[tuple[torch.Tensor, LayerKV]]:
        """``forward`` of each run, its items one by one where a run's logits are not finite; per item, in order."""
        parts = []
        for run in runs:
            logits, kv = forward(run)
            if len(run) > 1 and not bool(torch.isfinite(logits).all()):
                # A padding position's NaN (an attention kernel's fully masked row) reaches real rows as 0 x NaN.
                alone = [forward([item]) for item in run]
                logits, kv = torch.cat([a for a, _ in alone]), [b[0] for _, b in alone]
            parts += zip(logits, kv)
        return parts

    def _run(self, input_ids, mask, cache, widths: list[int]) -> tuple[torch.Tensor, list[LayerKV]]:
        """One forward of ``input_ids`` (the last columns of ``mask``) after ``cache``: the last positions' logits
        and each row's keys/values over its last ``widths[row]`` positions."""
        if cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]  # left padding not counted
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, **self.last_logits_only).logits[:, -1]
        if any(type(layer).__name__ != "DynamicLayer" for layer in cache.layers):
            raise ValueError(f"{type(self.model).__name__} has cache layers other than full attention (a sliding "
                             "window); continuous batching cannot admit rows into it. Decode it batch by batch "
                             "(EmbeddedEngine.sample).")
        return logits, [[(layer.keys[r : r + 1, :, -width:], layer.values[r : r + 1, :, -width:])
                         for layer in cache.layers] for r, width in enumerate(widths)]

    def _forward(self, prompts: list[Prompt]) -> tuple[torch.Tensor, list[LayerKV]]:
        """``prompts`` from scratch in one forward, left-padded (masked; positions count real tokens only, as a batch
        decoded together)."""
        input_ids, mask = left_padded(prompts, self.pad_token_id, self.device)
        return self._run(input_ids, mask, None, [len(p) for p in prompts])

    def _continue(self, items: list[tuple[Prompt, int, LayerKV]]) -> tuple[torch.Tensor, list[LayerKV]]:
        """Prompts continued from kept turns (``(prompt, kept length, its keys/values)``) in one forward: each row
        feeds its last ``new`` tokens (``new``: the most any prompt adds to its turn; a row's earlier positions come
        from its turn's keys/values), rows right-aligned, left-padded and masked."""
        from transformers import DynamicCache

        new = max(len(prompt) - length for prompt, length, _ in items)
        width = max(len(prompt) for prompt, _, _ in items)
        fed = [prompt[-new:] for prompt, _, _ in items]
        input_ids, _ = left_padded(fed, self.pad_token_id, self.device)  # ``new`` wide: the widest part is whole
        _, mask = left_padded([prompt for prompt, _, _ in items], self.pad_token_id, self.device)  # ``width`` wide
        cache = None
        if width > new:
            layers = []
            for i in range(len(items[0][2])):
                kept = [(turn[i], len(prompt) - len(part)) for (prompt, _, turn), part in zip(items, fed)]
                layers.append(tuple(torch.cat([F.pad(kv[which][:, :, :used], (0, 0, width - new - used, 0))
                                               for kv, used in kept]) for which in (0, 1)))
            cache = DynamicCache(ddp_cache_data=layers)
        return self._run(input_ids, mask, cache, [len(p) for p, _, _ in items])
