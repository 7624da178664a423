"""What every verifiers 0.4 (v1) test shares: they need the venv scripts/install_verifiers_v1.sh makes (the README's
set-up installs it; without it they are skipped, saying so), and the tiny model's embedded engine."""

import asyncio

import pytest
from transformers import AutoTokenizer

from verifiers_rl.envs import load_environment
from verifiers_rl.envs.adapters.verifiers_v1 import v1_python
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig


def pytest_collection_modifyitems(items):
    if v1_python().exists():
        return
    skip = pytest.mark.skip(reason="no verifiers 0.4 venv: run scripts/install_verifiers_v1.sh")
    for item in items:
        if "tests/v1/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(temperature=1.0, max_new_tokens=10))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Recording:
    """The real engine, with what each ``sample`` returned kept (concurrent episodes share batches, and a batch's
    padding moves log-probs in the last float bits: the endpoint must pass on exactly what the engine returned)."""

    def __init__(self, engine):
        self.engine, self.samples = engine, {}
        self.eos_token_ids, self.sampling, self.policy_version = engine.eos_token_ids, engine.sampling, 0

    async def sample(self, prompt_ids, max_new_tokens):
        sample = await self.engine.sample(prompt_ids, max_new_tokens)
        self.samples[tuple(sample.token_ids)] = sample
        return sample


def recorded_group(path, tokenizer, engine, n: int, seed: int, harness: str = "inprocess", num_tasks: int = 2,
                   **limits):
    """The v1 environment at ``path`` loaded (``num_tasks`` tasks, ``limits``: max_seq_len, max_new_tokens), ``n``
    episodes of its first task through ``engine`` under ``seed``, and the environment closed: (environment,
    ``Recording`` of the engine's samples, rollouts)."""
    env = load_environment(str(path), tokenizer=tokenizer, harness=harness, taskset={"num_tasks": num_tasks}, **limits)
    recording = Recording(engine)
    try:
        rollouts = asyncio.run(env.rollout_group(recording, env.dataset[0], "g", n, seed=seed))
    finally:
        env.close()
    return env, recording, rollouts
