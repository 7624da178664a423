"""Live training: environment -> embedded engine -> async generator -> trainer, in one process, under DDP and under
ZeRO-3 (2 processes each, one launch per backend running k = 0 and k = 1). Plus the faults: a reward function that
raises, an environment that raises mid-rollout, an engine that hangs."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.launches import LIVE_RUNNER as RUNNER, MIN_REWARD_GAIN, accelerate, launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="session")
def live_runs(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("live")
    prefixes = {"single": [sys.executable], "ddp": accelerate("ddp_cpu.yaml"), "zero3": accelerate("zero3_cpu.yaml")}
    for backend, prefix in prefixes.items():
        log = work / f"{backend}.log"
        result = launch(prefix, [str(RUNNER), "--model", tiny_model_dir, "--out", str(work / backend)], log)
        assert result.returncode == 0, f"{backend} live run failed:\n{log.read_text()[-6000:]}"
    return work


@pytest.mark.parametrize("backend", ["single", "ddp", "zero3"])
@pytest.mark.parametrize("k", [0, 1])
def test_reward_rises_and_staleness_is_bounded(live_runs, backend, k):
    record = json.loads((live_runs / backend / f"k{k}.json").read_text())
    assert record["num_processes"] == (1 if backend == "single" else 2)
    rewards = record["reward"]
    assert len(rewards) == 20
    gain = sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5
    assert gain > MIN_REWARD_GAIN, f"reward went {rewards[:5]} -> {rewards[-5:]}"
    assert max(record["staleness_max"]) == k  # the generator ran exactly k steps ahead, never more
    assert all(errors == 0 for errors in record["reward_errors"])


@pytest.mark.parametrize("backend", ["single", "ddp", "zero3"])
def test_engine_logprobs_equal_trainer_logprobs_after_every_weight_load(live_runs, backend):
    """With k = 0 every batch is sampled by weights equal to the trainer's, loaded after the previous step
    (ZeRO-3: gathered from shards). Token IS ratios exp(trainer - sampler) are then 1 to rounding."""
    record = json.loads((live_runs / backend / "k0.json").read_text())
    assert max(abs(ratio - 1) for ratio in record["is_ratio"]) < 1e-4
    # And k = 1 really is off-policy: the ratios move away from 1.
    stale = json.loads((live_runs / backend / "k1.json").read_text())
    assert max(abs(ratio - 1) for ratio in stale["is_ratio"][1:]) > 1e-3


def test_failing_reward_is_recorded_and_failing_environment_stops_every_rank(tiny_model_dir, tmp_path):
    result = launch([sys.executable], [str(RUNNER), "--model", tiny_model_dir, "--out", str(tmp_path / "reward"),
                                       "--k", "1", "--steps", "3", "--env_args", '{"fail_reward": true}'],
                    tmp_path / "reward.log")
    assert result.returncode == 0, (tmp_path / "reward.log").read_text()[-4000:]
    record = json.loads((tmp_path / "reward" / "k1.json").read_text())
    assert all(errors == 32 for errors in record["reward_errors"])  # one failed function per rollout, counted
    assert "the reward server is down" in (tmp_path / "reward.log").read_text()

    start = time.monotonic()
    result = launch(accelerate("ddp_cpu.yaml"),
                    [str(RUNNER), "--model", tiny_model_dir, "--out", str(tmp_path / "env"), "--k", "1", "--steps", "5",
                     "--env", "tests.live.toy_env:load_failing_environment", "--env_args", '{"fail_after": 40}'],
                    tmp_path / "env.log")
    log = (tmp_path / "env.log").read_text()
    assert result.returncode != 0
    assert "failing_env failed on dataset row" in log and "the game server went away" in log
    assert "The main process failed:" in log  # rank 1 stopped with the same error instead of waiting
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("k", [0, 1])  # k = 0 waits on the trainer's own thread, k = 1 on the generator thread
def test_stuck_engine_times_out_with_a_clear_error_and_no_thread_left(tiny_model_dir, tmp_path, k):
    from transformers import AutoTokenizer

    from tests.live.toy_env import load_environment as load_toy
    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.rollouts.generator import GenerationTimeout
    from verifiers_rl.training.trainer import RLTrainer

    class StuckEngine:
        """Stands in for an inference server that accepted the request and never answers."""

        policy_version = 0

        async def sample(self, prompt_ids, max_new_tokens):
            await asyncio.sleep(3600)

        def load_weights(self, named_tensors, version):
            self.policy_version = version

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", max_steps=2,
                    rollouts_per_step=8, num_generations=4, max_seq_len=64, generation_timeout_s=2.0,
                    max_off_policy_steps=k,
                    gradient_checkpointing=False, disable_tqdm=True)
    trainer = RLTrainer(tiny_model_dir, args, processing_class=tokenizer,
                        environment=load_toy(tokenizer), engine=StuckEngine())
    start = time.monotonic()
    with pytest.raises(GenerationTimeout, match=r"No rollouts for batch 0 within 2 s .* stuck"):
        trainer.train()
    assert time.monotonic() - start < 15
    assert not any(t.name == "verifiers_rl-generator" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("k", [0, 1])
def test_a_hanging_synchronous_reward_times_out_on_either_thread(tiny_model_dir, tmp_path, k):
    # A plain-Python reward that never returns blocks the event loop it is scored on: a timeout inside that loop would
    # never fire, so the bound is kept by the thread that waits for the batch (k = 0 as well as k = 1).
    from transformers import AutoTokenizer

    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.envs import Rubric, SingleTurnEnv
    from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
    from verifiers_rl.rollouts.generator import GenerationTimeout
    from verifiers_rl.training.trainer import RLTrainer

    release = threading.Event()

    def hangs(completion) -> float:
        release.wait(3600)
        return 0.0

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"question": f"Say {i}."} for i in range(8)]
    environment = SingleTurnEnv(rows, Rubric([hangs]), tokenizer, max_new_tokens=4, max_seq_len=64)
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", max_steps=2,
                    rollouts_per_step=8, num_generations=4, max_seq_len=64, max_completion_length=4,
                    generation_timeout_s=3.0, max_off_policy_steps=k, gradient_checkpointing=False, disable_tqdm=True)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=4))
    trainer = RLTrainer(tiny_model_dir, args, processing_class=tokenizer, environment=environment, engine=engine)
    start = time.monotonic()
    try:
        with pytest.raises(GenerationTimeout, match=r"No rollouts for batch 0 within 3 s .*--generation_timeout_s"):
            trainer.train()
        assert time.monotonic() - start < 30
    finally:
        release.set()  # the blocked reward's thread ends
        engine.close()


def test_a_training_environment_without_a_reward_function_is_said(tiny_model_dir, tmp_path, caplog):
    # Rubric() scores every rollout 0: the run would learn nothing, silently.
    from transformers import AutoTokenizer

    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.envs import Rubric, SingleTurnEnv
    from verifiers_rl.envs.mixture import mixture_of
    from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
    from verifiers_rl.training.trainer import RLTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", max_steps=1,
                    rollouts_per_step=8, num_generations=4, max_seq_len=64, max_completion_length=4)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=4))
    try:
        for rubric, said in ((Rubric(), True), (Rubric([lambda completion: 1.0]), False)):
            caplog.clear()
            environment = SingleTurnEnv([{"question": f"Say {i}."} for i in range(8)], rubric, tokenizer,
                                        max_new_tokens=4, max_seq_len=64, name="quiet")
            with caplog.at_level("WARNING", logger="verifiers_rl.training.trainer"):
                RLTrainer(tiny_model_dir, args, processing_class=tokenizer, environment=environment, engine=engine)
            assert ("quiet: its rubric has no reward function" in caplog.text) == said, caplog.text
        # A mixture: each entry on its own; an adapter's unused Rubric() first (it scores itself) is not such a one.
        classic = {"env": str(Path(__file__).parents[1] / "envs" / "vf_envs.py"), "name": "classic",
                   "env_args": {"max_seq_len": 64, "sampling_args": {"max_tokens": 4}}}
        for rubric, said in ((Rubric(), True), (Rubric([lambda completion: 1.0]), False)):
            caplog.clear()
            environment = SingleTurnEnv([{"question": f"Say {i}."} for i in range(8)], rubric, tokenizer,
                                        max_new_tokens=4, max_seq_len=64, name="quiet")
            with caplog.at_level("WARNING", logger="verifiers_rl.training.trainer"):
                RLTrainer(tiny_model_dir, args, processing_class=tokenizer, engine=engine,
                          environment=mixture_of([classic, {"env": environment}], tokenizer))
            assert ("quiet: its rubric has no reward function" in caplog.text) == said, caplog.text
            assert "classic" not in caplog.text and "mixture[" not in caplog.text, caplog.text
    finally:
        engine.close()
