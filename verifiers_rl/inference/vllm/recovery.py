"""Bringing back a vLLM server that stopped answering: wait for it, check it, reload the policy, re-send.

``VLLMEngine`` owns one ``ServerRecovery``; every request goes through ``run`` (blocking) or ``arequest`` (async).
With ``timeout_s`` 0 an unreachable server is an error at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time

from verifiers_rl.core.modeling import default_probe_tolerance
from verifiers_rl.inference.vllm.http import VLLMError, VLLMTimeoutError, VLLMUnavailableError, cause, wait_for_health

logger = logging.getLogger(__name__)

# A request re-sent after this many recoveries of the server and lost again is an error (a request that crashes
# the server every time would otherwise loop).
MAX_RECOVERIES_PER_REQUEST = 3
RECONNECT_FLAG = "--vllm_reconnect_timeout_s"


def reference_ids(vocab_size: int) -> list[int]:
    """The fixed sequence whose log-probs, taken right after a load, tell whether a reloaded server holds the same
    weights (the same ids in every run)."""
    generator = random.Random(20240611)
    return [generator.randrange(vocab_size) for _ in range(32)]


def reference_gap(before: list[float], after: list[float], dtype: str | None, version: int) -> float:
    """The largest gap between a reloaded server's log-probs of ``reference_ids`` and those after ``version``'s load;
    raises ``VLLMError`` beyond the tolerance of the server's ``dtype``."""
    gap = max(abs(a - b) for a, b in zip(after, before))
    tolerance = default_probe_tolerance(dtype)
    if not gap <= tolerance:
        raise VLLMError(
            f"after the reload its log-probs of a fixed sequence differ from those after version {version}'s load "
            f"by up to {gap:.3g} (tolerance {tolerance:g}): it does not hold the weights it held"
        )
    return gap


class ServerRecovery:
    """Re-runs a request that failed because the engine's server went away, once the server is back with the
    current weights.

    When the server stops answering (connection refused or dropped after every retry), wait up to ``timeout_s`` for
    it to come back (polling ``/health``), ``engine.check()`` it, reload the current policy version's weights
    (``engine.transfer.reload()``), compare its log-probs of a fixed sequence with those taken after the version's
    load (``take_reference``), and re-send. Not back in time: the error, and every later call fails at once.
    """

    def __init__(self, engine, timeout_s: float):
        self.engine = engine
        self.timeout_s = timeout_s
        # One recovery at a time; ``_incarnation`` counts the returns, so the requests that failed together recover
        # once; ``_lost`` is the error once the server did not come back.
        self._lock = threading.Lock()
        self._incarnation = 0
        self._lost: VLLMError | None = None
        self.recoveries = 0
        self.resent_requests = 0
        # (version, ids, the server's log-probs of ids right after that version's load): checked after a reload.
        self._reference: tuple[int, list[int], list[float]] | None = None

    def take_reference(self, version: int) -> None:
        """Record the server's log-probs of a fixed sequence right after ``version``'s load."""
        ids = reference_ids(self.engine.vocab_size)
        self._reference = (version, ids, self.run(lambda: self.engine._prompt_logprobs(ids)))

    def raise_if_lost(self) -> None:
        if self._lost is not None:
            raise self._lost

    def _can_recover(self, error: VLLMError, recoveries: int) -> bool:
        return (self.timeout_s > 0 and isinstance(error, VLLMUnavailableError) and error.connection_lost
                and recoveries < MAX_RECOVERIES_PER_REQUEST and not self.engine._closed)

    def run(self, call):
        """``call()`` (blocking); re-run after the server came back if it was lost."""
        recoveries = 0
        while True:
            self.raise_if_lost()
            incarnation = self._incarnation
            try:
                return call()
            except VLLMUnavailableError as error:
                if not self._can_recover(error, recoveries):
                    raise
                self._recover(incarnation, error)
                recoveries += 1
                self.resent_requests += 1

    async def arequest(self, method: str, path: str, payload: dict):
        """One async request; re-sent (the same payload: a seeded sample is the same sample) after the server came
        back if it was lost. The recovery runs on a worker thread: the loop's other requests wait for it too."""
        recoveries = 0
        while True:
            self.raise_if_lost()
            incarnation = self._incarnation
            try:
                return await self.engine.http.arequest(method, path, payload)
            except VLLMUnavailableError as error:
                if not self._can_recover(error, recoveries):
                    raise
                await asyncio.to_thread(self._recover, incarnation, error)
                recoveries += 1
                self.resent_requests += 1

    def _recover(self, incarnation: int, failure: VLLMUnavailableError) -> None:
        """Wait for the server, check it, reload the current weights and check them. The first caller of an
        incarnation does it; the others wait for it and then re-send."""
        engine = self.engine
        with self._lock:
            self.raise_if_lost()
            if incarnation != self._incarnation:
                return  # brought back while this caller's request was failing
            started = time.monotonic()
            logger.warning(
                "vLLM server at %s not answering (%s); waiting up to %.0f s for it to come back (%s).",
                engine.base_url, cause(failure), self.timeout_s, RECONNECT_FLAG)
            self._wait_until_back(failure, started + self.timeout_s)
            try:
                reloaded = engine.transfer.reload()
                gap = self._check_reference()
            except VLLMError as error:
                self._give_up(VLLMError(
                    f"The vLLM server at {engine.base_url} came back but could not be given policy version "
                    f"{engine.policy_version} again: {error}"), error)
            self._incarnation += 1
            self.recoveries += 1
            what = ("reloaded policy version %d (%s)" % (engine.policy_version, reloaded.get("transfer"))
                    if reloaded else f"policy version {engine.policy_version} is its own checkpoint (nothing loaded yet)")
            logger.warning(
                "vLLM server at %s is back after %.1f s: %s%s; re-sending the requests in flight.", engine.base_url,
                time.monotonic() - started, what, "" if gap is None else f", log-probs as before the loss (gap {gap:.2g})")

    def _wait_until_back(self, failure: VLLMUnavailableError, deadline: float) -> None:
        engine = self.engine
        while True:
            try:
                wait_for_health(engine.http, max(deadline - time.monotonic(), 0.0))
                engine.check(require_weight_sync=engine._require_weight_sync)
                return
            except (VLLMUnavailableError, VLLMTimeoutError) as error:  # not answering (yet)
                if time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                lost = VLLMUnavailableError(
                    f"{failure} It did not come back within {self.timeout_s:.0f} s ({RECONNECT_FLAG}; "
                    f"last: {cause(error)})."
                )
                self._give_up(lost, error)
            except VLLMError as error:  # back, but another model or no weight sync: waiting will not help
                self._give_up(VLLMError(f"The vLLM server at {engine.base_url} came back unusable: {error}"), error)

    def _check_reference(self) -> float | None:
        """The reloaded server's log-probs of the reference ids against those taken after the version's load."""
        if self._reference is None:
            return None
        version, ids, before = self._reference
        if version != self.engine.policy_version:
            return None
        return reference_gap(before, self.engine._prompt_logprobs(ids), self.engine.dtype, version)

    def _give_up(self, lost: VLLMError, error: BaseException) -> None:
        lost.server_lost = True  # the generator does not retry a rollout against a server that is gone
        lost.last = getattr(error, "last", None) or str(error)
        self._lost = lost
        raise lost from error
