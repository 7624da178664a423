"""The embedded engine's tests' common parts: the tiny model loaded for the trainer, prompts, seeded sampling as
an environment's rollout does it, and the trainer-vs-sampler log-prob parity check."""

import asyncio

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifiers_rl.core.rollout import Rollout
from verifiers_rl.envs import RolloutSampling, sampling_for_rollout
from verifiers_rl.training.batching import collate, global_counts, prepare_sequences
from verifiers_rl.training.forward import micro_batch_logprobs

TEXTS = [
    "What is 2 + 2?",
    "Reverse the text: hello world",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Guess",
    "calculator(expression='12 / 4') returned",
]


def load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


def prompts_of(tokenizer, texts=TEXTS):
    return [tokenizer(text)["input_ids"] for text in texts]


def is_ratios(trainer_model, prompts, samples, temperature, packed=False, pad_token_id=0):
    """exp(trainer - sampler) on every completion token, through the trainer's own batching and log-prob code."""
    rollouts = [
        Rollout(p, s.token_ids, [1] * len(s.token_ids), 0.0, 0, completion_logprobs=s.logprobs)
        for p, s in zip(prompts, samples)
    ]
    sequences = prepare_sequences(rollouts, [0.0] * len(rollouts), max_seq_len=4096)
    mb = collate(sequences, global_counts(sequences, 4096), packed=packed, pad_token_id=pad_token_id)
    with torch.no_grad():
        trainer = micro_batch_logprobs(trainer_model, mb, temperature=temperature).logps
    mask = mb.loss_mask > 0
    assert int(mask.sum()) == sum(len(s.token_ids) for s in samples) > 0
    return torch.exp(trainer[mask].double() - mb.sampler_logps[mask].double())


def assert_parity(trainer_model, prompts, samples, temperature):
    for packed in (False, True):
        ratios = is_ratios(trainer_model, prompts, samples, temperature, packed)
        assert (ratios - 1).abs().max().item() < 1e-4, (packed, ratios)


def sample_seeded(engine, prompts, seeds, max_new_tokens=16, temperature=None):
    """Each prompt sampled in its own task under ``RolloutSampling(seed, temperature)``, as an environment's rollout."""

    async def one(prompt, seed):
        with sampling_for_rollout(RolloutSampling(seed, temperature)):
            return await engine.sample(prompt, max_new_tokens)

    async def run():
        return await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds)))

    return asyncio.run(run())
