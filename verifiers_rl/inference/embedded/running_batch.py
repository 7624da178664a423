"""Continuous batching in the embedded engine: a decode batch that admits new rows between decode steps.

``BatchDecoder`` decodes one batch to its end: rows leave as they finish, none joins, so a long-tailed batch ends
decoding a few rows. ``RunningBatch`` keeps up to ``max_rows`` rows decoding: before each step, requests waiting in
its queue are prefilled (``prefill.py``: a distinct prompt once; prompts of similar lengths in one left-padded
forward, as a batch decoded together prefills them; an episode's next turn from the keys/values its last turn's row
left) and their first tokens drawn, and they join the running rows. Rows are right-aligned
(left padding, masked); a newcomer longer than the batch pads the running rows on the left. Each row samples with its
own seeded generator (``RowSampler``), so a row admitted mid-way draws the tokens it would draw decoded alone under the
same seed (log-probs to float rounding).

Decode steps run through the lean Llama step (``llama_decode``) where the engine uses it, else through transformers'
forward on a ``DynamicCache`` (rebuilt at each admission); never through a captured CUDA graph (its shapes are
fixed). The lean step's key/value buffers hold twice the rows running when they are built (at most ``max_rows``): a
newcomer whose prompt fits left of the running rows' newest position, with room for its tokens, is written into a
free row (no rebuild); a leaving row's place is taken by the last running row. Otherwise (a longer prompt, no room
left, or the columns no row reads grown to half the width) the buffers are rebuilt, those columns dropped. Models
whose cache layers are not plain full-attention layers (sliding windows) are refused. Weights loaded between two
steps apply to the next step (the lean step reads the model's parameters at each call); the rows in flight keep the
keys/values the earlier weights computed, and each ``Sample.versions`` records which version drew each token. A
batch may serve for a whole run (``decode_loop``): a finished or cancelled request's state is dropped, and its
sampler row is reused by the next admitted one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from verifiers_rl.core.engine import Sample
from verifiers_rl.inference.embedded.prefill import Prefiller, left_padded
from verifiers_rl.inference.kernels.llama_decode import LlamaDecoder

if TYPE_CHECKING:
    from verifiers_rl.inference.embedded.engine import RowSampler


@dataclass
class DecodeRequest:
    """One completion to decode: ``seed`` seeds the row's own generator (None: torch's global one)."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    seed: int | None = None


@dataclass
class Newcomers:
    """Rows prefilled for admission: their keys/values per layer ``[rows, kv_heads, prompt, head_dim]`` (one prompt
    length), their context (prompt + first token) and ids."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    context: torch.Tensor
    ids: list[int]


@dataclass
class RunningBatchStats:
    """``admissions``: rows that joined a batch already decoding; ``rows_per_step``: rows each decode step ran;
    ``waiting_per_step``: requests still queued at each step; ``rebuilds``: key/value buffers rebuilt to admit rows
    (the lean step; the others admitted into free rows); ``continued``: requests prefilled from a finished row's
    keys/values (``prefill.KeptTurns``: an episode's next turn), ``reused_positions``: the positions they did not
    forward again."""

    admissions: int = 0
    rebuilds: int = 0
    continued: int = 0
    reused_positions: int = 0
    rows_per_step: list[int] = field(default_factory=list)
    waiting_per_step: list[int] = field(default_factory=list)


class RunningBatch:
    """Decodes the requests ``add`` queues, at most ``max_rows`` at a time; ``step`` admits, then decodes one token.

    ``sampler``: an empty ``RowSampler`` (a row per running request, reused once it finishes); ``linear``: the lean
    step's linear layers (``EmbeddedEngine._linear``); ``version``: the engine's policy version, recorded for every
    token in its ``Sample.versions`` (the weights that sampled it). Call ``step`` and ``cancel`` with the engine's
    weights held still (its lock).
    """

    def __init__(self, model, eos_token_ids: list[int], sampler: RowSampler, max_rows: int, pad_token_id: int, *,
                 llama_decode: bool, linear=None, version: Callable[[], int] = lambda: 0):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}.")
        self.model, self.eos_token_ids, self.sampler = model, eos_token_ids, sampler
        self.max_rows, self.pad_token_id = max_rows, pad_token_id
        self.llama_decode, self.linear, self.version = llama_decode, linear, version
        self.device = model.get_input_embeddings().weight.device
        self.queue: deque[tuple[int, DecodeRequest]] = deque()
        # Per request not yet finished, by request id (dropped when it finishes or is cancelled).
        self.requests: dict[int, DecodeRequest] = {}
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.versions: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}  # the sampler row of each admitted request
        self._free_slots: list[int] = []
        self._next_id = 0
        self.stats = RunningBatchStats()
        self.rows: list[int] = []  # request ids of the running rows, in the order of the tensors below
        self.context = self.mask = None  # [rows, width]: prompt + tokens, left-padded; 1 on real tokens
        self.kv = None  # a LlamaDecoder, or a DynamicCache holding every position but the last
        # Kept turns: as many as the most rows run at once (``_admit``), not max_rows, which may be far above them.
        self.prefill = Prefiller(model, pad_token_id, 0, self.stats)

    def add(self, request: DecodeRequest) -> int:
        """Queue ``request``; its id (ids count up from 0 in the order requests are added)."""
        rid, self._next_id = self._next_id, self._next_id + 1
        self.requests[rid] = request
        self.tokens[rid], self.logprobs[rid], self.versions[rid] = [], [], []
        self.queue.append((rid, request))
        return rid

    def cancel(self, rid: int) -> None:
        """Drop request ``rid``: out of the queue, or its row out of the running batch (nothing if it finished)."""
        if rid in self.rows:
            self._keep([i for i, other in enumerate(self.rows) if other != rid])
        else:
            self.queue = deque(item for item in self.queue if item[0] != rid)
        self._forget(rid)

    @property
    def pending(self) -> int:
        """Requests queued or decoding."""
        return len(self.queue) + len(self.rows)

    def _slot(self, rid: int) -> int:
        """A sampler row for request ``rid`` (a finished request's, where one is free), seeded by its request."""
        request = self.requests[rid]
        if self._free_slots:
            slot = self._free_slots.pop()
            self.sampler.set_row(slot, request.temperature, request.seed)
        else:
            slot = self.sampler.add_row(request.temperature, request.seed)
        self.slots[rid] = slot
        return slot

    def _forget(self, rid: int) -> None:
        for table in (self.requests, self.tokens, self.logprobs, self.versions):
            table.pop(rid, None)
        slot = self.slots.pop(rid, None)
        if slot is not None:
            self._free_slots.append(slot)

    @property
    def done(self) -> bool:
        return not self.queue and not self.rows

    @property
    def forwards_model(self) -> bool:
        """Whether the next ``step`` runs the model's own forward: a prefill to admit queued requests into free
        rows, or a decode step without the lean Llama step (which computes through its ``linear`` alone). The engine
        swaps the layers' forward (``cpu_linears``, a walk over every module) only for these steps."""
        return bool(self.queue) and len(self.rows) < self.max_rows or not isinstance(self.kv, LlamaDecoder)

    @torch.no_grad()
    def step(self) -> dict[int, Sample]:
        """Admit queued requests into free rows, then decode one token for every running row; the samples finished
        meanwhile, by request id."""
        finished: dict[int, Sample] = {}
        self._admit(finished)
        if not self.rows:
            return finished
        self.stats.rows_per_step.append(len(self.rows))
        self.stats.waiting_per_step.append(len(self.queue))
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -1]  # left padding not counted
        step_ids = self.context[:, -1]
        if isinstance(self.kv, LlamaDecoder):
            logits = self.kv.step(step_ids, positions, self.mask)
        else:
            logits = self.model(input_ids=step_ids[:, None], attention_mask=self.mask, position_ids=positions[:, None],
                                past_key_values=self.kv, use_cache=True, **self.prefill.last_logits_only).logits[:, -1]
        self._set_padding()
        drawn, logps = self.sampler.draw(self.context, logits, [self.slots[rid] for rid in self.rows])
        running = self._record(self.rows, drawn, logps, finished)
        if len(running) < len(self.rows):
            self._keep_turns(running)  # before the drawn tokens join the context: no forward has seen them
        self.context = torch.cat([self.context, drawn[:, None]], dim=1)
        self.mask = F.pad(self.mask, (0, 1), value=1)
        if len(running) < len(self.rows):
            self._keep(running)
        return finished

    def _keep_turns(self, running: list[int]) -> None:
        """The keys/values of each row this step finished (all but ``running``), kept for its episode's next turn
        under the row's real tokens, its prompt and every token but the one just drawn (``prefill.KeptTurns``)."""
        kv, still = self._current_kv(), set(running)
        for i in range(len(self.rows)):
            if i not in still:
                n = int(self.mask[i].sum())
                self.prefill.kept.keep(tuple(self.context[i, -n:].tolist()),
                                       [(k[i : i + 1, :, -n:], v[i : i + 1, :, -n:]) for k, v in kv])

    def _keep(self, positions: list[int]) -> None:
        """Keep only the running rows at ``positions`` (the others finished or were cancelled)."""
        if not positions:
            self.rows, self.context, self.mask, self.kv = [], None, None, None
            return
        if isinstance(self.kv, LlamaDecoder):
            # The rows past the new count move into the leaving rows' places: only they are copied.
            count, kept = len(positions), set(positions)
            holes = [p for p in range(count) if p not in kept]
            movers = [p for p in positions if p >= count]
            order = list(range(count))
            for hole, mover in zip(holes, movers):
                order[hole] = mover
            self.kv.fill_holes(torch.tensor(holes, dtype=torch.long, device=self.device),
                               torch.tensor(movers, dtype=torch.long, device=self.device), count)
            positions = order
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        if not isinstance(self.kv, LlamaDecoder):
            self.kv.batch_select_indices(index)
        self.context, self.mask = self.context[index], self.mask[index]
        self.rows = [self.rows[i] for i in positions]

    def _record(self, rows: list[int], drawn: torch.Tensor, logps: torch.Tensor, finished: dict) -> list[int]:
        """Append each row's token; rows that finish go to ``finished``; the positions of those still running."""
        running, version = [], self.version()
        for i, (rid, token, logp) in enumerate(zip(rows, drawn.tolist(), logps.tolist())):
            self.tokens[rid].append(token), self.logprobs[rid].append(logp), self.versions[rid].append(version)
            stop = token in self.eos_token_ids
            if stop or len(self.tokens[rid]) == self.requests[rid].max_new_tokens:
                finished[rid] = Sample(self.tokens[rid], self.logprobs[rid], "stop" if stop else "length",
                                       self.versions[rid])
                self._forget(rid)
            else:
                running.append(i)
        return running

    def _set_padding(self) -> None:
        """Each running row's left padding, for the repetition penalty's context (it changes as rows join)."""
        if self.sampler.repetition_penalty != 1:
            slots = [self.slots[rid] for rid in self.rows]
            self.sampler.pad[slots] = (self.mask.shape[1] - self.mask.sum(-1)).cpu()

    def _admit(self, finished: dict[int, Sample]) -> None:
        """Prefill queued requests (each distinct prompt once, similar lengths in one forward) and draw their first
        tokens until ``max_rows`` rows run or the queue is empty; those not finished by their first token join the
        running rows."""
        joining: list[Newcomers] = []
        free = self.max_rows - len(self.rows)
        while self.queue and free > 0:  # again only where rows finished at their first token
            groups: dict[tuple[int, ...], list[int]] = {}
            for _ in range(min(free, len(self.queue))):
                rid, request = self.queue.popleft()
                groups.setdefault(tuple(request.prompt_ids), []).append(rid)
            newcomers = self._prefill(groups, finished)
            joining += newcomers
            free -= sum(len(group.ids) for group in newcomers)
        if joining:
            self.stats.admissions += sum(len(group.ids) for group in joining) if self.rows else 0
            self._join(joining)
            kept = self.prefill.kept
            kept.max_turns = max(kept.max_turns, len(self.rows))

    def _prefill(self, groups: dict[tuple[int, ...], list[int]], finished: dict[int, Sample]) -> list[Newcomers]:
        """Each distinct prompt (``groups``' keys) forwarded once (``Prefiller.forward``: similar lengths in one
        left-padded forward, a next turn from its last turn's keys/values); each request of a prompt draws its first
        token from its logits (its row's sampler, as decoded alone) and gets a copy of its keys/values. The groups of
        requests not finished at once (none where all finished)."""
        prompts = sorted(groups, key=len)
        logits, kv = self.prefill.forward(prompts)
        width = len(prompts[-1])
        owners = [i for i, prompt in enumerate(prompts) for _ in groups[prompt]]
        ids = [rid for prompt in prompts for rid in groups[prompt]]
        owner = torch.tensor(owners, dtype=torch.long, device=self.device)
        padded, _ = left_padded(prompts, self.pad_token_id, self.device)
        slots = [self._slot(rid) for rid in ids]
        self.sampler.pad[slots] = torch.tensor([width - len(prompts[i]) for i in owners])  # the penalty skips it
        drawn, logps = self.sampler.draw(padded[owner], logits[owner], slots)
        running = self._record(ids, drawn, logps, finished)
        newcomers = []
        for g, prompt in enumerate(prompts):
            rows = [i for i in running if owners[i] == g]
            if rows:
                context = torch.cat([padded[g, width - len(prompt):].expand(len(rows), -1), drawn[rows, None]], dim=1)
                newcomers.append(Newcomers([(k.expand(len(rows), -1, -1, -1), v.expand(len(rows), -1, -1, -1))
                                            for k, v in kv[g]], context, [ids[i] for i in rows]))
        return newcomers

    def _current_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if isinstance(self.kv, LlamaDecoder):
            rows, length = self.kv.rows, self.kv.length
            return [(k[:rows, :, :length], v[:rows, :, :length]) for k, v in zip(self.kv.keys, self.kv.values)]
        return [(layer.keys, layer.values) for layer in self.kv.layers]

    def _join(self, groups: list[Newcomers]) -> None:
        """The running rows and the newcomers as one right-aligned batch (left padding, masked), its keys/values
        rebuilt for the decode step (unless they fit into the lean step's free rows)."""
        from transformers import DynamicCache

        if self._join_in_place(groups):
            return
        parts, masks = list(groups), [torch.ones_like(group.context) for group in groups]
        if self.rows:
            # Columns no running row uses any more (the left padding of rows that left) are dropped.
            first = int((self.mask.sum(0) > 0).nonzero()[0])
            parts.insert(0, Newcomers([(k[:, :, first:], v[:, :, first:]) for k, v in self._current_kv()],
                                      self.context[:, first:], self.rows))
            masks.insert(0, self.mask[:, first:])
        width = max(part.context.shape[1] for part in parts)
        contexts, layers = [], [[] for _ in parts[0].kv]
        for i, part in enumerate(parts):
            pad = width - part.context.shape[1]
            contexts.append(F.pad(part.context, (pad, 0), value=self.pad_token_id))
            masks[i] = F.pad(masks[i], (pad, 0), value=0)
            for layer, (k, v) in zip(layers, part.kv):
                layer.append((F.pad(k, (0, 0, pad, 0)), F.pad(v, (0, 0, pad, 0))))
        self.context, self.mask = torch.cat(contexts), torch.cat(masks)
        self.rows = [rid for part in parts for rid in part.ids]
        cache = DynamicCache(ddp_cache_data=[(torch.cat([k for k, _ in layer]), torch.cat([v for _, v in layer]))
                                             for layer in layers])
        if self.llama_decode:
            # Room for the tokens left, and as many again: later newcomers then fit without a rebuild.
            left = max(self.requests[rid].max_new_tokens - len(self.tokens[rid]) for rid in self.rows)
            # Rows for as many newcomers again, up to max_rows: a max_rows far above the rows a run ever holds
            # would otherwise allocate its whole size at every rebuild.
            rows = min(self.max_rows, 2 * len(self.rows))
            self.kv = LlamaDecoder(self.model, cache, width + 2 * left, self.linear, max_rows=rows)
            self.stats.rebuilds += 1
        else:
            self.kv = cache

    def _join_in_place(self, groups: list[Newcomers]) -> bool:
        """Write the newcomers' keys/values into the lean step's free rows, right-aligned with the running rows
        (left padding zeroed: a masked position must hold no NaN, 0 x NaN is NaN); False where they do not fit."""
        kv = self.kv
        if not isinstance(kv, LlamaDecoder) or not self.rows:
            return False
        length, capacity = kv.length, kv.keys[0].shape[2]
        ids = [rid for group in groups for rid in group.ids]
        left = max(self.requests[rid].max_new_tokens - len(self.tokens[rid]) for rid in ids)
        longest = max(group.context.shape[1] - 1 for group in groups)
        used = min(int((self.mask.sum(0) > 0).nonzero()[0]), length - longest)  # the first column any row reads
        # A rebuild drops the columns no row reads: once they are half the width, every step's attention pays more.
        if (kv.rows + len(ids) > kv.keys[0].shape[0] or length + left > capacity or longest > length
                or used > length // 2):
            return False
        contexts, masks, row = [self.context], [self.mask], kv.rows
        for group in groups:
            prompt, end = group.context.shape[1] - 1, row + len(group.ids)
            for keys, values, (k, v) in zip(kv.keys, kv.values, group.kv):
                keys[row:end, :, : length - prompt].zero_()
                values[row:end, :, : length - prompt].zero_()
                keys[row:end, :, length - prompt : length] = k
                values[row:end, :, length - prompt : length] = v
            pad = length - prompt
            contexts.append(F.pad(group.context, (pad, 0), value=self.pad_token_id))
            masks.append(F.pad(torch.ones_like(group.context), (pad, 0), value=0))
            row = end
        kv.rows = row
        self.context, self.mask = torch.cat(contexts), torch.cat(masks)
        self.rows = self.rows + ids
        return True
