"""The one thing environments need from an inference engine: sample a completion of token ids, with log-probs."""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import random
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from verifiers_rl.core.rollout import NOT_SAMPLED, Rollout

FINISH_REASONS = ("stop", "length")


@dataclass
class Sample:
    """A completion as the model produced it.

    ``token_ids`` may end with an eos or stop token; ``logprobs`` holds the sampler's log-prob of each token;
    ``finish_reason`` is ``"stop"`` (eos or a stop token) or ``"length"`` (hit ``max_new_tokens``).
    ``versions``: the policy version that sampled each token, where the engine knows it per token (one decoding
    across a weight load holds two); None where the engine does not say.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int] | None = None

    def validate(self, max_new_tokens: int) -> None:
        """Raise ValueError if the sample breaks the sampler contract for a call with ``max_new_tokens``."""
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"The sampler returned {len(self.token_ids)} token ids but {len(self.logprobs)} log-probs."
            )
        if len(self.token_ids) > max_new_tokens:
            raise ValueError(
                f"The sampler returned {len(self.token_ids)} tokens, more than max_new_tokens={max_new_tokens}."
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"The sampler returned finish_reason={self.finish_reason!r}; expected one of {FINISH_REASONS}."
            )
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(
                f"The sampler returned {len(self.token_ids)} token ids but {len(self.versions)} versions."
            )


class Sampler(Protocol):
    """Implemented by inference engines; concurrent ``sample`` calls are expected (and batched by the engine)."""

    async def sample(self, prompt_ids: list[int], max_new_tokens: int) -> Sample:
        """Sample a completion of ``prompt_ids`` of at most ``max_new_tokens`` tokens."""
        ...


# --- how the model calls of one rollout sample ---------------------------------------------------------------------


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (ints and strings), the same in every process and Python version (``hash`` is
    salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def epoch_order(size: int, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """The order of ``size`` dataset rows in epoch ``epoch``: a shuffle seeded by ``seed + epoch`` (the dataset's order
    without ``shuffle``, TRL's shuffle_dataset=False). The generator's draws and a curriculum's both read it."""
    order = list(range(size))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


def refill_sample(candidates: Sequence[int], count: int, seed: int, index: int, round_: int) -> list[int]:
    """Dynamic sampling's refill rows of batch ``index``, round ``round_`` (one environment): ``count`` of
    ``candidates`` (at most all of them), a sample seeded by the run's ``seed`` and the round, so a resume refills
    alike."""
    return random.Random(derive_seed(seed, "refill", index, round_)).sample(candidates, min(count, len(candidates)))


@dataclass
class RolloutSampling:
    """How the model calls of one rollout sample; set around the rollout by whoever runs it (the trainer's
    generator, evaluation) and read by the engine inside ``sample``.

    ``seed``: the rollout's base seed; its k-th model call samples with ``derive_seed(seed, k)``, so a rollout's
    tokens do not depend on which other requests an engine batches it with, or on any global random state (a
    resumed run regenerates exactly what the uninterrupted run generated). ``None`` samples from the engine's
    global random state. ``temperature``: overrides the engine's sampling temperature (0 = greedy), e.g. for
    evaluation; ``None`` keeps the engine's. ``versions``: the policy version of every token the rollout's model
    calls sampled, in call order (engines append through ``record_versions``; ``set_completion_versions`` reads it).
    """

    seed: int | None = None
    temperature: float | None = None
    calls: int = 0
    versions: list[int] = field(default_factory=list)

    def next_seed(self) -> int | None:
        if self.seed is None:
            return None
        self.calls += 1
        return derive_seed(self.seed, self.calls - 1)

    def record_versions(self, versions: Sequence[int]) -> None:
        """Append the policy versions of one model call's sampled tokens (an engine calls it in ``sample``)."""
        self.versions.extend(int(v) for v in versions)


def set_completion_versions(rollout: Rollout, sampling: RolloutSampling | None) -> None:
    """Set ``rollout.completion_versions`` from the versions ``sampling`` recorded while it was built.

    When the rollout's trained tokens (``completion_mask`` 1) are as many as the tokens recorded, the i-th trained
    token gets the i-th recorded version. Otherwise (a truncated or re-tokenised completion, several branches of one
    episode, a worker that sampled tokens of its own) which token came from which call is unknown, and every
    trained token gets the OLDEST recorded version: conservative, a staleness bound then counts the whole completion
    as old as its oldest token. Environment tokens (mask 0) get ``NOT_SAMPLED``. Nothing is set when nothing was
    recorded (an engine that does not say), nor when the rollout already carries versions.
    """
    if sampling is None or not sampling.versions or rollout.completion_versions is not None:
        return
    recorded = sampling.versions
    trained = sum(1 for m in rollout.completion_mask if m)
    if trained == len(recorded):
        drawn = iter(recorded)
        rollout.completion_versions = [next(drawn) if m else NOT_SAMPLED for m in rollout.completion_mask]
    else:
        oldest = min(recorded)
        rollout.completion_versions = [oldest if m else NOT_SAMPLED for m in rollout.completion_mask]


_ROLLOUT_SAMPLING: contextvars.ContextVar[RolloutSampling | None] = contextvars.ContextVar(
    "verifiers_rl_rollout_sampling", default=None
)


def rollout_sampling() -> RolloutSampling | None:
    """The sampling settings of the rollout the calling task belongs to (engines call this inside ``sample``)."""
    return _ROLLOUT_SAMPLING.get()


@contextlib.contextmanager
def sampling_for_rollout(sampling: RolloutSampling | None):
    """Run a rollout's model calls under ``sampling``. asyncio tasks copy the context when they are created, so
    set it inside the rollout's own task (as ``Environment.rollout_group`` does), before any ``sample`` call."""
    token = _ROLLOUT_SAMPLING.set(sampling)
    try:
        yield sampling
    finally:
        _ROLLOUT_SAMPLING.reset(token)
