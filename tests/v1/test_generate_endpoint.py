"""The loopback endpoint v1's train client calls: exactly the engine's samples, /models, the API key, refusals."""

import asyncio

import httpx
import pytest

from verifiers_rl.envs import RolloutSampling, sampling_for_rollout
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.envs.adapters.generate_endpoint import GenerateEndpoint

PROMPT = [5, 17, 42, 8, 99, 3]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(temperature=1.0, max_new_tokens=12))
    yield engine
    engine.close()


def run(coro):
    return asyncio.run(coro)


def post(base_url, key, body):
    root = base_url.removesuffix("/v1")
    return httpx.AsyncClient(timeout=60).post(f"{root}/inference/v1/generate", json=body,
                                              headers={"Authorization": f"Bearer {key}"})


def test_generate_is_the_engines_sample_for_the_same_seed(engine):
    async def go():
        with sampling_for_rollout(RolloutSampling(seed=1234)):
            direct = [await engine.sample(PROMPT, 12), await engine.sample(PROMPT, 12)]
        async with GenerateEndpoint(engine, max_model_len=64) as ep:
            with ep.rollout(RolloutSampling(seed=1234)) as base_url:
                async with httpx.AsyncClient(timeout=60) as client:
                    root = base_url.removesuffix("/v1")
                    answers = []
                    for _ in range(2):  # the rollout's 2nd call samples with its 2nd seed, as in process
                        r = await client.post(f"{root}/inference/v1/generate",
                                              json={"model": "m", "token_ids": PROMPT,
                                                    "sampling_params": {"max_tokens": 12, "logprobs": 1}},
                                              headers={"Authorization": f"Bearer {ep.api_key}"})
                        assert r.status_code == 200, r.text
                        answers.append(r.json())
            return direct, answers, ep.requests_served

    direct, answers, served = run(go())
    assert served == 2
    assert direct[0].token_ids != direct[1].token_ids  # two seeds: the comparison below can tell them apart
    for sample, answer in zip(direct, answers):
        choice = answer["choices"][0]
        assert choice["token_ids"] == sample.token_ids
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == sample.logprobs  # bit-exact through JSON
        assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in sample.token_ids]
        assert choice["finish_reason"] == sample.finish_reason
        assert answer["prompt_token_ids"] == PROMPT
        assert answer["policy_version"] == 0


def test_models_key_and_refusals(engine):
    async def go():
        async with GenerateEndpoint(engine, max_model_len=20, model_name="tiny") as ep:
            with ep.rollout(RolloutSampling(seed=1)) as base_url:
                auth = {"Authorization": f"Bearer {ep.api_key}"}
                root = base_url.removesuffix("/v1")
                async with httpx.AsyncClient(timeout=60) as c:
                    models = await c.get(f"{base_url}/models", headers=auth)
                    no_key = await c.get(f"{base_url}/models")
                    wrong = await c.post(f"{root}/inference/v1/generate", json={"token_ids": PROMPT},
                                         headers={"Authorization": "Bearer nope"})
                    too_long = await c.post(f"{root}/inference/v1/generate", json={"token_ids": list(range(20))},
                                            headers=auth)
                    bad_stop = await c.post(f"{root}/inference/v1/generate",
                                            json={"token_ids": PROMPT, "sampling_params": {"stop_token_ids": [7]}},
                                            headers=auth)
                    capped = await c.post(f"{root}/inference/v1/generate",
                                          json={"token_ids": list(range(3, 19)), "sampling_params": {"max_tokens": 50}},
                                          headers=auth)
                    unknown = await c.post(f"http://127.0.0.1:{ep.port}/r/0000/inference/v1/generate",
                                           json={"token_ids": PROMPT}, headers=auth)
            return models, no_key, wrong, too_long, bad_stop, capped, unknown, ep.requests_served

    models, no_key, wrong, too_long, bad_stop, capped, unknown, served = run(go())
    assert models.status_code == 200
    assert models.json()["data"] == [{"id": "tiny", "object": "model", "owned_by": "verifiers_rl", "max_model_len": 20}]
    assert no_key.status_code == 401 and wrong.status_code == 401
    assert too_long.status_code == 400 and "max_model_len=20" in too_long.text
    assert bad_stop.status_code == 400 and "[7]" in bad_stop.text
    assert capped.status_code == 200 and len(capped.json()["choices"][0]["token_ids"]) <= 20 - 16
    assert unknown.status_code == 404
    assert served == 1


def test_sampling_settings_the_engine_does_not_take_are_said_once(engine, caplog):
    # v1's sampling config (an agent's sampling:, a harness's own) reaches the endpoint; the trainer's settings apply.
    async def go():
        async with GenerateEndpoint(engine, max_model_len=64) as ep:
            with ep.rollout(RolloutSampling(seed=1)) as base_url:
                renderers = {"stop_token_ids": [], "skip_special_tokens": False}  # renderers' own: used or moot
                for params in ({"temperature": 0.3, "top_p": 0.5, "max_tokens": 2, "logprobs": 1},
                               {"temperature": 0.3, "max_tokens": 2, **renderers}):
                    answer = await post(base_url, ep.api_key, {"token_ids": PROMPT, "sampling_params": params})
                    assert answer.status_code == 200, answer.text

    with caplog.at_level("WARNING", logger="verifiers_rl.envs.adapters.generate_endpoint"):
        run(go())
    said = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert said == ["verifiers v1's sampling settings ['temperature', 'top_p'] are not used: the trainer's are "
                    "(--temperature, --top_p, ...; max_tokens is capped by --max_completion_length)."], said


def test_renderers_generate_client_reads_it(engine, tiny_model_dir):
    """The client v1's TrainClient calls (renderers.client.generate over an AsyncOpenAI client) parses our answers
    into the engine's exact ids and log-probs, and its pre-flight reads max_model_len from /models."""
    openai = pytest.importorskip("openai")
    from renderers import create_renderer
    from renderers import OverlongPromptError
    from renderers.base import load_tokenizer
    from renderers.client import generate

    renderer = create_renderer(load_tokenizer(tiny_model_dir), None)
    messages = [{"role": "user", "content": "Reverse the text: hello"}]
    prompt_ids = renderer.render(messages, add_generation_prompt=True).token_ids

    async def go():
        async with GenerateEndpoint(engine, max_model_len=len(prompt_ids) + 8, model_name="tiny") as ep:
            with ep.rollout(RolloutSampling(seed=99)) as base_url:
                client = openai.AsyncOpenAI(base_url=base_url, api_key=ep.api_key, max_retries=0)
                result = await generate(client=client, renderer=renderer, messages=messages, model="tiny",
                                        sampling_params={"max_tokens": 6})
            with ep.rollout(RolloutSampling(seed=99)) as base_url:  # a fresh URL: a fresh max_model_len lookup
                client = openai.AsyncOpenAI(base_url=base_url, api_key=ep.api_key, max_retries=0)
                with pytest.raises(OverlongPromptError):
                    await generate(client=client, renderer=renderer, messages=messages * 8, model="tiny",
                                   sampling_params={"max_tokens": 6})
        with sampling_for_rollout(RolloutSampling(seed=99)):
            direct = await engine.sample(prompt_ids, 6)
        return result, direct

    result, direct = run(go())
    assert result["prompt_ids"] == prompt_ids
    assert result["completion_ids"] == direct.token_ids
    assert result["completion_logprobs"] == direct.logprobs
    assert result["finish_reason"] == direct.finish_reason
