"""The embedded engine's decode loop over one batch: the shared prompt prefill, then one step per token.

A finished row leaves the batch; after the first step an fp32 Llama model on CPU steps through ``llama_decode``, a
Llama or Qwen2 model on a GPU through ``graph_decode``'s captured step (transformers' forward otherwise).
``EmbeddedEngine`` builds the batch and owns the weights; this class only decodes it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from verifiers_rl.core.engine import Sample
from verifiers_rl.core.modeling import last_logits_only
from verifiers_rl.inference.kernels.graph_decode import GraphDecoder
from verifiers_rl.inference.kernels.graph_decode import supports as graph_decode_supports
from verifiers_rl.inference.kernels.llama_decode import LlamaDecoder

if TYPE_CHECKING:
    from verifiers_rl.inference.embedded.engine import RowSampler

# A batch's root (the common first tokens of its distinct prompts) shorter than this is prefilled with each prompt:
# chat templates make every prompt start with a few equal tokens, not worth a forward of their own.
MIN_ROOT_TOKENS = 16


class BatchDecoder:
    """Decodes left-padded batches of prompts with ``model`` (``EmbeddedEngine``'s options of the same names).

    Counts what sharing saved: ``prefills_shared`` (requests that reused another's prompt keys/values) and
    ``root_tokens_shared`` (prompt tokens not prefilled again thanks to the batches' roots).
    """

    def __init__(self, model, eos_token_ids: list[int], *, share_prompt_prefill: bool, repetition_penalty: float,
                 llama_decode: bool, cuda_graphs: bool, generate_in_loop_thread: bool):
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.share_prompt_prefill = share_prompt_prefill
        self.repetition_penalty = repetition_penalty
        self.llama_decode = llama_decode
        self.cuda_graphs = cuda_graphs
        self.generate_in_loop_thread = generate_in_loop_thread
        self.prefills_shared = 0
        self.root_tokens_shared = 0
        self._last_logits_only = last_logits_only(model)

    def decode(self, input_ids, attention_mask, prompts, max_new_tokens: list[int], sampler: RowSampler,
                root: int = 0, linear=None):
        """Sample every row until it draws an eos token or reaches its own ``max_new_tokens``. A finished row leaves
        the batch (its keys and values are dropped), so later decode steps compute only the rows still running:
        with completions of mixed lengths most steps run on part of the batch. A row's tokens depend on its own
        logits and noise only (``RowSampler``), never on when the others finish. ``linear``: the lean step's
        linear layers (``EmbeddedEngine._linear``)."""
        from transformers import DynamicCache

        cache = self.shared_prefill(input_ids, attention_mask, prompts, root)
        step_ids = input_ids if cache is None else input_ids[:, -1:]  # a shared prefill holds all but the last
        cache = DynamicCache(config=self.model.config) if cache is None else cache
        decoder = None  # the lean step (llama_decode, graph_decode) once the first step has filled the cache
        rows = list(range(len(prompts)))  # the batch rows still decoding, in the order of the tensors below
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        samples: list[Sample] = [None] * len(prompts)  # type: ignore[list-item]  (each set when its row ends)
        context, mask = input_ids, attention_mask  # the running rows' prompt and tokens (the penalty's context)
        while rows:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]  # left padding not counted
            if decoder is not None:
                logits = decoder.step(step_ids[:, 0], positions[:, 0], mask)
            else:
                logits = self.model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                                    past_key_values=cache, use_cache=True, **self._last_logits_only).logits[:, -1]
                capacity = mask.shape[1] + max(max_new_tokens)
                if self.cuda_graphs and self.generate_in_loop_thread and graph_decode_supports(self.model):
                    decoder = GraphDecoder(self.model, cache, capacity)
                elif self.llama_decode:
                    decoder = LlamaDecoder(self.model, cache, capacity, linear)
            drawn, drawn_logps = sampler.draw(context, logits, rows)
            running = []
            for i, (row, token, logp) in enumerate(zip(rows, drawn.tolist(), drawn_logps.tolist())):
                tokens[row].append(token)
                logprobs[row].append(logp)
                if token in self.eos_token_ids:
                    samples[row] = Sample(tokens[row], logprobs[row], "stop")
                elif len(tokens[row]) == max_new_tokens[row]:
                    samples[row] = Sample(tokens[row], logprobs[row], "length")
                else:
                    running.append(i)
            step_ids = drawn[:, None]
            context = torch.cat([context, step_ids], dim=1)
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
            if len(running) < len(rows):
                index = torch.tensor(running, dtype=torch.long, device=input_ids.device)
                if decoder is not None:
                    decoder.keep(index)
                else:
                    cache.batch_select_indices(index)
                step_ids, context, mask = step_ids[index], context[index], mask[index]
                rows = [rows[i] for i in running]
        return samples

    def root_length(self, prompts: list[list[int]]) -> int:
        """Tokens of the batch's root: the common prefix of its distinct prompts (a system prompt they all start
        with; their last positions excluded), prefilled once for all of them (``shared_prefill``). 0 when prompt
        sharing is off, the prompts are all one, the root is under ``MIN_ROOT_TOKENS``, or a repetition penalty
        is set (its context skips left padding only; the root puts padding after it)."""
        distinct = {tuple(prompt[:-1]) for prompt in prompts}
        if not self.share_prompt_prefill or len(distinct) < 2 or self.repetition_penalty != 1:
            return 0
        root = len(os.path.commonprefix(list(distinct)))  # element-wise: any sequences, not only paths
        return root if root >= MIN_ROOT_TOKENS else 0

    def shared_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompts: list[list[int]],
                        root: int = 0):
        """When requests share a prompt (a group's samples), run each distinct prompt once (all but its last
        position) and give every request a copy of its keys/values; decoding then computes only the rest. With a
        ``root`` (the distinct prompts' common first tokens, at the start of every row, ``EmbeddedEngine._generate``), it runs once
        and the distinct prompts continue from copies of its keys/values. The logits are those of the unshared
        computation (to float rounding), so sampling is unchanged. ``None`` when nothing is shared (or
        ``share_prompt_prefill`` is off)."""
        from transformers import DynamicCache

        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts]
        if not self.share_prompt_prefill or (len(distinct) == len(prompts) and not root) or input_ids.shape[1] < 2:
            return None
        first = [rows.index(row) for row in range(len(distinct))]  # one request of each distinct prompt
        mask = attention_mask[first, :-1]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding not counted, as in decode
        cache = DynamicCache(config=self.model.config)
        # Only the keys/values are wanted: the decoder alone, without the output layer (vocabulary-wide logits of
        # every prompt position would be a large part of a short generation).
        decoder = self.model.get_decoder()
        if root:
            decoder(input_ids=input_ids[:1, :root], position_ids=positions[:1, :root], past_key_values=cache,
                    use_cache=True)
            cache.reorder_cache(torch.zeros(len(first), dtype=torch.long, device=input_ids.device))
            self.root_tokens_shared += root * (len(first) - 1)
        decoder(input_ids=input_ids[first, root:-1], attention_mask=mask, position_ids=positions[:, root:],
                past_key_values=cache, use_cache=True)
        cache.reorder_cache(torch.tensor(rows, device=input_ids.device))  # each request gets its prompt's copy
        self.prefills_shared += len(prompts) - len(distinct)
        return cache
