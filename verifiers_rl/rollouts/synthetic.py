"""Random rollouts with ragged lengths, for tests, benchmarks and smoke runs without an inference engine."""

from __future__ import annotations

import random

from verifiers_rl.core.rollout import Rollout


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
    shared_turn_fraction: float = 0.0,
    shared_turn_len: tuple[int, int] = (1, 8),
    system_prompt_len: int = 0,
    branch_fraction: float = 0.0,
) -> list[Rollout]:
    """Groups of rollouts with random ids, ragged lengths, some environment tokens (mask 0) inside
    completions and some fully masked completions; sampler log-probs drawn near a plausible range. Every rollout of
    a group has the group's prompt.

    ``shared_turn_fraction``: the fraction of groups with a multi-turn-like first turn (``shared_turn_len`` tokens,
    trained and environment tokens) that each of their completions starts with at probability 1/2, so a group's
    common token prefix runs past the prompt for some of its sequences (or for all of them).

    ``system_prompt_len``: every group's prompt starts with the same that many tokens (a system prompt), then its own.

    ``branch_fraction``: each rollout but a group's first is, at this probability, one more branch of the episode
    before it (``Rollout.episode_id``, the episode's reward): episodes of several branches, as a verifiers v1
    episode with a sub-agent has.
    """
    rng = random.Random(seed)
    rollouts = []
    system = [rng.randrange(first_token_id, vocab_size) for _ in range(system_prompt_len)]
    for group in range(num_groups):
        prompt = system + [rng.randrange(first_token_id, vocab_size) for _ in range(rng.randint(*prompt_len))]
        turn: list[int] = []
        if shared_turn_fraction and rng.random() < shared_turn_fraction:
            turn = [rng.randrange(first_token_id, vocab_size) for _ in range(rng.randint(*shared_turn_len))]
        episode = -1
        for member in range(group_size):
            branch = member > 0 and bool(branch_fraction) and rng.random() < branch_fraction
            episode += not branch
            n = rng.randint(*completion_len)
            completion = [rng.randrange(first_token_id, vocab_size) for _ in range(n)]
            if turn and rng.random() < 0.5:
                completion = (turn + completion)[: max(n, len(turn))]
                n = len(completion)
            if rng.random() < fully_masked_fraction:
                mask = [0] * n
            else:
                mask = [0 if rng.random() < env_token_fraction else 1 for _ in range(n)]
            logprobs = [-rng.uniform(0.5, 8.0) for _ in range(n)] if with_logprobs else None
            reward = rng.choice([0.0, 0.25, 0.5, 1.0])
            rollouts.append(
                Rollout(
                    prompt_ids=list(prompt),
                    completion_ids=completion,
                    completion_mask=mask,
                    completion_logprobs=logprobs,
                    reward=rollouts[-1].reward if branch else reward,
                    group_id=f"g{group}",
                )
            )
            if branch_fraction:
                rollouts[-1].episode_id = episode
    return rollouts
