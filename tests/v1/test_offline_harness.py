"""Rollouts download nothing: the worker runs v1 with ``UV_OFFLINE=1``, so a null-harness episode runs only because
``scripts/install_verifiers_v1.sh`` put its script's dependencies in uv's cache, and with an empty cache it fails
with an error that names the install script (instead of fetching from PyPI)."""

import asyncio
from pathlib import Path


from verifiers_rl.envs import RolloutSampling
from verifiers_rl.envs.adapters.verifiers_v1 import EpisodeWorker, EpisodeWorkerError
from verifiers_rl.envs.adapters.generate_endpoint import GenerateEndpoint

ENV = Path(__file__).parent / "envs" / "reverse_v1.py"




def null_episode(engine, model_dir, env=None):
    """One null-harness episode of task 0 through a worker started with ``env``: its answer, or the
    ``EpisodeWorkerError`` it raised."""
    async def go():
        async with GenerateEndpoint(engine, max_model_len=128, model_name="tiny") as ep:
            async with EpisodeWorker(ep.api_key, env=env) as worker:
                await worker.load(str(ENV), {"taskset": {"num_tasks": 1}}, harness="null")
                with ep.rollout(RolloutSampling(seed=3)) as base_url:
                    try:
                        return await worker.run(0, base_url, "tiny", model_dir)
                    except EpisodeWorkerError as error:
                        return error

    return asyncio.run(go())


def test_null_harness_runs_offline_from_the_installed_cache(engine, tiny_model_dir):
    answer = null_episode(engine, tiny_model_dir)
    assert not isinstance(answer, EpisodeWorkerError), answer
    assert answer["ok"], answer["errors"]
    [trace] = answer["traces"]
    [branch] = trace["branches"]
    assert any(branch["sampled_mask"])  # the harness's program ran and called the model


def test_null_harness_with_nothing_cached_fails_naming_the_install_script(engine, tiny_model_dir, tmp_path):
    cache = tmp_path / "uv-cache"
    cache.mkdir()
    answer = null_episode(engine, tiny_model_dir, env={"UV_CACHE_DIR": str(cache)})
    message = str(answer) if isinstance(answer, EpisodeWorkerError) else "; ".join(answer["errors"])
    assert isinstance(answer, EpisodeWorkerError) or not answer["ok"], answer
    assert "scripts/install_verifiers_v1.sh" in message, message
    assert not list(cache.glob("wheels-*/pypi/*")), "a wheel was downloaded"
