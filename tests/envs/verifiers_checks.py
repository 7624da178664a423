"""What the verifiers tests check rollouts against (embedded engine and vLLM): each run of model tokens, and the
test environment's rubric recomputed from the completions."""

import verifiers as vf

from . import vf_envs


def model_turns(rollout):
    """(start position in prompt + completion, ids, log-probs) of each run of model tokens (mask 1)."""
    turns, start = [], None
    for position, flag in enumerate(rollout.completion_mask + [0]):
        if flag and start is None:
            start = position
        elif not flag and start is not None:
            span = slice(start, position)
            turns.append((len(rollout.prompt_ids) + start, rollout.completion_ids[span], rollout.completion_logprobs[span]))
            start = None
    return turns


def rubric_reward(rollouts):
    """vf_envs' rubric (vowel_fraction + 0.5 * longest_in_group) recomputed from the rollouts' completions."""
    completions = [[vf.AssistantMessage(content=m["content"]) for m in r.completion if m["role"] == "assistant"]
                   for r in rollouts]
    longest = vf_envs.longest_in_group(completions)
    return [vf_envs.vowel_fraction(c) + 0.5 * g for c, g in zip(completions, longest)]
