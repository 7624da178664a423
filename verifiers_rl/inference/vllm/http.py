"""HTTP to a vLLM server: errors, one retry policy for blocking and async calls, and the connect-time handshake.

``VLLMTransport`` keeps one ``httpx`` client for blocking calls and one per event loop for async calls (asyncio
clients belong to the loop they were made in; the trainer's generator runs its own loops). Every call goes through
the same ``tenacity`` policy: a dropped or refused connection and (unless the call says otherwise) an HTTP 5xx are
retried with exponential backoff; a timeout is not retried (it names the request and its bound); a 4xx is the
caller's error and raised at once. With an API key every request carries ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from verifiers_rl.vllm_worker.vllm_auth import KEY_ENV as API_KEY_ENV
from verifiers_rl.vllm_worker.vllm_weight_sync import PROTOCOL_VERSION
from verifiers_rl.core.engine import WORKER_EXTENSION
from verifiers_rl.inference.vllm.weight_transfer import SERVER_BACKENDS

try:  # huggingface_hub (hence transformers) depends on httpx2; plain httpx has the same API.
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

logger = logging.getLogger(__name__)

# check() and health() bound their own requests: they ask "are you there", not "generate".
CHECK_TIMEOUT_S = 10.0
START_HINT = "start one with: verifiers-rl vllm-serve --model MODEL --port PORT"
# How long a run's first check waits for a server still starting (a CPU build takes 1-2 min): TRL's
# vllm_server_timeout default; --vllm_server_timeout sets it.
SERVER_WAIT_S = 240.0
# Failures worth another attempt: the server is (re)starting or went away mid-request.
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class VLLMError(RuntimeError):
    """A vLLM server failed or is unusable; the message names its URL."""

    status: int | None = None  # the HTTP status, when there was one


class VLLMUnavailableError(VLLMError):
    """No answer (connection refused or dropped, or HTTP 5xx) after every retry. ``connection_lost``: the last
    failure was the connection itself (the server is gone, or restarting), not an HTTP answer."""

    connection_lost: bool = False


class VLLMTimeoutError(VLLMError):
    """A request took longer than ``request_timeout_s``."""


class VLLMRequestError(VLLMError, ValueError):
    """The server refused the request (HTTP 4xx: bad input, such as ids outside the vocabulary, or no API key),
    or refused the weights it was asked to load."""


class _ServerFailure(Exception):
    """An HTTP 5xx answer, retried like a dropped connection when the call allows it."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


@dataclass
class _Call:
    """One logical request across its attempts (for the policy and the error that ends it)."""

    method: str
    path: str
    retries: int
    timeout: Any
    retry_5xx: bool
    attempts: int = 0
    started: float = field(default_factory=time.monotonic)


@dataclass
class _LoopClient:
    client: Any
    semaphore: asyncio.Semaphore
    keeper: asyncio.Task | None = None


def server_urls(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """The servers ``--vllm_server_url`` names: a comma-separated string (or a YAML list) of addresses."""
    if value is None:
        return []
    parts = value.split(",") if isinstance(value, str) else [str(part) for part in value]
    return [part.strip() for part in parts if part.strip()]


def server_address(url: str) -> str:
    """The server a URL names: without a trailing ``/`` or ``/v1`` (the API's prefix), the scheme and host in lower
    case (as HTTP reads them)."""
    url = str(url).rstrip("/")
    url = url[: -len("/v1")] if url.endswith("/v1") else url
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme.lower()}://{host.lower()}{slash}{path}" if rest else url


def check_server_url(url: str | list[str] | None, flag: str) -> None:
    """Each vLLM server's address (``server_urls``) must be ``http(s)://host:port``, and none given twice; the error
    names ``flag``."""
    urls = server_urls(url)
    for one in urls:
        if not one.startswith(("http://", "https://")):
            raise ValueError(f"{flag} must start with http:// or https://, got {one!r}.")
    if url is not None and not urls:
        raise ValueError(f"{flag} names no server, got {url!r}.")
    if len({server_address(one) for one in urls}) < len(urls):  # http://h:1 and http://h:1/v1 are one server
        raise ValueError(f"{flag} names a server twice: {url!r}.")


class VLLMTransport:
    """Blocking and async requests to one vLLM server, under one retry policy.

    Args:
        base_url: ``http(s)://host:port`` (a trailing ``/`` or ``/v1`` is removed).
        request_timeout_s: longest wait for one request's answer (connecting has its own 10 s).
        max_retries: further attempts after a connection error or HTTP 5xx; ``retry_backoff_s`` before the
            first, doubled each time.
        max_concurrency: most async requests in flight per event loop (the server batches them).
        api_key: sent as a bearer token on every request; default ``$VLLM_API_KEY``; never logged.
    """

    def __init__(self, base_url: str, request_timeout_s: float = 600.0, max_retries: int = 3,
                 retry_backoff_s: float = 0.5, max_concurrency: int = 64, api_key: str | None = None):
        # The knobs (concurrency, timeout, retries, the URL's scheme) are checked where the user gives them:
        # RLConfig.validate (training), eval.parse_args (evaluation); check_server_url is that rule.
        self.base_url = server_address(base_url)
        self.request_timeout_s = float(request_timeout_s)
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_concurrency = max_concurrency
        key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
        self.has_api_key = bool(key)
        # Connecting gets its own bound: a short request timeout should not turn a busy accept() into a retry.
        self._options = {
            "timeout": httpx.Timeout(self.request_timeout_s, connect=10.0),
            "verify": ssl.create_default_context(),  # built once (tens of ms), shared by every client
            "headers": {"Authorization": f"Bearer {key}"} if key else {},
        }
        self._client = httpx.Client(**self._options)
        self._loops_lock = threading.Lock()
        self._loops: dict[asyncio.AbstractEventLoop, _LoopClient] = {}

    @property
    def host(self) -> str:
        return httpx.URL(self.base_url).host

    # --- requests -----------------------------------------------------------------------------------------------

    def request(self, method: str, path: str, payload: dict | None = None, *, retries: int | None = None,
                timeout: float | None = None, retry_5xx: bool = True) -> Any:
        """One call from a normal thread; returns the decoded JSON answer."""
        call = self._call(method, path, retries, timeout, retry_5xx)
        with self._failures(call):
            for attempt in Retrying(**self._policy(call)):
                with attempt:
                    call.attempts += 1
                    response = self._client.request(method, self.base_url + path, json=payload,
                                                    timeout=call.timeout)
                    return self._answer(call, response)

    async def arequest(self, method: str, path: str, payload: dict | None = None, *, retries: int | None = None,
                       timeout: float | None = None, retry_5xx: bool = True) -> Any:
        """One call in the running event loop (at most ``max_concurrency`` in flight per loop)."""
        call = self._call(method, path, retries, timeout, retry_5xx)
        loop_client = self._loop_client()
        async with loop_client.semaphore:
            with self._failures(call):
                async for attempt in AsyncRetrying(**self._policy(call)):
                    with attempt:
                        call.attempts += 1
                        response = await loop_client.client.request(method, self.base_url + path, json=payload,
                                                                    timeout=call.timeout)
                        return self._answer(call, response)

    def rpc(self, method: str, *args: str, retries: int | None = None, timeout: float | None = None) -> list:
        """``/collective_rpc`` of a worker-extension method; one result per worker. An HTTP 500 there is the
        worker's own error (it would fail again): raised at once, not retried."""
        data = self.request("POST", "/collective_rpc", {"method": method, "args": list(args)}, retries=retries,
                            timeout=timeout, retry_5xx=False)
        return data.get("results") or [None]

    def close(self) -> None:
        """Close the blocking client. Each event loop's client closes when its loop ends (requests still under way
        there finish)."""
        self._client.close()

    # --- policy -------------------------------------------------------------------------------------------------

    def _call(self, method, path, retries, timeout, retry_5xx) -> _Call:
        timeout = self._options["timeout"] if timeout is None else httpx.Timeout(timeout)
        return _Call(method, path, self.max_retries if retries is None else retries, timeout, retry_5xx)

    def _policy(self, call: _Call) -> dict:
        """The one retry policy: ``retries`` more attempts, waits of backoff x 1, 2, 4, ..."""
        def retryable(error: BaseException) -> bool:
            return isinstance(error, _RETRYABLE) or (call.retry_5xx and isinstance(error, _ServerFailure))

        return {
            "stop": stop_after_attempt(call.retries + 1),
            "wait": wait_exponential(multiplier=self.retry_backoff_s),
            "retry": retry_if_exception(retryable),
            "reraise": True,
        }

    def _answer(self, call: _Call, response) -> Any:
        """The JSON of a usable response; raises ``_ServerFailure`` on 5xx and ``VLLMRequestError`` on 4xx."""
        if response.status_code < 400:
            return _json(response)
        detail = _error_detail(response)
        if response.status_code >= 500:
            raise _ServerFailure(response.status_code, detail)
        hint = ""
        if response.status_code == 401:
            hint = (f". It wants an API key: set {API_KEY_ENV} to the key it was started with" if not self.has_api_key
                    else f". The key in {API_KEY_ENV} (or api_key) is not the one it was started with")
        error = VLLMRequestError(f"The vLLM server at {self.base_url} refused {call.method} {call.path} "
                                 f"(HTTP {response.status_code}): {detail}{hint}")
        error.status = response.status_code
        raise error

    @contextlib.contextmanager
    def _failures(self, call: _Call):
        """Turn what ended a call into an error that names the server, the request and what to do."""
        try:
            yield
        except _ServerFailure as failure:
            if call.retry_5xx:
                raise self._unavailable(call, str(failure)) from None
            error = VLLMError(f"The vLLM server at {self.base_url} failed {call.method} {call.path}: {failure}")
            error.status = failure.status
            raise error from None
        except _RETRYABLE as failure:
            raise self._unavailable(call, f"{type(failure).__name__}: {failure}") from failure
        except httpx.TimeoutException as failure:
            raise VLLMTimeoutError(
                f"The vLLM server at {self.base_url} did not answer {call.method} {call.path} within "
                f"{call.timeout.read} s; it is stuck or overloaded (request_timeout_s bounds generation and weight "
                "loads)."
            ) from failure

    def _unavailable(self, call: _Call, last: str) -> VLLMUnavailableError:
        hint = "" if last.startswith("HTTP") else f" Is it running? If not, {START_HINT}."
        error = VLLMUnavailableError(
            f"The vLLM server at {self.base_url} failed {call.method} {call.path} {call.attempts} time(s) over "
            f"{time.monotonic() - call.started:.1f} s (last: {last}).{hint}"
        )
        error.last = last
        error.connection_lost = not last.startswith("HTTP")
        return error

    # --- one client per event loop ------------------------------------------------------------------------------

    def _loop_client(self) -> _LoopClient:
        loop = asyncio.get_running_loop()
        with self._loops_lock:
            entry = self._loops.get(loop)
            if entry is None:
                limits = httpx.Limits(max_connections=self.max_concurrency,
                                      max_keepalive_connections=self.max_concurrency)
                entry = _LoopClient(httpx.AsyncClient(limits=limits, **self._options),
                                    asyncio.Semaphore(self.max_concurrency))
                entry.keeper = loop.create_task(self._close_with_loop(loop, entry.client))
                self._loops[loop] = entry
            return entry

    async def _close_with_loop(self, loop, client) -> None:
        # asyncio.run and the trainer's generator cancel a loop's leftover tasks before closing it: that is when
        # the loop's pooled connections are closed (an unclosed pool would leak its sockets with the loop).
        try:
            await loop.create_future()
        finally:
            with self._loops_lock:
                self._loops.pop(loop, None)
            await client.aclose()


# --- what a server is, learnt when connecting ---------------------------------------------------------------------


@dataclass
class ServerInfo:
    """What ``connect`` learnt about a server. ``checkpoint_shapes``: the served checkpoint's tensor names and
    shapes (loads are checked against them); ``workers``: its worker processes (TP x DP)."""

    model_name: str | None = None
    vocab_size: int | None = None
    dtype: str | None = None
    tie_word_embeddings: bool | None = None
    checkpoint_shapes: dict[str, list[int]] | None = None
    workers: int = 1
    weight_transfer_backend: str | None = None
    max_model_len: int | None = None  # the longest prompt + completion it takes (its --max-model-len)

    def update(self, other: "ServerInfo") -> None:
        """Take ``other``'s values in place (weight loaders hold this object)."""
        for item in fields(self):
            setattr(self, item.name, getattr(other, item.name))


def connect(http: VLLMTransport, expected_model: str | None, weight_transfer: str,
            require_weight_sync: bool = True, wait_s: float = 0.0) -> ServerInfo:
    """Check that the server answers ``/health``, serves ``expected_model`` (any single model when None) and,
    with ``require_weight_sync``, can load weights by ``weight_transfer``; return what it said.

    Raises ``VLLMUnavailableError`` ("No vLLM server at URL ...") or ``VLLMError`` (another model; no weight sync;
    another weight-transfer backend). Tries once unless ``wait_s`` > 0 (then polls while the server starts).
    """
    _wait_for_health(http, wait_s)
    model_name, max_model_len = _served_model(http, expected_model)
    info = ServerInfo(model_name=model_name, max_model_len=max_model_len)
    if not require_weight_sync:
        return info
    protocol, info.workers = _protocol(http)
    info.vocab_size = int(protocol["vocab_size"])
    info.tie_word_embeddings = bool(protocol["tie_word_embeddings"])
    info.dtype = protocol.get("dtype")
    info.checkpoint_shapes = protocol.get("checkpoint_shapes")
    info.weight_transfer_backend = protocol.get("weight_transfer_backend")
    wanted = SERVER_BACKENDS.get(weight_transfer)
    if wanted is not None and info.weight_transfer_backend != wanted:
        raise VLLMError(
            f"weight_transfer={weight_transfer!r} needs a server started with the {wanted!r} weight-transfer backend; "
            f"the one at {http.base_url} has {info.weight_transfer_backend!r}. Start it with: python -m "
            f"verifiers_rl.inference.vllm.server --model MODEL --weight-transfer {weight_transfer}"
        )
    return info


def _wait_for_health(http: VLLMTransport, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    try:
        http.request("GET", "/health", retries=0, timeout=CHECK_TIMEOUT_S)
        return
    except VLLMError as error:
        failed = error
    try:
        if time.monotonic() >= deadline:
            raise failed
        logger.warning("Waiting up to %.0f s for a vLLM server at %s ...", wait_s, http.base_url)
        wait_for_health(http, deadline - time.monotonic())
    except VLLMError as error:
        raise VLLMUnavailableError(f"No vLLM server at {http.base_url} ({cause(error)}); {START_HINT}.") from error


def wait_for_health(http: VLLMTransport, timeout_s: float, poll_s: float = 1.0) -> float:
    """Poll ``/health`` every ``poll_s`` until it answers 200; return the seconds waited. Raises the last
    ``VLLMError`` once ``timeout_s`` have passed (each poll bounded by what is left, at most ``CHECK_TIMEOUT_S``)."""
    started = time.monotonic()
    deadline = started + timeout_s
    # The last wait ends at the deadline (not a poll past it): a bound the caller gives is kept.
    for attempt in Retrying(stop=stop_after_delay(timeout_s),
                            wait=lambda _: min(poll_s, max(deadline - time.monotonic(), 0.0)),
                            retry=retry_if_exception_type(VLLMError), reraise=True):
        with attempt:
            left = max(deadline - time.monotonic(), 0.5)
            http.request("GET", "/health", retries=0, timeout=min(CHECK_TIMEOUT_S, left))
    return time.monotonic() - started


def _served_model(http: VLLMTransport, expected: str | None) -> tuple[str, int | None]:
    """The served name of ``expected`` (the first model when None) and its ``max_model_len`` (None if not said)."""
    models = http.request("GET", "/v1/models", timeout=CHECK_TIMEOUT_S).get("data") or []
    served = [(m.get("id"), m.get("root")) for m in models]
    if not served:
        raise VLLMError(f"The vLLM server at {http.base_url} serves no model.")
    match = served[0] if expected is None else next((s for s in served if _same_model(expected, s)), None)
    if match is None:
        listed = ", ".join(f"{i!r} (from {r!r})" for i, r in served)
        raise VLLMError(
            f"The vLLM server at {http.base_url} serves {listed}, not {expected!r}. "
            f"Start it with --model {expected} (or connect to the right port)."
        )
    length = models[served.index(match)].get("max_model_len")
    return match[0], None if length is None else int(length)


def _protocol(http: VLLMTransport) -> tuple[dict, int]:
    """The worker extension's description of the served model, and the number of workers that answered."""
    try:
        results = http.rpc("verifiers_rl_protocol", retries=0, timeout=CHECK_TIMEOUT_S)
    except VLLMError as error:
        if error.status == 404:
            raise VLLMError(
                f"The vLLM server at {http.base_url} has no /collective_rpc route: start it with "
                f"VLLM_SERVER_DEV_MODE=1 (verifiers_rl.inference.vllm.server does) to load weights into it."
            ) from error
        if error.status != 500:
            raise
        # collective_rpc of a method the worker lacks fails inside the engine: HTTP 500.
        raise VLLMError(
            f"The vLLM server at {http.base_url} cannot load weights: it was not started with "
            f"--worker-extension-cls {WORKER_EXTENSION} and verifiers_rl/vllm_worker on its PYTHONPATH "
            f"(verifiers_rl.inference.vllm.server does both). Server said: {cause(error)}"
        ) from error
    info = results[0]
    if not isinstance(info, dict) or info.get("protocol") != PROTOCOL_VERSION:
        raise VLLMError(
            f"The vLLM server at {http.base_url} runs weight-sync protocol "
            f"{info.get('protocol') if isinstance(info, dict) else info!r}; this client speaks "
            f"{PROTOCOL_VERSION}. Restart it with this checkout's verifiers_rl/vllm_worker."
        )
    return info, max(len(results), 1)


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
        for key in ("detail", "message", "error"):
            if body.get(key):
                return str(body[key])[:1000]
    return json.dumps(body)[:1000]


def cause(error: BaseException) -> str:
    """The last failure behind a ``VLLMUnavailableError`` (else the error's text)."""
    return getattr(error, "last", None) or str(error)
