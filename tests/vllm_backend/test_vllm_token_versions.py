"""Per-token weight versions from a real vLLM server (``VLLMEngine(token_versions=True)``, what continuous generation
uses): the same samples as the OpenAI routes, each token labelled with the weights that sampled it, exactly, when a
weight load lands in the middle of a sample; refused by name where the server lacks the route."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tests.vllm_backend.launching import hf_prompt_logprobs
from verifiers_rl.core.sampling import RolloutSampling, sampling_for_rollout
from verifiers_rl.inference import VLLMEngine
from verifiers_rl.inference.vllm.http import VLLMError

PROMPT = [5, 17, 33, 8, 90]
CHAT = [{"role": "user", "content": "Reverse the word 'lantern'."}]


def test_samples_and_chats_are_those_of_the_openai_routes_and_carry_their_version(untied):
    plain = VLLMEngine(untied.url, model=untied.model_dir)
    labelled = VLLMEngine(untied.url, model=untied.model_dir, token_versions=True)
    try:
        async def calls(engine):
            rollout = RolloutSampling(seed=11)
            with sampling_for_rollout(rollout):  # the rollout's seeds drive both calls; its versions are recorded
                sample = await engine.sample(PROMPT, 24)
                chat = await engine.chat(CHAT, 16)
            return sample, chat, rollout.versions

        sample, chat, _ = asyncio.run(calls(plain))
        labelled_sample, labelled_chat, recorded = asyncio.run(calls(labelled))
    finally:
        plain.close()
        labelled.close()
    assert sample.versions is None and chat.sample.versions is None  # the OpenAI routes say nothing of versions
    assert labelled_sample.token_ids == sample.token_ids and labelled_sample.logprobs == sample.logprobs
    assert labelled_sample.finish_reason == sample.finish_reason
    assert labelled_chat.prompt_ids == chat.prompt_ids  # the server's chat template, rendered the same
    assert labelled_chat.sample.token_ids == chat.sample.token_ids
    assert labelled_chat.sample.logprobs == chat.sample.logprobs
    assert labelled_sample.versions == [0] * len(sample.token_ids)
    assert labelled_chat.sample.versions == [0] * len(chat.sample.token_ids)
    assert recorded == labelled_sample.versions + labelled_chat.sample.versions


def _sample_across_a_load(engine: VLLMEngine, seed: int, weights, version: int):
    """A 400-token sample of PROMPT, with ``weights`` loaded as ``version`` while it decodes."""
    payload, result = engine._sampling_payload, {}
    # vLLM's own "ignore_eos" (our client never sends it): the sample cannot end at an eos before the load lands, as
    # samples of ~300 tokens did on a loaded machine; it runs its 400 tokens, several seconds on two cores.
    engine._sampling_payload = lambda *args: {**payload(*args), "ignore_eos": True}
    thread = threading.Thread(
        target=lambda: result.update(sample=asyncio.run(engine.sample(PROMPT, 400, draw=(1.0, seed)))))
    thread.start()
    time.sleep(0.5)  # ~20-40 tokens decoded on two cores
    engine.load_weights(weights.named_parameters(), version)
    thread.join(timeout=120)
    engine._sampling_payload = payload
    assert len(result["sample"].token_ids) == 400
    return result["sample"]


def test_a_sample_that_spans_a_weight_load_labels_each_token_with_the_weights_that_sampled_it(untied):
    # The load pauses the server with the request kept, loads, labels, resumes: the tokens before the boundary are
    # the old weights' (their log-probs are HF's of the old model), the first one after it is not.
    before, after = untied.hf_model(), untied.hf_model("other")
    engine = VLLMEngine(untied.url, model=untied.model_dir, token_versions=True)
    untied.dirty = True
    try:
        # Should the load still land after the sample's last token (a machine stalled for seconds): another seed.
        for attempt in range(3):
            old = 2 * attempt
            if attempt:
                engine.load_weights(before.named_parameters(), old)  # the old weights again, nothing in flight
            sample = _sample_across_a_load(engine, seed=attempt, weights=after, version=old + 1)
            split = sample.versions.count(old)
            if 0 < split < len(sample.versions):
                break
        else:
            pytest.fail(f"no sample was decoding when its load landed in 3 tries (last versions {sample.versions})")
        assert engine.policy_version == old + 1
    finally:
        engine.close()
    assert sample.versions == [old] * split + [old + 1] * (len(sample.versions) - split)
    served = torch.tensor(sample.logprobs)
    reference = hf_prompt_logprobs(untied.model_dir, PROMPT + sample.token_ids)[len(PROMPT) - 1:]
    torch.testing.assert_close(served[:split], reference[:split], atol=1e-4, rtol=0)
    assert abs(served[split] - reference[split]) > 1e-3, (split, served[split - 1:split + 2], reference[split - 1:])


def test_a_server_without_the_generate_route_is_refused_by_name(tied):
    # The session's tied-model server runs with --no-enable-scale-out, as a server started by hand may.
    with pytest.raises(VLLMError, match=r"start it with --enable-scale-out and VLLM_SERVER_DEV_MODE=1"):
        VLLMEngine(tied.url, model=tied.model_dir, token_versions=True)
    VLLMEngine(tied.url, model=tied.model_dir).close()  # without per-token versions it serves as before
