"""A loopback HTTP endpoint over an inference engine that speaks the two routes verifiers 0.4 (``verifiers.v1``)'s
train client calls, so a v1 environment, run unchanged in its own process, samples from the policy being trained.

The routes (as ``renderers.client.generate`` 0.1.12, which v1's ``TrainClient`` calls, uses them):

* ``POST {root}/inference/v1/generate``: body ``{"model", "token_ids": [...], "sampling_params": {"max_tokens",
  "stop_token_ids", "logprobs": 1, ...}}``; answer ``{"request_id", "prompt_token_ids", "choices": [{"index": 0,
  "token_ids": [...], "logprobs": {"content": [{"token": "token_id:<id>", "logprob": <float>}, ...]},
  "finish_reason": "stop" | "length"}], "policy_version"}``. ``root`` is the client's ``base_url`` without its
  trailing ``/v1``.
* ``GET {base_url}/models`` (``{base_url}`` ends in ``/v1``): ``{"object": "list", "data": [{"id": <model>,
  "object": "model", "max_model_len": <n>}]}``; renderers reads ``max_model_len`` there for its pre-flight length
  check (the card's ``id`` must equal the request's model name).

Every request carries ``Authorization: Bearer <api_key>``; anything else is refused (401). The server listens on
127.0.0.1 only.

Sampling goes through ``engine.sample`` and nothing else: the completion's ids, log-probs and finish reason are
exactly the engine's. The request's sampling settings other than ``max_tokens`` are not used (the trainer's
replace them, as for classic verifiers environments); a ``stop_token_ids`` the engine does not stop at is refused
(400), since the engine would sample past it. Each rollout gets its own base URL (``rollout(sampling)``, a path
prefix ``/r/<key>``) under which its model calls run in its ``RolloutSampling`` (seed, temperature), as an
in-process environment's would; a call under no registered rollout is refused (404). A rollout may name its own
engine and the event loop that engine samples in (``rollout(sampling, engine, loop)``): the endpoint can then serve
from its own thread while the engine stays in the trainer's generator loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from verifiers_rl.core.sampling import RolloutSampling, sampling_for_rollout

DEFAULT_MODEL_NAME = "verifiers_rl-policy"
# The sampling params a call may carry that act here (or say nothing): renderers' own and the length.
TAKEN_PARAMS = {"max_tokens", "max_completion_tokens", "stop_token_ids", "logprobs", "skip_special_tokens",
                "routed_experts_prompt_start"}
logger = logging.getLogger(__name__)


@dataclass
class _Registered:
    """A rollout's base URL: how its calls sample, with which engine, in which event loop (None: the endpoint's)."""

    sampling: RolloutSampling
    engine: Any
    loop: asyncio.AbstractEventLoop | None


class GenerateEndpoint:
    """``async with GenerateEndpoint(engine, max_model_len=...) as ep:`` then, per rollout,
    ``with ep.rollout(RolloutSampling(seed=...)) as base_url:`` hands ``base_url`` (ending in ``/v1``) and
    ``ep.api_key`` to the v1 client. Start and stop it in the event loop the engine samples in, or give each
    rollout its engine's loop. ``engine`` may be None when every rollout names its own.

    A call samples at most ``min(max_tokens asked, max_new_tokens, max_model_len - prompt length)`` tokens."""

    def __init__(self, engine: Any = None, *, max_model_len: int, max_new_tokens: int | None = None,
                 model_name: str = DEFAULT_MODEL_NAME, api_key: str | None = None, host: str = "127.0.0.1"):
        if host != "127.0.0.1":
            raise ValueError("The generate endpoint listens on 127.0.0.1 only (it has no TLS).")
        self.engine = engine
        self.max_model_len = int(max_model_len)
        sampling = getattr(engine, "sampling", None)
        self.max_new_tokens = int(max_new_tokens or getattr(sampling, "max_new_tokens", 0) or self.max_model_len)
        self.model_name = model_name
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.host = host
        self.port: int | None = None
        self.requests_served = 0
        self._rollouts: dict[str, _Registered] = {}
        self._runner: web.AppRunner | None = None
        self._said: set[str] = set()  # the unused sampling settings already warned of

    # --- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> "GenerateEndpoint":
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/r/{key}/inference/v1/generate", self._generate)
        app.router.add_get("/r/{key}/v1/models", self._models)
        app.router.add_get("/r/{key}/models", self._models)
        # A caller that goes away (its episode cancelled) cancels its call: the engine stops sampling for nobody.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the port the OS gave (bound to 0: no race); public since aiohttp 3.3
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> "GenerateEndpoint":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @contextlib.contextmanager
    def rollout(self, sampling: RolloutSampling | None, engine: Any = None,
                loop: asyncio.AbstractEventLoop | None = None):
        """A base URL (``http://127.0.0.1:<port>/r/<key>/v1``) whose model calls sample under ``sampling`` with
        ``engine`` (default: the endpoint's), inside ``loop`` when given (the loop ``engine`` samples in, if not the
        endpoint's own); valid until the block exits."""
        if self.port is None:
            raise RuntimeError("Start the endpoint (async with / await start()) before handing out base URLs.")
        engine = engine if engine is not None else self.engine
        if engine is None:
            raise ValueError("No engine for this rollout: give one to the endpoint or to rollout().")
        key = secrets.token_hex(8)
        self._rollouts[key] = _Registered(sampling if sampling is not None else RolloutSampling(), engine, loop)
        try:
            yield f"http://{self.host}:{self.port}/r/{key}/v1"
        finally:
            self._rollouts.pop(key, None)

    # --- routes -------------------------------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if not secrets.compare_digest(request.headers.get("Authorization", ""), f"Bearer {self.api_key}"):
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)")
        return await handler(request)

    def _registered(self, request: web.Request) -> _Registered:
        registered = self._rollouts.get(request.match_info["key"])
        if registered is None:
            raise web.HTTPNotFound(text=json.dumps({"error": {"message": "no such rollout (its episode ended?)"}}),
                                   content_type="application/json")
        return registered

    async def _models(self, request: web.Request) -> web.Response:
        self._registered(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "verifiers_rl", "max_model_len": self.max_model_len}
        ]})

    def _say_unused(self, params: dict) -> None:
        """Warn, once per setting, of v1's sampling settings that do not reach the engine (the trainer's apply)."""
        unused = sorted(key for key, value in params.items()
                        if key not in TAKEN_PARAMS and value is not None and key not in self._said)
        if unused:
            self._said.update(unused)
            logger.warning("verifiers v1's sampling settings %s are not used: the trainer's are (--temperature, "
                           "--top_p, ...; max_tokens is capped by --max_completion_length).", unused)

    async def _generate(self, request: web.Request) -> web.Response:
        registered = self._registered(request)
        engine = registered.engine
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "the body is not JSON")
        prompt_ids = body.get("token_ids")
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
            return _error(400, "token_ids must be a non-empty list of ints")
        for field in ("features", "content_parts"):
            if body.get(field):
                return _error(400, f"{field!r} (multimodal input) is not supported")
        params = body.get("sampling_params") or {}
        self._say_unused(params)
        asked = params.get("max_tokens") or params.get("max_completion_tokens") or self.max_new_tokens
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            return _error(400, f"the prompt has {len(prompt_ids)} tokens; max_model_len={self.max_model_len} leaves "
                               "no room for a completion")
        eos = set(getattr(engine, "eos_token_ids", None) or [])
        stops = [int(t) for t in params.get("stop_token_ids") or []]
        if eos and (extra := sorted(set(stops) - eos)):
            return _error(400, f"stop_token_ids {extra} are not tokens the engine stops at ({sorted(eos)}): it would "
                               "sample past them")
        budget = min(int(asked), self.max_new_tokens, room)
        version = getattr(engine, "policy_version", None)

        async def draw():
            with sampling_for_rollout(registered.sampling):
                return await engine.sample(list(prompt_ids), budget)

        try:
            if registered.loop is None or registered.loop is asyncio.get_running_loop():
                sample = await draw()
            else:  # the engine's loop (the generator's), not this server's
                sample = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(draw(), registered.loop))
            sample.validate(budget)
        except ValueError as e:
            return _error(400, str(e))
        self.requests_served += 1
        return web.json_response({
            "request_id": f"vrl-{secrets.token_hex(6)}",
            "prompt_token_ids": list(prompt_ids),
            "choices": [{
                "index": 0,
                "token_ids": list(sample.token_ids),
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": _finite(lp)}
                                         for t, lp in zip(sample.token_ids, sample.logprobs)]},
                "finish_reason": sample.finish_reason,
            }],
            # The weights' version when the call was made (the trainer's staleness accounting); not a vLLM field.
            "policy_version": version,
        })


def _finite(x: float) -> float:
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"the engine returned a non-finite log-prob {x}")
    return x


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)
