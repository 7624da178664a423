"""The one thing environments need from an inference engine: sample a completion of token ids, with log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

FINISH_REASONS = ("stop", "length")


@dataclass
class Sample:
    """A completion as the model produced it.

    ``token_ids`` may end with an eos or stop token; ``logprobs`` holds the sampler's log-prob of each token;
    ``finish_reason`` is ``"stop"`` (eos or a stop token) or ``"length"`` (hit ``max_new_tokens``).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str

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


class Sampler(Protocol):
    """Implemented by inference engines; concurrent ``sample`` calls are expected (and batched by the engine)."""

    async def sample(self, prompt_ids: list[int], max_new_tokens: int) -> Sample:
        """Sample a completion of ``prompt_ids`` of at most ``max_new_tokens`` tokens."""
        ...
