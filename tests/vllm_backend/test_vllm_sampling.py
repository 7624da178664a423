"""VLLMEngine's sampling settings against a real vLLM server (CPU): repetition penalty, min-p, top-k and top-p reach
it, and its ``processed_logprobs`` are those of the distribution sampled, equal to an independent HF recomputation
(``tests/helpers/sampling_reference.py``, the embedded engine's order) within the other vLLM log-prob tests' 1e-4."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.envs import RolloutSampling, sampling_for_rollout
from verifiers_rl.inference import SamplingConfig, VLLMEngine
from verifiers_rl.inference.factory import build_engine

from tests.helpers.sampling_reference import penalised, reference_logprobs, step_logits

ATOL = 1e-4
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 40, 7, 93, 150, 22, 301, 64, 5, 17, 250, 3, 99, 40, 40]]
# As in tests/inference/test_sampling_processors.py: T = 0.3 spreads the tiny model's nearly flat logits.
SETTINGS = {
    "min_p": dict(temperature=0.3, min_p=0.2),
    "penalty": dict(temperature=0.3, repetition_penalty=1.5),
    "penalty_below_1": dict(temperature=0.3, repetition_penalty=0.7),
    "all_together": dict(temperature=0.3, min_p=0.05, repetition_penalty=1.3, top_k=40, top_p=0.9),
    "min_p_then_top_p": dict(temperature=0.3, min_p=0.3, top_p=0.5),
    "top_k_top_p": dict(temperature=0.7, top_k=5, top_p=0.8),
}


def seeded(engine, seeds, max_new_tokens=24, temperature=None):
    """One rollout per (prompt, seed), all sent together."""

    async def one(prompt, seed):
        with sampling_for_rollout(RolloutSampling(seed, temperature)):
            return await engine.sample(prompt, max_new_tokens)

    async def go():
        return await asyncio.gather(*(one(prompt, seed) for prompt in PROMPTS for seed in seeds))

    return [(prompt, sample) for prompt, sample in zip([p for p in PROMPTS for _ in seeds], asyncio.run(go()))]


@pytest.mark.parametrize("name", SETTINGS)
def test_processed_logprobs_are_those_of_the_distribution_sampled(untied, name):
    sampling = SETTINGS[name]
    engine = VLLMEngine(untied.url, model=untied.model_dir, sampling=SamplingConfig(**sampling))
    model = untied.hf_model()
    gap_from_plain = 0.0
    for prompt, sample in seeded(engine, range(6)):
        expected = reference_logprobs(model, prompt, sample.token_ids, **sampling)
        assert torch.isfinite(expected).all(), "vLLM sampled a token outside the filtered distribution"
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=ATOL, rtol=0)
        plain = reference_logprobs(model, prompt, sample.token_ids, sampling["temperature"])
        gap_from_plain = max(gap_from_plain, (plain - expected).abs().max().item())
    assert gap_from_plain > 1e-2, "the setting must change the distribution for the check above to mean anything"
    engine.close()


def test_penalised_greedy_decoding_and_its_logprobs(untied):
    """Temperature 0: the argmax of the penalised logits, log-probs of the penalised softmax at T = 1 (min-p and
    top-k do not apply to greedy requests), as the embedded engine."""
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.5, min_p=0.3, top_k=3, max_new_tokens=16)
    engine = VLLMEngine(untied.url, model=untied.model_dir, sampling=sampling)
    model = untied.hf_model()
    unpenalised_differs = False
    for prompt in PROMPTS:
        sample = asyncio.run(engine.sample(prompt))
        raw, ids = step_logits(model, prompt, sample.token_ids), sample.token_ids
        logits = torch.stack([penalised(raw[t], prompt + ids[:t], 1.5) for t in range(len(ids))])
        assert ids == logits.argmax(-1).tolist()
        unpenalised_differs |= ids != raw.argmax(-1).tolist()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=ATOL, rtol=0)
    assert unpenalised_differs, "greedy decoding without the penalty must pick other tokens somewhere"
    engine.close()


def test_the_weight_sync_probe_stays_at_the_plain_softmax(untied):
    """prompt_logprobs (the post-sync probe, compared with the trainer's plain log-probs) is not processed."""
    sampling = SamplingConfig(temperature=0.3, repetition_penalty=1.5, min_p=0.3, top_k=3, top_p=0.5)
    engine = VLLMEngine(untied.url, model=untied.model_dir, sampling=sampling)
    ids = PROMPTS[1]
    with torch.no_grad():
        logits = untied.hf_model()(torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(engine.prompt_logprobs(ids)), expected, atol=ATOL, rtol=0)
    engine.close()


def test_rl_config_knobs_reach_the_server_through_build_engine(untied):
    """RLConfig's fields and generation_kwargs (overriding --temperature) -> build_engine -> the server's sampler."""
    config = RLConfig(output_dir="/tmp/unused", report_to="none", vllm_server_url=untied.url, max_completion_length=24,
                      max_seq_len=256, temperature=1.0, min_p=0.05, repetition_penalty=1.3,
                      generation_kwargs={"temperature": 0.3, "top_k": 40, "top_p": 0.9})
    engine = build_engine(config, untied.model_dir, None)
    sampling = dict(temperature=0.3, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    assert isinstance(engine, VLLMEngine) and engine.sampling == SamplingConfig(max_new_tokens=24, **sampling)
    model = untied.hf_model()
    for prompt, sample in seeded(engine, range(3)):
        expected = reference_logprobs(model, prompt, sample.token_ids, **sampling)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=ATOL, rtol=0)
    engine.close()


def test_more_seeded_prompts_than_a_step_prefills_all_complete(untied):
    """64 seeded requests of distinct 48-token prompts at once: 3,072 prompt tokens, more than vLLM's default step
    budget (2,048), which chunked prefill would split, and vLLM's CPU runner then dies rewinding a seeded generator
    ("CPU Generator does not use offset"); the server is started with whole prefills only (server.py)."""
    engine = VLLMEngine(untied.url, model=untied.model_dir, sampling=SamplingConfig(temperature=1.0))
    prompts = [[(7 * i + j) % 300 + 3 for j in range(48)] for i in range(64)]

    async def one(prompt, seed):
        with sampling_for_rollout(RolloutSampling(seed, None)):
            return await engine.sample(prompt, 8)

    async def go():
        return await asyncio.gather(*(one(prompt, seed) for seed, prompt in enumerate(prompts)))

    try:
        samples = asyncio.run(go())
    finally:
        engine.close()
    assert all(1 <= len(sample.token_ids) <= 8 for sample in samples)
    again = VLLMEngine(untied.url, model=untied.model_dir, sampling=SamplingConfig(temperature=1.0))
    try:  # the server still serves, and a seed still gives the same tokens
        with sampling_for_rollout(RolloutSampling(5, None)):
            repeat = asyncio.run(again.sample(prompts[5], 8))
    finally:
        again.close()
    assert repeat.token_ids == samples[5].token_ids
