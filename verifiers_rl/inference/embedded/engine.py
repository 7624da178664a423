"""The embedded engine: a transformers model decoding on the engine's own copy of the weights (default on
CPU).

Concurrent ``sample`` calls from the coroutines of one event loop are batched (``request_batcher``) and decoded as one
left-padded batch in a worker thread, so the loop keeps serving environments while the model runs. The decode loop is
the engine's own (not ``generate``): a finished row leaves the batch, and after the first step an fp32 Llama model on
CPU steps through ``llama_decode``, a Llama or Qwen2 model on a GPU through ``graph_decode``'s captured step
(transformers' forward otherwise).
Weight loads are staged and applied at once (``staged_weights``). ``generate_continuous`` decodes a list of requests
with continuous batching instead (``running_batch``: rows admitted into the running batch as others finish), and
with ``continuous_rows`` the engine serves every ``sample`` that way (``decode_loop``).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Literal

import torch

from verifiers_rl.compat import without_zero3_init
from verifiers_rl.inference.kernels.cpu_matmul import PackedWeights, cpu_linears, packs_available, weight_major
from verifiers_rl.core.modeling import sequence_logprobs, unwrap
from verifiers_rl.core.models import load_causal_lm, tokenizer_kwargs
from verifiers_rl.core.engine import (EngineClosedError, Sample, SamplingConfig, check_open, check_token_ids,
                                      rollout_sampling)
from verifiers_rl.inference.embedded.batch_decode import BatchDecoder
from verifiers_rl.inference.kernels.llama_decode import supports as llama_decode_supports
from verifiers_rl.inference.embedded.decode_loop import DecodeLoop, LoadGate
from verifiers_rl.inference.embedded.request_batcher import Request, RequestBatcher
from verifiers_rl.inference.embedded.running_batch import DecodeRequest, RunningBatch, RunningBatchStats
from verifiers_rl.inference.embedded.staged_weights import StagedWeights

# Draws the odd rows' Gumbel noise beside the caller's even rows: a CPU generator's draw is serial and a
# vocabulary-wide row per decode step adds up, so a second core halves it. Values are unchanged: each row still draws
# from its own generator.
_NOISE_DRAWS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noise")


@dataclass
class ContinuousRun:
    """``EmbeddedEngine.generate_continuous``'s answer: a sample per request (in order), the policy version that
    sampled each of its tokens, and how full the running batch was."""

    samples: list[Sample]
    versions: list[list[int]]
    stats: RunningBatchStats


class RowSampler:
    """Samples every row of a batch on its own: token = argmax_v(l_v + g_v), g_v ~ Gumbel(0, 1), where l is the
    row's sampling distribution as logits (below), which draws exactly from softmax(l) (the Gumbel-max trick). A row
    with a seed draws its noise from its own generator: its tokens do not depend on the rows it is batched with or
    on global random state.

    l is vLLM's: the repetition penalty on the raw logits (HF's processor, over the row's prompt and generated
    tokens, its left padding skipped), then / T, then min-p, top-k, top-p (HF's warpers). Rows with temperature 0
    take the argmax of the penalised logits (greedy), and their l is those logits (the filters do not apply, as in
    vLLM). ``draw`` gives the tokens of the rows still decoding and log softmax(l) at them.
    """

    def __init__(self, temperatures: list[float], seeds: list[int | None], top_k: int, top_p: float,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, pad_lengths: list[int] | None = None,
                 device: torch.device | str = "cpu"):
        from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.temperatures = torch.tensor(temperatures, dtype=torch.float32)
        # The noise is drawn where the logits are: on a GPU, a [rows, vocab] draw on the CPU and its copy cost more
        # than the decode step's kernels. A seed gives the same tokens on the same kind of device.
        self.device = torch.device(device)
        self.generators = [None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
                           for seed in seeds]
        # vLLM's order (min-p before top-k / top-p): both engines then sample from the same distribution.
        self.filters = [MinPLogitsWarper(float(min_p))] if min_p else []
        self.filters += ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
        self.pad = torch.tensor(pad_lengths or [0] * len(temperatures))  # left padding is no token of the row's text
        self.repetition_penalty = float(repetition_penalty)

    def add_row(self, temperature: float, seed: int | None) -> int:
        """A new row (``RunningBatch`` admits rows as others finish); its index."""
        self.temperatures = torch.cat([self.temperatures, torch.tensor([float(temperature)])])
        self.generators.append(None)
        self.pad = torch.cat([self.pad.long(), torch.zeros(1, dtype=torch.long)])
        self.set_row(len(self.generators) - 1, temperature, seed)
        return len(self.generators) - 1

    def set_row(self, row: int, temperature: float, seed: int | None) -> None:
        """Row ``row`` samples anew for another request (a finished one's row reused)."""
        self.temperatures[row] = float(temperature)
        self.generators[row] = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        self.pad[row] = 0

    def distribution(self, input_ids: torch.Tensor, scores: torch.Tensor, rows: list[int]):
        """(l, noisy scores) for the batch rows ``rows`` (``input_ids`` and ``scores`` hold just those rows): l as
        above, and the scores whose argmax is the sample (l + Gumbel noise; l itself for greedy rows)."""
        logits = scores.float()
        if self.repetition_penalty != 1:
            from transformers import RepetitionPenaltyLogitsProcessor

            penalty = RepetitionPenaltyLogitsProcessor(self.repetition_penalty, prompt_ignore_length=self.pad[rows])
            logits = penalty(input_ids, logits)
        temperatures = self.temperatures[rows]
        sampled = temperatures > 0
        if not bool(sampled.any()):
            return logits, logits
        # x / 1 is x: the common temperature-1 batch skips a pass over [rows, vocab].
        filtered = logits if bool((temperatures == 1).all()) else logits / torch.where(
            sampled, temperatures, 1.0)[:, None].to(scores.device)
        for keep in self.filters:
            filtered = keep(input_ids, filtered)
        # Each row's uniforms from its own generator (as torch.rand(vocab, generator=...) draws them), then
        # log(-log u) = -g in place: l + g is l - log(-log u) to the bit, without the temporaries.
        noise = torch.empty(len(rows), scores.shape[-1], device=self.device)
        self._uniforms(noise, rows)
        noise.clamp_min_(torch.finfo(torch.float32).tiny).log_().neg_().log_()
        noisy = filtered - noise.to(scores.device)
        if bool(sampled.all()):
            return filtered, noisy
        return torch.where(sampled[:, None], filtered, logits), torch.where(sampled[:, None], noisy, logits)

    def _uniforms(self, noise: torch.Tensor, rows: list[int]) -> None:
        """Row i of ``noise``: U(0, 1) from row ``rows[i]``'s generator (the global one where unseeded)."""
        def fill(positions: range) -> None:
            for i in positions:
                noise[i].uniform_(generator=self.generators[rows[i]])

        unseeded = any(self.generators[row] is None for row in rows)  # the global generator: one thread, in order
        if self.device.type != "cpu" or unseeded or len(rows) < 4 or torch.get_num_threads() < 2:
            fill(range(len(rows)))
            return
        odd = _NOISE_DRAWS.submit(fill, range(1, len(rows), 2))
        fill(range(0, len(rows), 2))
        odd.result()

    def draw(self, input_ids: torch.Tensor, scores: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each row of ``rows`` and its log-prob under l (``distribution``)."""
        processed, noisy = self.distribution(input_ids, scores, rows)
        tokens = noisy.argmax(-1)
        return tokens, torch.log_softmax(processed, dim=-1).gather(-1, tokens[:, None])[:, 0]


def _own_copy(model, dtype: torch.dtype, load_kwargs: dict) -> tuple[str, torch.nn.Module]:
    """The engine's name for ``model`` and its own copy of it: loaded from a name/folder, or a deep copy."""
    if isinstance(model, (str, Path)):
        with without_zero3_init():
            return str(model), load_causal_lm(str(model), dtype, **load_kwargs)
    inner = unwrap(model)
    if any(hasattr(p, "ds_id") for p in inner.parameters()):
        # A ZeRO-3 model holds only this rank's shards; a copy of it would be empty.
        raise ValueError("Pass a model name or folder (not a DeepSpeed ZeRO-3 model) to build the engine.")
    return str(getattr(inner, "name_or_path", "") or type(inner).__name__), copy.deepcopy(inner)


class EmbeddedEngine:
    """An ``InferenceEngine`` decoding a transformers model in-process, on its own copy of the weights.

    Args:
        model: a model (deep-copied, wrappers removed) or a name/folder for ``AutoModelForCausalLM``.
        tokenizer: a tokenizer or a name/folder (default: the model's folder); gives the pad and eos ids.
        sampling: temperature / top_p / top_k / min_p / repetition_penalty / default ``max_new_tokens``.
        max_batch_size: most requests decoded together.
        dtype: when loading from a name/folder (default float32).
        load_kwargs: ``from_pretrained``'s other arguments when loading from a name/folder (which revision,
            subfolder, remote code: ``factory.model_load_kwargs``).
        generate_in_loop_thread: decode on the event loop's own thread (blocking the loop meanwhile)
            instead of a worker thread. For synchronous generation (k = 0) on the trainer's thread: on CPU every
            extra thread that runs torch ops gets its own OpenMP team, the teams oversubscribe the cores, and
            decoding's many small ops then run slower (benchmarks/async_generation.py).
        cpu_matmuls: how fp32 linear layers on CPU multiply while generating (``cpu_matmul``; all equal to
            ``F.linear`` to float rounding): ``packed`` with oneDNN-packed copies of the weights (re-packed after
            each weight load; the fastest at decode shapes where oneDNN exists), ``weight_major`` as ``(W x^T)^T``
            (faster decode steps than ``F.linear``), ``linear`` as ``F.linear``; ``auto``: ``packed`` where torch has
            oneDNN, else ``weight_major`` (benchmarks/embedded_decode.py measures them).
        share_prompt_prefill: requests decoded together that share a prompt (a group) prefill it once and
            decode from copies of its keys/values.
        llama_decode: decode steps of a plain fp32 Llama model on CPU run ``llama_decode``'s lean step (the same
            mathematics in fewer ops, keys/values in preallocated buffers) instead of transformers' forward. Checked
            when the engine is built: a model ``make_engine`` then moves to a GPU keeps the lean step there where it
            captures no graph (k >= 1; tests/gpu's live runs).
        cuda_graphs: decode steps of a Llama or Qwen2 model on a GPU replay one captured CUDA graph per batch
            (``graph_decode``: the lean step with fixed shapes; a GPU decode step is otherwise bound by its kernel
            launches), when the engine decodes on the caller's thread (``generate_in_loop_thread``: synchronous
            generation, k = 0). On a worker thread (k >= 1) it does not: a capture makes any device-wide
            synchronisation another thread makes meanwhile fail (``torch.cuda.synchronize``, a ``cudaFree``), and
            training runs beside it there.
        continuous_rows: 0 (default): ``sample`` calls batch by batch, as above. N >= 1: served continuously
            (``decode_loop``: one running batch of at most N rows on its own thread, requests from any loop joining
            between steps, weight loads landing between steps, ``Sample.versions`` per token); prompt roots, CUDA
            graphs and ``generate_in_loop_thread`` do not apply there.

    Log-probs are those of the distribution each token was drawn from (``RowSampler``: the penalised, tempered,
    filtered and renormalised softmax; with the default ``sampling``, the full softmax at the sampling temperature;
    with temperature 0, greedy decoding, the penalised logits at temperature 1), taken at each step: no step's
    vocabulary-wide logits outlive it.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        sampling: SamplingConfig | None = None,
        max_batch_size: int = 64,
        dtype: torch.dtype = torch.float32,
        generate_in_loop_thread: bool = False,
        share_prompt_prefill: bool = True,
        cpu_matmuls: Literal["auto", "packed", "weight_major", "linear"] = "auto",
        llama_decode: bool = True,
        cuda_graphs: bool = True,
        continuous_rows: int = 0,
        load_kwargs: dict | None = None,
    ):
        from transformers import AutoTokenizer

        self.model_name, self.model = _own_copy(model, dtype, load_kwargs or {})
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            name = str(tokenizer or self.model_name)
            tokenizer = AutoTokenizer.from_pretrained(name, **tokenizer_kwargs(load_kwargs))
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingConfig()
        self.max_batch_size = max_batch_size
        self.generate_in_loop_thread = generate_in_loop_thread
        self.share_prompt_prefill = share_prompt_prefill
        if cpu_matmuls == "auto":
            cpu_matmuls = "packed" if packs_available() else "weight_major"
        if cpu_matmuls not in ("packed", "weight_major", "linear"):
            raise ValueError(f"cpu_matmuls must be auto, packed, weight_major or linear, not {cpu_matmuls!r}.")
        self.cpu_matmuls = cpu_matmuls
        self._packs = PackedWeights(self.model) if cpu_matmuls == "packed" else None
        self.llama_decode = llama_decode and llama_decode_supports(self.model)
        self.cuda_graphs = cuda_graphs  # where it applies is known once the model is on its device (make_engine)
        self.model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
            param.grad = None
        self._weights = StagedWeights(self.model)

        gen = self.model.generation_config
        eos = gen.eos_token_id if gen is not None else None
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        if not eos:
            raise ValueError("Neither the generation config nor the tokenizer defines an eos token.")
        self.eos_token_ids: list[int] = eos
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = gen.pad_token_id if gen is not None and gen.pad_token_id is not None else eos[0]
        self.pad_token_id = int(pad)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self._decoder = BatchDecoder(self.model, eos, share_prompt_prefill=share_prompt_prefill,
                                     repetition_penalty=self.sampling.repetition_penalty,
                                     llama_decode=self.llama_decode, cuda_graphs=cuda_graphs,
                                     generate_in_loop_thread=generate_in_loop_thread)

        self.policy_version = 0
        self.generate_calls = 0
        self.requests_served = 0
        self._closed = False
        self._lock = threading.Lock()  # one decode or one weight load at a time
        self._batcher = RequestBatcher(self._generate, max_batch_size, in_loop_thread=generate_in_loop_thread)
        if not isinstance(continuous_rows, int) or continuous_rows < 0:
            raise ValueError(f"continuous_rows (--continuous_batching_rows) must be an int >= 0 (0: batch by batch), "
                             f"got {continuous_rows!r}.")
        self.continuous_rows = continuous_rows
        self._loop = DecodeLoop(self._running_batch, self._continuous_step, continuous_rows) \
            if continuous_rows else None
        self._load_gate = LoadGate()

    # --- sampling -----------------------------------------------------------------------------------------------

    async def sample(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> Sample:
        """Sample one completion of ``prompt_ids`` (default length: ``sampling.max_new_tokens``).

        Calls made concurrently in one event loop are decoded as one batch; an error in it is raised
        in every caller of that batch. With ``continuous_rows``, calls from any loop join the running batch
        (``decode_loop``). The calling rollout's ``RolloutSampling`` records the version of each token.
        """
        check_open(self._closed)
        max_new_tokens = self.sampling.new_tokens(max_new_tokens)
        prompt_ids = check_token_ids(prompt_ids, self.vocab_size)
        rollout = rollout_sampling()
        temperature, seed = self.sampling.for_this_call()
        if self._loop is not None:
            sample = await self._loop.submit(DecodeRequest(prompt_ids, max_new_tokens, temperature, seed))
        else:
            sample = await self._batcher.submit(prompt_ids, max_new_tokens, temperature, seed)
        if rollout is not None:
            rollout.record_versions(sample.versions)
        return sample

    @torch.no_grad()
    def _generate(self, requests: list[Request]) -> list[Sample]:
        """One left-padded batch of requests, decoded together (worker thread)."""
        prompts = [r.prompt_ids for r in requests]
        width, s = max(len(p) for p in prompts), self.sampling
        with self._lock:
            if self._closed:
                raise EngineClosedError("The engine was closed while requests were waiting.")
            self.generate_calls += 1
            self.requests_served += len(prompts)
            device = self.model.get_input_embeddings().weight.device
            sampler = RowSampler([r.temperature for r in requests], [r.seed for r in requests], s.top_k, s.top_p,
                                 s.min_p, s.repetition_penalty, pad_lengths=[width - len(p) for p in prompts],
                                 device=device)
            root = self._decoder.root_length(prompts)
            input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, prompt in enumerate(prompts):
                # [root | padding | the rest of the prompt]: left padding when there is no root
                input_ids[row, :root] = torch.tensor(prompt[:root], dtype=torch.long)
                input_ids[row, width - len(prompt) + root :] = torch.tensor(prompt[root:])
                attention_mask[row, :root] = 1  # from real tokens, never from ids != pad
                attention_mask[row, width - len(prompt) + root :] = 1
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            linear = self._linear()
            with cpu_linears(self.model, linear):
                samples = self._decode(input_ids, attention_mask, prompts, [r.max_new_tokens for r in requests],
                                       sampler, root, linear)
            for sample in samples:  # the lock held: no load between the decode and this
                sample.versions = [self.policy_version] * len(sample.token_ids)
            return samples

    def _running_batch(self, max_rows: int | None = None) -> RunningBatch:
        """An empty running batch (``generate_continuous``'s, or the decode loop's of ``continuous_rows`` rows)."""
        s = self.sampling
        with self._lock:
            check_open(self._closed)
            device = self.model.get_input_embeddings().weight.device
            sampler = RowSampler([], [], s.top_k, s.top_p, s.min_p, s.repetition_penalty, device=device)
            return RunningBatch(self.model, self.eos_token_ids, sampler, max_rows or self.continuous_rows,
                                self.pad_token_id, llama_decode=self.llama_decode, linear=self._linear(),
                                version=lambda: self.policy_version)

    @torch.no_grad()
    def _continuous_step(self, batch: RunningBatch) -> dict[int, Sample]:
        """One step of a running batch under the lock, after any weight load waiting for it."""
        self._load_gate.wait_turn()
        with self._lock:
            check_open(self._closed)
            linear = self._linear()  # packs refreshed after a load; the same callable the lean step holds
            with cpu_linears(self.model, linear) if batch.forwards_model else contextlib.nullcontext():
                finished = batch.step()
            self.requests_served += len(finished)
            return finished

    @torch.no_grad()
    def generate_continuous(self, requests: list[DecodeRequest], max_rows: int,
                            between_steps: Callable[[], None] | None = None) -> ContinuousRun:
        """Decode ``requests`` with continuous batching (``RunningBatch``): at most ``max_rows`` rows decode
        together, and a waiting request joins the running batch as soon as a row finishes. Each request samples what
        it samples decoded alone under its seed. A weight load (``load_weights`` from another thread, or from
        ``between_steps``, called between two steps) applies between steps without draining the rows in flight:
        their later tokens are sampled by the new weights over the keys/values the old ones computed, and
        ``ContinuousRun.versions`` records the version of every token."""
        s = self.sampling
        if any(not r.temperature >= 0 for r in requests):
            raise ValueError("A DecodeRequest's temperature must be >= 0 (0: greedy).")
        requests = [DecodeRequest(check_token_ids(r.prompt_ids, self.vocab_size), s.new_tokens(r.max_new_tokens),
                                  r.temperature, r.seed) for r in requests]
        batch = self._running_batch(max_rows)
        for request in requests:
            batch.add(request)
        samples: dict[int, Sample] = {}
        while not batch.done:
            samples.update(self._continuous_step(batch))
            if between_steps is not None and not batch.done:
                between_steps()
        ordered = [samples[i] for i in range(len(requests))]
        return ContinuousRun(ordered, [sample.versions for sample in ordered], batch.stats)

    def _linear(self):
        """The linear layers' product while generating (``cpu_matmuls``); packs refreshed first (under the lock:
        a weight load cannot run in between). A model moved to a GPU (``make_engine``) packs nothing and decodes
        weight-major, as before packs."""
        if self._packs is not None and self.model.get_input_embeddings().weight.device.type == "cpu":
            self._packs.refresh()
            return self._packs.linear
        return None if self.cpu_matmuls == "linear" else weight_major

    def _decode(self, input_ids, attention_mask, prompts, max_new_tokens: list[int], sampler: RowSampler,
                root: int = 0, linear=None):
        """``BatchDecoder.decode`` (a seam: tests slow it down to see what waits for a decode)."""
        return self._decoder.decode(input_ids, attention_mask, prompts, max_new_tokens, sampler, root, linear)

    # --- weights ------------------------------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy ``(name, tensor)`` pairs into the engine's model and set ``policy_version``.

        Names are the trainer's (``named_parameters()``; ``module.`` / ``_orig_mod.`` prefixes are removed). A
        subset of the parameters may be given. ``named_tensors`` may be a stream whose tensors are valid only until
        the next item is requested (the trainer's bucketed ZeRO-3 gather): each is checked (name, shape) and copied
        into a staging area as it arrives, and the staged weights replace the live ones in one step at the end.
        So the load is atomic: an error (unknown name, wrong shape, a failing producer) leaves the weights and the
        version as they were, and generation never sees a mix of versions. The price is one extra copy of the
        weights sent, kept for the next load (``StagedWeights``). Waits for a running decode to finish.
        """
        weights = self._weights
        check_open(self._closed)
        with weights.staging:  # one load at a time (the staging copies are reused); the lock order: this, then _lock
            staged = weights.stage(named_tensors)
            with self._load_gate.loading(), self._lock:
                check_open(self._closed)
                weights.apply(staged)
                self.policy_version = int(version)

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """``log p(token_t | tokens_<t)`` for t = 1 .. n-1 at temperature 1, under the engine's current weights.

        The trainer compares these with its own after every weight load (the post-sync probe). Waits for a
        running decode or weight load.
        """
        token_ids = check_token_ids(token_ids, self.vocab_size, "token_ids", min_length=2)
        with self._lock:
            check_open(self._closed)
            logps = sequence_logprobs(self.model, token_ids, self.model.get_input_embeddings().weight.device)
        return logps.cpu().tolist()

    # --- state --------------------------------------------------------------------------------------------------

    @property
    def dtype(self) -> str:
        """What the engine computes in (the post-sync probe's tolerance depends on it)."""
        return str(next(self.model.parameters()).dtype)

    def health(self) -> dict:
        pending = self._batcher.pending() + (self._loop.pending() if self._loop is not None else 0)
        return {
            "engine": "embedded-hf",
            "model": self.model_name,
            "policy_version": self.policy_version,
            "ok": not self._closed,
            "generate_calls": self.generate_calls,
            "requests_served": self.requests_served,
            "prefills_shared": self._decoder.prefills_shared if self._decoder else 0,
            "root_tokens_shared": self._decoder.root_tokens_shared if self._decoder else 0,
            "pending": pending,
            "continuous": None if self._loop is None else {"rows": self.continuous_rows, **self._loop.counters()},
        }

    def close(self) -> None:
        """Free the model; waiting and later ``sample`` calls raise ``EngineClosedError``."""
        if self._loop is not None:
            self._loop.close()  # its thread stops after the step in progress and fails what it holds
        with self._lock:
            self._closed = True
            self.model = self._decoder = self._weights = self._packs = None
