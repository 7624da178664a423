"""Log-prob references shared by the training and GPU tests: one sequence alone through a plain forward, and
rollouts whose completions share prefixes (the cases prefix sharing must get right)."""

import torch

from verifiers_rl.core.rollout import Rollout
from verifiers_rl.rollouts.synthetic import random_rollouts


def single_sequence_logprobs(model, input_ids, temperature):
    """Reference: one sequence alone, no mask at all, full logits."""
    with torch.no_grad():
        logits = model(torch.tensor([input_ids])).logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(input_ids[1:])[:, None]).squeeze(-1)


def shared_prefix_rollouts(system_prompt_len: int = 0):
    """Groups whose completions share a multi-turn-like first turn (some or all of them), plus a group with a
    duplicated sequence and a completion that is a prefix of another (an empty branch); with ``system_prompt_len``,
    every prompt starts with the same that many tokens (a system prompt: a packed row's root)."""
    rollouts = random_rollouts(4, 4, vocab_size=390, seed=7, fully_masked_fraction=0.1, env_token_fraction=0.3,
                               shared_turn_fraction=1.0, shared_turn_len=(3, 6), system_prompt_len=system_prompt_len)
    system = rollouts[0].prompt_ids[:system_prompt_len]
    edge = [Rollout(system + [9, 10, 11], [20, 21, 22, 23], [1, 1, 0, 1], 1.0, "edge", [-1.0] * 4),
            Rollout(system + [9, 10, 11], [20, 21, 22, 23], [1, 1, 0, 1], 0.0, "edge", [-2.0] * 4),
            Rollout(system + [9, 10, 11], [20, 21], [1, 1], 0.5, "edge", [-1.0] * 2)]
    return rollouts + edge
