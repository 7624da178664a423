"""Generation across several vLLM servers: one ``VLLMEngine`` per address behind the ``InferenceEngine`` interface.

- Spread: each request goes to the live server with the least outstanding work (prompt + requested tokens in
  flight), with group affinity: the same prompt ids (or chat messages) go to the server that took them first while it
  is up, so its prefix cache serves the group's shared prompt. The (temperature, seed) of a call is drawn once, so a
  re-sent call samples the same tokens wherever the servers are deterministic.
- Kept in step: ``load_weights`` reaches every live server (``files``: one snapshot written once and loaded by each;
  ``nccl``/``gloo``: the tensors copied to host memory once and broadcast to each server in turn), and
  ``prompt_logprobs_by_server`` lets the trainer's post-sync probe check each one.
- Losing one: a server whose connection is lost, or that hangs (a request timed out while another server is up), is
  marked down (a warning names it), its requests go to the others; a watcher polls its ``/health`` and, once it
  answers at the same address, checks it, loads the current weights, compares its log-probs of a fixed sequence
  with a live server's after the load, and puts it back. With every server down, requests, weight loads and the
  post-sync probe wait ``reconnect_timeout_s`` for one to come back (0: the error at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, TypeVar

import torch

from verifiers_rl.core.engine import Sample, check_open
from verifiers_rl.inference.vllm.engine import ChatSample, VLLMEngine
from verifiers_rl.inference.vllm.http import VLLMError, VLLMTimeoutError, VLLMUnavailableError, cause
from verifiers_rl.inference.vllm.recovery import MAX_RECOVERIES_PER_REQUEST, RECONNECT_FLAG, reference_gap, reference_ids
from verifiers_rl.inference.vllm.weight_loads import SnapshotLoad, plain_names

logger = logging.getLogger(__name__)

T = TypeVar("T")
AFFINITY_ENTRIES = 4096  # prompts remembered for group affinity (a few batches' worth of groups)
WAIT_POLL_S = 0.5  # how often a request waiting for any server to come back looks again


@dataclass
class Member:
    """One server of the pool and what the pool knows of it."""

    index: int
    engine: VLLMEngine
    up: bool = True
    outstanding: int = 0  # tokens in flight: prompt + requested new tokens of the requests sent and not answered
    requests: int = 0  # requests answered
    tokens: int = 0  # completion tokens answered
    requests_since_rejoin: int = 0
    losses: int = 0
    rejoins: int = 0
    probe_gap: float | None = None  # the last post-sync probe's largest gap on this server
    refused: str | None = None  # why its last rejoin was refused (said once per reason, not at every poll)
    last_read: tuple[float, int] = (0.0, 0)  # (time, tokens) when the metrics were last read: tokens/s since then

    @property
    def name(self) -> str:
        return f"vLLM server {self.index} at {self.engine.base_url}"

    def answered(self, tokens: int) -> None:
        self.requests += 1
        self.requests_since_rejoin += 1
        self.tokens += tokens

    def cannot_rejoin(self, error: VLLMError, poll_s: float) -> None:
        """Say why this server cannot rejoin, once per reason: the watcher asks again at every poll, quietly."""
        reason = str(error)
        if reason == self.refused:
            logger.debug("%s still cannot rejoin: %s", self.name, reason)
            return
        self.refused = reason
        logger.warning("%s answers again but cannot rejoin: %s (the pool keeps polling it every %.3g s and says when "
                       "it rejoins)", self.name, reason, poll_s)


def _is_lost(error: BaseException) -> bool:
    return isinstance(error, VLLMUnavailableError) and error.connection_lost


def check_all(members: list[Member], wait_s: float) -> None:
    """``VLLMEngine.check`` on every server at once (waits overlap: N servers still starting take one ``wait_s``, not
    N); raises the one error, or one naming every server that failed."""
    def check(member: Member) -> VLLMError | None:
        try:
            member.engine.check(require_weight_sync=member.engine._require_weight_sync, wait_s=wait_s)
        except VLLMError as error:
            return error
        return None

    with ThreadPoolExecutor(len(members), thread_name_prefix="vllm-pool-check") as checks:
        errors = [error for error in checks.map(check, members) if error is not None]
    if len(errors) == 1:
        raise errors[0]
    if errors:
        kinds = {type(error) for error in errors}
        kind = kinds.pop() if len(kinds) == 1 else VLLMError
        raise kind(f"{len(errors)} of {len(members)} vLLM servers failed their check:\n"
                   + "\n".join(f"- {error}" for error in errors)) from errors[0]


def moves(member: Member, error: VLLMError, members: list[Member]) -> bool:
    """Whether a request that failed on ``member`` goes to another server (``member`` then marked down): it was lost,
    or it timed out while another server is up (a hung server answers no request, its ``/health`` neither, so group
    affinity would send the group's retries back to it; it rejoins once it answers)."""
    if _is_lost(error):
        return True
    return isinstance(error, VLLMTimeoutError) and any(other.up and other is not member for other in members)


def server_metrics(members: list[Member]) -> dict[str, float]:
    """Per server ``i``: ``vllm/i/requests`` (answered so far), ``vllm/i/tokens_per_s`` (completion tokens since the
    last call), ``vllm/i/policy_version``, ``vllm/i/up`` (1/0) and ``vllm/i/probe_gap`` (when probed)."""
    now = time.monotonic()
    metrics = {}
    for member in members:
        then, tokens = member.last_read
        prefix = f"vllm/{member.index}/"
        metrics[prefix + "requests"] = member.requests
        if then:
            metrics[prefix + "tokens_per_s"] = (member.tokens - tokens) / max(now - then, 1e-9)
        member.last_read = (now, member.tokens)
        metrics[prefix + "policy_version"] = member.engine.policy_version
        metrics[prefix + "up"] = float(member.up)
        if member.probe_gap is not None:
            metrics[prefix + "probe_gap"] = member.probe_gap
    return metrics


class Spread:
    """Which server takes a request: the live one with the fewest tokens in flight, with group affinity (a key seen
    before goes to the server that took it while that one is up); and which servers are up."""

    def __init__(self, members: list[Member]):
        self.members = members
        self._affinity: OrderedDict[object, Member] = OrderedDict()
        self._state = threading.Lock()  # up/down flags (the event loop marks a loss without waiting for a load)

    def live(self) -> list[Member]:
        """The servers taking requests now."""
        return [member for member in self.members if member.up]

    def pick(self, key: object, cost: int) -> Member | None:
        """The server for a request of ``cost`` tokens (counted in flight until the caller takes it off), or None
        when every server is down."""
        live = self.live()
        if not live:
            return None
        member = self._affinity.get(key)
        if member is None or not member.up:
            member = min(live, key=lambda m: (m.outstanding, m.requests))
            self._affinity[key] = member
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        self._affinity.move_to_end(key)
        member.outstanding += cost
        return member

    def mark_down(self, member: Member, error: BaseException) -> None:
        with self._state:
            if not member.up:
                return
            member.up = False
            member.losses += 1
            left = len(self.live())
        logger.warning("%s not answering (%s): marked down, its requests go to the %d other(s) up; it rejoins once "
                       "it answers /health again at the same address.", member.name, cause(error), left)

    def mark_up(self, member: Member) -> None:
        with self._state:
            member.up = True
            member.rejoins += 1


class MultiServerEngine:
    """An ``InferenceEngine`` over several vLLM servers serving the same model (see the module docstring).

    Args:
        base_urls: the servers (at least two; one server is a ``VLLMEngine``).
        reconnect_timeout_s: with every server down, how long a request waits for one to come back (0: the error
            at once). A single server down never stops the run: the others take its requests.
        weight_transfer: as ``VLLMEngine``'s, for every server. ``weights_dir``: where ``files`` snapshots are
            written (every server must read the same path).
        health_poll_s: how often the watcher asks a down server's ``/health``.
        check / wait_s: check every server now, all at once: those still starting are waited for together, at most
            ``wait_s`` (one deadline for all); the error names each server that failed.
        **engine_kwargs: the other ``VLLMEngine`` arguments (model, sampling, api_key, ...), the same for each.

    Over 300 lines: requests, loads and the watcher that rejoins a server share one lock and the weights kept for a
    rejoin; what needs neither is a module function (``check_all``, ``moves``, ``server_metrics``, ``Spread``).
    """

    def __init__(self, base_urls: list[str], *, reconnect_timeout_s: float = 0.0, weight_transfer: str = "files",
                 weights_dir: str | None = None, health_poll_s: float = 1.0, check: bool = True, wait_s: float = 0.0,
                 **engine_kwargs):
        if len(base_urls) < 2:
            raise ValueError(f"MultiServerEngine needs at least two servers, got {base_urls!r}; use VLLMEngine.")
        if reconnect_timeout_s < 0:
            raise ValueError(f"reconnect_timeout_s must be >= 0, got {reconnect_timeout_s}.")
        self.reconnect_timeout_s = float(reconnect_timeout_s)
        self.weight_transfer = weight_transfer
        self.health_poll_s = health_poll_s
        self.members: list[Member] = []
        self._writer, self._kept = None, None  # set before a member's check can fail: close() reads them
        try:
            for index, url in enumerate(base_urls):
                # Each member fails at once when its server is lost: the pool re-sends elsewhere and rejoins it.
                engine = VLLMEngine(url, weight_transfer=weight_transfer, weights_dir=weights_dir,
                                    reconnect_timeout_s=0.0, check=False, **engine_kwargs)
                self.members.append(Member(index, engine))
            if check:
                check_all(self.members, wait_s)
        except BaseException:
            self.close()
            raise
        first = self.members[0].engine
        self.sampling = first.sampling
        self._writer = SnapshotLoad(first.http, weights_dir) if weight_transfer == "files" else None
        # self._kept: the current weights for a rejoining server, a Snapshot (files) or host copies.
        self._reference: tuple[int, list[int], list[float]] | None = None  # (version, ids, log-probs after its load)
        self.spread = Spread(self.members)
        self._lock = threading.Lock()  # loads and rejoins: a rejoin never races a load
        self.policy_version = 0
        self.resent_requests = 0
        self.last_load: dict | None = None
        self._closed = False
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="vllm-pool-watcher", daemon=True)
        self._watcher.start()

    # --- what the servers are -----------------------------------------------------------------------------------

    @property
    def model_name(self) -> str | None:
        return self.members[0].engine.model_name

    @property
    def vocab_size(self) -> int | None:
        return self.members[0].engine.vocab_size

    @property
    def dtype(self) -> str | None:
        return self.members[0].engine.dtype

    @property
    def requests_served(self) -> int:
        return sum(member.requests for member in self.members)

    @property
    def recoveries(self) -> int:
        """Times a lost server came back and was put back in the pool."""
        return sum(member.rejoins for member in self.members)

    def take_sequences(self, max_seq_len: int) -> None:
        """``VLLMEngine.take_sequences`` on every server (a down one is checked again when it rejoins)."""
        for member in self.members:
            member.engine.take_sequences(max_seq_len)

    # --- sampling -----------------------------------------------------------------------------------------------

    async def sample(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> Sample:
        """``VLLMEngine.sample`` on the server the spread picks; re-sent elsewhere (same seed) if that one is lost."""
        check_open(self._closed)
        prompt_ids = [int(t) for t in prompt_ids]
        cost = len(prompt_ids) + self.sampling.new_tokens(max_new_tokens)
        draw = self.sampling.for_this_call()
        sample = await self._send(tuple(prompt_ids), cost,
                                  lambda engine: engine.sample(prompt_ids, max_new_tokens, draw=draw))
        return sample

    async def chat(self, messages: list[dict], max_new_tokens: int | None = None,
                   tools: list[dict] | None = None) -> ChatSample:
        """``VLLMEngine.chat`` on the server the spread picks; re-sent elsewhere (same seed) if that one is lost."""
        check_open(self._closed)
        key = json.dumps([messages, tools], sort_keys=True, default=str)
        cost = len(key) // 4 + self.sampling.new_tokens(max_new_tokens)  # about 4 characters a token
        draw = self.sampling.for_this_call()
        return await self._send(key, cost, lambda engine: engine.chat(messages, max_new_tokens, tools, draw=draw))

    async def _send(self, key: object, cost: int, call: Callable[[VLLMEngine], Awaitable[T]]) -> T:
        deadline = None
        resends = 0
        while True:
            member = self.spread.pick(key, cost)
            if member is None:  # every server down: wait for the watcher to bring one back
                deadline = deadline or time.monotonic() + self.reconnect_timeout_s
                if time.monotonic() >= deadline:
                    raise self._all_down()
                await asyncio.sleep(WAIT_POLL_S)
                continue
            try:
                result = await call(member.engine)
            except VLLMError as error:
                if not moves(member, error, self.members) or resends >= MAX_RECOVERIES_PER_REQUEST * len(self.members):
                    raise
                self.spread.mark_down(member, error)
                resends += 1
                self.resent_requests += 1
                continue
            finally:
                member.outstanding -= cost
            member.answered(len((result.sample if isinstance(result, ChatSample) else result).token_ids))
            return result

    def _run(self, call: Callable[[VLLMEngine], T]) -> T:
        """``call`` (blocking) on a live server, the next one if it is lost; waits like ``_send`` when all are."""
        deadline = None
        while True:
            live = self.spread.live()
            if not live:
                deadline = deadline or time.monotonic() + self.reconnect_timeout_s
                if time.monotonic() >= deadline:
                    raise self._all_down()
                time.sleep(WAIT_POLL_S)
                continue
            try:
                return call(live[0].engine)
            except VLLMError as error:
                if not _is_lost(error):
                    raise
                self.spread.mark_down(live[0], error)

    def _all_down(self) -> VLLMUnavailableError:
        error = VLLMUnavailableError(
            f"No vLLM server answers ({', '.join(m.engine.base_url for m in self.members)}), none came back within "
            f"{self.reconnect_timeout_s:.0f} s ({RECONNECT_FLAG})."
        )
        error.connection_lost = True
        error.server_lost = True  # the generator does not retry a rollout against servers that are gone
        return error

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """``VLLMEngine.prompt_logprobs`` from one live server (``prompt_logprobs_by_server`` checks each)."""
        check_open(self._closed)
        return self._run(lambda engine: engine._prompt_logprobs(token_ids))

    def prompt_logprobs_by_server(self, token_ids: list[int]) -> dict[str, list[float]]:
        """Every live server's log-probs of ``token_ids`` (``VLLMEngine.prompt_logprobs``), by ``Member.name``; a
        server lost meanwhile is marked down and left out. With every server lost, waits ``reconnect_timeout_s`` for one
        to rejoin, as a load does; then raises."""
        check_open(self._closed)
        return {member.name: logps for member, logps in self._on_each_live_or_wait(
            lambda member: member.engine._prompt_logprobs(token_ids), "the post-sync probe")}

    def record_probe(self, gaps: dict[str, float]) -> None:
        """Keep each server's post-sync probe gap (by ``Member.name``) for ``server_metrics``."""
        for member in self.members:
            member.probe_gap = gaps.get(member.name, member.probe_gap)

    # --- weights ------------------------------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the pairs into every live server (written or copied once), then set ``policy_version``. A server
        lost during the load is marked down (it gets these weights when it rejoins); with every server lost, the load
        waits ``reconnect_timeout_s`` for one to rejoin and loads it then; any other error is raised, naming the
        server, and leaves ``policy_version`` unchanged."""
        check_open(self._closed)
        with self._lock:
            if self._writer is not None:
                kept = self._writer.write(named_tensors, version)
            else:  # a broadcast consumes what it sends: one host copy, sent to each server in turn
                kept = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in plain_names(named_tensors)]

        def send(member: Member) -> dict:
            with member.engine.swap(version):  # each server paused and labelled around its own load
                if self._writer is not None:
                    return member.engine.transfer.send(kept)
                return member.engine.transfer.load(kept, version)

        try:
            self._on_each_live_or_wait(send, f"the load of policy version {version}",
                                       lambda loaded: self._loaded(kept, loaded, version))
        except BaseException:
            if self._kept is not kept:  # not (yet) the weights a rejoining server is given
                self._drop(kept)
            raise

    def _loaded(self, kept, loaded: list[tuple[Member, dict]], version: int) -> None:
        """Record a load that reached ``loaded``: the weights kept for a rejoin, the versions, the reference."""
        self._drop(self._kept)
        self._kept, self.last_load = kept, {**loaded[0][1], "servers": len(loaded)}
        self.policy_version = int(version)
        for member, _ in loaded:
            member.engine.policy_version = int(version)
        ids = reference_ids(self.vocab_size)
        self._reference = (int(version), ids, self._run(lambda engine: engine._prompt_logprobs(ids)))

    def _on_each_live(self, call: Callable[[Member], T]) -> list[tuple[Member, T]]:
        """``call`` on every live server: a server lost meanwhile is marked down and left out, another error is
        raised naming the server; raises when none answers."""
        loaded = []
        for member in self.spread.live():
            try:
                loaded.append((member, call(member)))
            except VLLMError as error:
                if not _is_lost(error):
                    raise VLLMError(f"{member.name}: {error}") from error
                self.spread.mark_down(member, error)
        if not loaded:
            raise self._all_down()
        return loaded

    def _on_each_live_or_wait(self, call: Callable[[Member], T], what: str,
                              then: Callable[[list[tuple[Member, T]]], None] = lambda results: None,
                              ) -> list[tuple[Member, T]]:
        """``_on_each_live`` and ``then`` of its results under the load lock (no rejoin in between); with every server
        lost, waits ``reconnect_timeout_s`` for the watcher to rejoin one and calls it then (``what`` it was doing)."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            with self._lock:
                try:
                    results = self._on_each_live(call)
                except VLLMUnavailableError as error:
                    if not (getattr(error, "server_lost", False) and time.monotonic() < deadline and not self._closed):
                        raise
                    results = None
                if results is not None:
                    then(results)
                    return results
            # Outside the lock: the watcher rejoins a server that answers again (with the last weights loaded).
            logger.warning("Every vLLM server was lost during %s: waiting up to %.0f s (%s) for one to come back.",
                           what, deadline - time.monotonic(), RECONNECT_FLAG)
            while not self.spread.live() and time.monotonic() < deadline and not self._closed:
                time.sleep(WAIT_POLL_S)

    def _drop(self, kept) -> None:
        if self._writer is not None and kept is not None:
            shutil.rmtree(kept.folder, ignore_errors=True)

    # --- a lost server coming back ------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.health_poll_s):
            for member in self.members:
                if not member.up and not self._closed and member.engine.health()["ok"]:
                    self._rejoin(member)

    def _rejoin(self, member: Member) -> None:
        """Check the server, give it the current weights, compare its log-probs with those after the load, and put
        it back; on failure it stays down (and is tried again)."""
        with self._lock:
            engine = member.engine
            engine.policy_version = self.policy_version  # what check() labels its weights with (token_versions)
            try:
                engine.check(require_weight_sync=engine._require_weight_sync)
                if self._kept is not None:
                    if self._writer is not None:
                        engine.transfer.send(self._kept)
                    else:
                        engine.transfer.load(self._kept, self.policy_version)
                gap = None
                if self._reference is not None:
                    version, ids, before = self._reference
                    gap = reference_gap(before, engine._prompt_logprobs(ids), engine.dtype, version)
            except VLLMError as error:
                member.cannot_rejoin(error, self.health_poll_s)
                return
            member.requests_since_rejoin, member.refused = 0, None
            self.spread.mark_up(member)
        logger.warning("%s is back: given policy version %d%s; it takes requests again.", member.name,
                       self.policy_version, "" if gap is None else f" (log-probs as the others', gap {gap:.2g})")

    # --- state --------------------------------------------------------------------------------------------------

    def server_metrics(self) -> dict[str, float]:
        """Each server's requests, tokens/s, version, whether up, probe gap (``pool.server_metrics``)."""
        return server_metrics(self.members)

    def health(self) -> dict:
        """``ok`` when at least one server answers ``/health``; ``servers``: each one's ``VLLMEngine.health()``
        with whether the pool uses it, its requests (in all, and since it last rejoined), completion tokens, losses and
        rejoins."""
        servers = [{**member.engine.health(), "up": member.up, "requests": member.requests, "tokens": member.tokens,
                    "requests_since_rejoin": member.requests_since_rejoin, "losses": member.losses,
                    "rejoins": member.rejoins} for member in self.members]
        return {"engine": "vllm", "urls": [m.engine.base_url for m in self.members], "model": self.model_name,
                "policy_version": self.policy_version, "requests_served": self.requests_served,
                "ok": any(server["ok"] for server in servers), "servers": servers}

    def close(self) -> None:
        """Stop the watcher and close every server's client (the servers keep running)."""
        self._closed = True
        if hasattr(self, "_stop"):
            self._stop.set()
        self._drop(getattr(self, "_kept", None))
        if getattr(self, "_writer", None) is not None:
            self._writer.close()
        for member in self.members:
            member.engine.close()
