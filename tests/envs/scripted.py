"""A scripted sampler: stands in for the model (and its inference engine) in environment tests."""

from __future__ import annotations

from verifiers_rl.envs import Sample


class ScriptedSampler:
    """Returns predetermined completions (token id lists), one per call in call order, with made-up log-probs.

    Like a real engine, a completion longer than ``max_new_tokens`` is cut there with finish_reason "length".
    ``calls`` records each call's (prompt_ids, max_new_tokens).
    """

    def __init__(self, completions: list[list[int]]):
        self.completions = list(completions)
        self.calls: list[tuple[list[int], int]] = []

    async def sample(self, prompt_ids: list[int], max_new_tokens: int) -> Sample:
        self.calls.append((list(prompt_ids), max_new_tokens))
        if not self.completions:
            raise AssertionError("ScriptedSampler: more sample calls than scripted completions.")
        ids = self.completions.pop(0)
        kept = ids[:max_new_tokens]
        logprobs = [-0.5 - 0.01 * (len(self.calls) * 100 + i) for i in range(len(kept))]
        return Sample(kept, logprobs, "length" if len(ids) > max_new_tokens else "stop")
