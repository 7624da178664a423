"""A verifiers 0.4 environment written from vf-init's template (tests/v1/envs/reverse_v1.py), run unchanged by the
episode worker in its own venv, sampling from the embedded engine through the loopback endpoint: the traces carry
the engine's exact ids and log-probs, the chat template's prompt, and the taskset's own reward and metric."""

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from verifiers_rl.envs import RolloutSampling, sampling_for_rollout
from verifiers_rl.envs.adapters.verifiers_v1 import EpisodeWorker, EpisodeWorkerError
from verifiers_rl.envs.adapters.generate_endpoint import GenerateEndpoint

from .conftest import Recording

ENV = Path(__file__).parent / "envs" / "reverse_v1.py"
WORDS = ["hello", "world", "stone"]




def episodes(engine, model_dir, harness, tasks, seeds):
    async def go():
        async with GenerateEndpoint(engine, max_model_len=128, model_name="tiny") as ep:
            async with EpisodeWorker(ep.api_key) as worker:
                loaded = await worker.load(str(ENV), {"taskset": {"num_tasks": 3}}, harness=harness)

                async def one(task, seed):
                    with ep.rollout(RolloutSampling(seed=seed)) as base_url:
                        return await worker.run(task, base_url, "tiny", model_dir)

                results = await asyncio.gather(*(one(t, s) for t, s in zip(tasks, seeds)))
                with pytest.raises(EpisodeWorkerError, match="IndexError"):
                    await worker.run(7, "http://127.0.0.1:1/v1", "tiny", model_dir)
                return loaded, results

    return asyncio.run(go())


def direct(engine, prompt_ids, seed):
    async def go():
        with sampling_for_rollout(RolloutSampling(seed=seed)):
            return await engine.sample(prompt_ids, 10)

    return asyncio.run(go())


@pytest.mark.parametrize("harness", ["inprocess", "null"])
def test_traces_are_the_engines_samples_and_the_tasksets_rewards(engine, tiny_model_dir, harness):
    tasks, seeds = [0, 1, 2], [11, 12, 13]
    recording = Recording(engine)
    loaded, results = episodes(recording, tiny_model_dir, harness, tasks, seeds)
    assert len(recording.samples) == 3
    assert loaded["num_tasks"] == 3 and [t["answer"] for t in loaded["tasks"]] == [w[::-1] for w in WORDS]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for task, seed, result in zip(tasks, seeds, results):
        assert result["ok"], result["errors"]
        [trace] = result["traces"]
        [branch] = trace["branches"]
        ids, mask, logprobs = branch["token_ids"], branch["sampled_mask"], branch["logprobs"]
        n_prompt = mask.index(True)
        assert all(mask[n_prompt:]) and not any(mask[:n_prompt])  # one turn: the prompt, then the sampled tokens
        prompt_ids = ids[:n_prompt]
        expected_prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Reverse the text: {WORDS[task]}"}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        assert prompt_ids == list(expected_prompt)
        sample = recording.samples[tuple(ids[n_prompt:])]
        assert logprobs[n_prompt:] == sample.logprobs and logprobs[:n_prompt] == [0.0] * n_prompt  # bit-exact
        alone = direct(engine, prompt_ids, seed)  # the rollout's first call samples with its first seed
        assert alone.token_ids == sample.token_ids
        assert alone.logprobs == pytest.approx(sample.logprobs, abs=1e-5)
        reply = tokenizer.decode(sample.token_ids, skip_special_tokens=True).strip()
        assert trace["metrics"] == {"reply_chars": float(len(reply))}
        assert trace["rewards"] == {"reward": float(reply == WORDS[task][::-1])} and trace["reward"] == trace["rewards"]["reward"]
    assert len({tuple(r["traces"][0]["branches"][0]["token_ids"]) for r in results}) == 3
