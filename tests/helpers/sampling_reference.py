"""An independent recomputation of what an engine sampled from (a helper module for the embedded and vLLM tests).

One plain forward of prompt + completion (one row: no padding, no key/value cache, no Gumbel noise), then, step by
step, transformers' processors applied by hand in the engines' (vLLM's) order: repetition penalty over the prompt
and the tokens generated so far, temperature, min-p, top-k, top-p. Temperature 0 is greedy: the penalised logits at
temperature 1, no filter.
"""

from __future__ import annotations

import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper


@torch.no_grad()
def step_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """``[len(completion), vocab]`` raw logits that predict each completion token."""
    ids = torch.tensor([prompt + completion])
    return model(ids).logits[0, len(prompt) - 1 : -1].float()


def penalised(logits: torch.Tensor, context: list[int], penalty: float) -> torch.Tensor:
    """The repetition penalty by its formula (CTRL, as HF and vLLM define it): a logit of a token seen in the
    context is divided by ``penalty`` when positive, multiplied by it otherwise."""
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
    seen[torch.tensor(context)] = True
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def processed(raw: torch.Tensor, context: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0, repetition_penalty: float = 1.0) -> torch.Tensor:
    """One step's sampling distribution as logits (-inf where filtered), from its raw ``[vocab]`` logits."""
    ids, logits = torch.tensor([context]), raw[None].clone()
    if repetition_penalty != 1:
        logits = RepetitionPenaltyLogitsProcessor(float(repetition_penalty))(ids, logits)
    if temperature == 0:
        return logits[0]
    logits = logits / temperature
    warpers = (([MinPLogitsWarper(float(min_p))] if min_p else []) + ([TopKLogitsWarper(top_k)] if top_k else [])
               + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    for warper in warpers:
        logits = warper(ids, logits)
    return logits[0]


def reference_logprobs(model, prompt: list[int], completion: list[int], temperature: float, **sampling) -> torch.Tensor:
    """log p(completion[t]) under each step's processed distribution (``processed``'s keywords)."""
    raw = step_logits(model, prompt, completion)
    return torch.stack([
        torch.log_softmax(processed(raw[t], prompt + completion[:t], temperature, **sampling), -1)[token]
        for t, token in enumerate(completion)
    ])


def spy_on_sampler(monkeypatch) -> list:
    """Every decode step of the embedded engine: (its RowSampler, the raw logits of the batch rows still decoding,
    those rows, the scores whose argmax is the sample)."""
    from verifiers_rl.inference.embedded.engine import RowSampler

    steps, distribution = [], RowSampler.distribution

    def spy(sampler, input_ids, scores, rows):
        processed, noisy = distribution(sampler, input_ids, scores, rows)
        steps.append((sampler, scores.clone(), list(rows), noisy))
        return processed, noisy

    monkeypatch.setattr(RowSampler, "distribution", spy)
    return steps
