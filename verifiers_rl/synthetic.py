"""Random rollouts with ragged lengths, for tests, benchmarks and smoke runs without an inference engine."""

from __future__ import annotations

import random

from .rollouts import Rollout


def random_rollouts(
    num_groups: int,
    group_size: int,
    *,
    vocab_size: int,
    seed: int = 0,
    prompt_len: tuple[int, int] = (2, 12),
    completion_len: tuple[int, int] = (1, 24),
    with_logprobs: bool = True,
    env_token_fraction: float = 0.1,
    fully_masked_fraction: float = 0.1,
    first_token_id: int = 4,
) -> list[Rollout]:
    """Groups of rollouts with random ids, ragged lengths, some environment tokens (mask 0) inside
    completions and some fully masked completions; sampler log-probs drawn near a plausible range."""
    rng = random.Random(seed)
    rollouts = []
    for group in range(num_groups):
        prompt = [rng.randrange(first_token_id, vocab_size) for _ in range(rng.randint(*prompt_len))]
        for _ in range(group_size):
            n = rng.randint(*completion_len)
            completion = [rng.randrange(first_token_id, vocab_size) for _ in range(n)]
            if rng.random() < fully_masked_fraction:
                mask = [0] * n
            else:
                mask = [0 if rng.random() < env_token_fraction else 1 for _ in range(n)]
            logprobs = [-rng.uniform(0.5, 8.0) for _ in range(n)] if with_logprobs else None
            rollouts.append(
                Rollout(
                    prompt_ids=list(prompt),
                    completion_ids=completion,
                    completion_mask=mask,
                    completion_logprobs=logprobs,
                    reward=rng.choice([0.0, 0.25, 0.5, 1.0]),
                    group_id=f"g{group}",
                )
            )
    return rollouts
