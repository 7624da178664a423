"""The small interface every inference engine implements: the embedded HF engine, a vLLM client.

Environments call ``await engine.sample(prompt_ids, max_new_tokens)`` from many coroutines at once; the engine
batches them. The trainer calls ``load_weights`` after each optimizer step and bumps ``policy_version``, then
(for engines with ``prompt_logprobs``) checks the engine's log-probs of a fixed probe against its own.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Iterable, Protocol, runtime_checkable

import torch

# The record environments consume lives beside them (envs know nothing of engines); re-exported from here.
# Engines fill ``logprobs[t]`` with the log-prob of ``token_ids[t]`` under the distribution it was drawn from (the
# ``SamplingConfig``'s, renormalised): with the defaults that is log softmax(logits_t / temperature)[token_ids[t]],
# the quantity the trainer computes for the policy at the sampling temperature; the eos that ends a "stop" sample is
# in ``token_ids``.
from verifiers_rl.core.sampling import FINISH_REASONS, RolloutSampling, Sample, rollout_sampling  # noqa: F401


@dataclass
class SamplingConfig:
    """How an engine samples, in vLLM's order: ``repetition_penalty`` on the raw logits (over the row's prompt and
    generated tokens, HF's ``RepetitionPenaltyLogitsProcessor``), ``temperature``, then ``min_p``, ``top_k``,
    ``top_p``. ``temperature=0`` is greedy (the argmax of the penalised logits; the filters do not apply). The
    defaults (``repetition_penalty=1``, ``min_p=0``, ``top_k=0``, ``top_p=1``) sample from the full tempered softmax,
    which is what the trainer's log-probs describe; other settings make the sampler's distribution differ from it,
    and the engines' log-probs are those of the distribution sampled (the importance correction divides by them)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = field(default=256, metadata={"from": "max_completion_length"})  # settings_from reads it
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # NaN too: it would sample nothing sensible
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:  # RLConfig: max_completion_length
            raise ValueError(f"max_new_tokens (--max_completion_length) must be an int >= 1, "
                             f"got {self.max_new_tokens}.")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}.")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}.")

    def new_tokens(self, max_new_tokens: int | None) -> int:
        """A call's ``max_new_tokens``, ``self.max_new_tokens`` when None; raises when < 1."""
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        return max_new_tokens

    def for_this_call(self) -> tuple[float, int | None]:
        """(temperature, seed) of one model call: the calling rollout's ``RolloutSampling`` seed (next in its
        sequence) and temperature override, else this config's temperature and no seed. Call it once per model
        call, at the start of ``sample``, in the caller's task (the rollout's context)."""
        rollout = rollout_sampling()
        if rollout is None:
            return self.temperature, None
        temperature = self.temperature if rollout.temperature is None else float(rollout.temperature)
        return temperature, rollout.next_seed()


class EngineClosedError(RuntimeError):
    """A call to an engine after ``close()``."""


def check_open(closed: bool) -> None:
    if closed:
        raise EngineClosedError("The engine is closed.")


def check_sequences_fit(engine, max_seq_len: int | None) -> None:
    """An engine with a sequence limit of its own (a vLLM server's --max-model-len: ``take_sequences``) must hold
    ``max_seq_len`` tokens (None: nothing is generated); others take any length."""
    takes = getattr(engine, "take_sequences", None)
    if takes is not None and max_seq_len is not None:
        takes(max_seq_len)


def check_token_ids(token_ids: Iterable[int], vocab_size: int | None, name: str = "prompt_ids",
                    min_length: int = 1) -> list[int]:
    """``token_ids`` as ints; raises when there are fewer than ``min_length`` or one is outside [0, vocab_size)
    (only the lower bound when ``vocab_size`` is unknown). Engines check a request alone, so one bad request
    fails by itself instead of failing a whole batch."""
    token_ids = [int(t) for t in token_ids]
    if len(token_ids) < min_length:
        if min_length == 1:
            raise ValueError(f"{name} is empty; the first completion token needs a context.")
        raise ValueError(f"{name} needs at least {min_length} tokens, got {len(token_ids)}.")
    bad = [t for t in token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise ValueError(f"{name} hold ids outside the vocabulary [0, {vocab_size}): {bad[:5]}.")
    return token_ids


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (for a server, a rendezvous or a launch to bind next)."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) reaches this machine's loopback only: a server listening there is
    out of other machines' reach (``0.0.0.0`` and real interfaces are not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: loopback only if every address it resolves to is
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except socket.gaierror:
            return False
        return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


# The vLLM worker extension (verifiers_rl/vllm_worker/vllm_weight_sync.py) as vLLM imports it: the launcher passes
# it to the server, the client names it in errors.
WORKER_EXTENSION = "vllm_weight_sync.WeightSyncExtension"


@runtime_checkable
class InferenceEngine(Protocol):
    """Generate with token ids + log-probs, load new weights, report health."""

    policy_version: int

    async def sample(self, prompt_ids: list[int], max_new_tokens: int) -> Sample:
        """Sample one completion of ``prompt_ids``; concurrent calls are batched by the engine."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load ``(name, tensor)`` pairs into the engine, then set ``policy_version`` to ``version``.

        ``named_tensors`` is a stream (``verifiers_rl.training.weight_stream.gathered_named_weights``): names are the plain
        Hugging Face model's (LoRA merged, a tied embedding sent once under the input embedding's name, so the
        engine must keep its output layer tied to it), and each tensor is valid only until the next item is
        requested, because the trainer gathers ZeRO-3 shards bucket by bucket and frees each bucket after it. Copy
        or send every tensor as it arrives and keep no reference. Consume the stream to its end; the trainer drains
        whatever is left (the other ranks are still gathering) and counts an early return as a failure.

        Raise on failure: the trainer then stops every rank with the error. Whether a failed load leaves the old
        weights (the embedded engine stages and swaps atomically) or a mix (a server written tensor by tensor) is
        the engine's to document; training stops after a failed load, so nothing sampled then is trained on.
        The trainer calls this while holding the generator's batch lock, so no batch straddles two versions.
        """

    def health(self) -> dict:
        """At least ``{"model": ..., "policy_version": ..., "ok": bool}``."""

    def close(self) -> None:
        """Release the engine; later ``sample`` calls fail."""


@runtime_checkable
class SupportsPromptLogprobs(Protocol):
    """Optional: engines that have it are checked after every weight load (the post-sync probe).

    The trainer compares these log-probs with its own for a fixed ~32-token sequence and warns loudly when they
    differ (stale layers: a tied output layer not refreshed, a tensor skipped). Engines without it skip the probe.
    """

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """``log p(token_t | tokens_<t)`` for t = 1 .. n-1 at temperature 1 (n - 1 floats), current weights."""
