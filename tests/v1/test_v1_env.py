"""V1Env: a verifiers 0.4 environment, unchanged, as an environment of ours. --env tells it apart by its exports;
a group is n episodes of one task whose rollouts are the engine's exact samples under the group's seeds, with the
taskset's own rewards and metrics; failures and settings that cannot act are clear errors."""

import asyncio
from pathlib import Path

import pytest

from verifiers_rl.envs import RolloutError, RolloutSampling, derive_seed, load_environment, sampling_for_rollout
from verifiers_rl.envs.adapters.verifiers_v1 import V1Env
from verifiers_rl.envs.loading import exports_v1_taskset, is_v1_environment

ENVS = Path(__file__).parent / "envs"
TEMPLATE = ENVS / "reverse_v1.py"
GRADED = ENVS / "graded_v1.py"
ROOT = Path(__file__).resolve().parents[2]






def test_a_harness_that_reaches_no_seat_is_refused(tokenizer, tmp_path):
    # The author pinned the game's only seat to v1's null harness: a harness asked in --env_args would run nothing.
    guess = (ENVS / "guess_v1.py").read_text()
    pinned = tmp_path / "pinned_v1.py"
    pinned.write_text(guess.replace("player: vf.AgentConfig = vf.AgentConfig()",
                                    'player: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})'))
    with pytest.raises(ValueError, match=r"harness 'inprocess' \(--env_args\) reaches no seat: every seat of the "
                                         r"environment pins its own \(player: null\)"):
        load_environment(str(pinned), tokenizer=tokenizer, harness="inprocess", taskset={"num_tasks": 2})
    env = load_environment(str(pinned), tokenizer=tokenizer, taskset={"num_tasks": 2})  # none asked: its own
    try:
        assert env.harness == "null"
    finally:
        env.close()


def test_env_tells_a_v1_module_apart_by_what_it_exports(tmp_path, monkeypatch):
    assert is_v1_environment(str(TEMPLATE)) and is_v1_environment(str(GRADED))
    # Our own environments and classic verifiers modules are not v1 environments.
    assert not is_v1_environment(str(ROOT / "tests" / "live" / "toy_env.py"))
    assert not is_v1_environment(str(ROOT / "tests" / "envs" / "vf_envs.py"))
    assert not is_v1_environment("reverse_text") and not is_v1_environment("tests.envs.vf_envs:load_environment")
    text = TEMPLATE.read_text()
    assert exports_v1_taskset(text)
    assert not exports_v1_taskset(text + "\n\ndef load_environment(**kwargs):\n    return None\n")  # a loader module
    assert not exports_v1_taskset(text.replace('__all__ = ["ReverseTaskset"]', ""))  # exports nothing
    assert not exports_v1_taskset(text.replace("import verifiers.v1 as vf", "import verifiers as vf"))
    # A package folder, and a module id that only the verifiers 0.4 venv can import (found from the working folder).
    package = tmp_path / "my_v1_env"
    package.mkdir()
    (package / "__init__.py").write_text(text)
    assert is_v1_environment(str(package))
    monkeypatch.chdir(ENVS)
    assert is_v1_environment("reverse_v1") and not is_v1_environment("no_such_module_here")


def test_a_group_is_the_engines_samples_under_the_groups_seeds_with_the_tasksets_rewards(engine, tokenizer,
                                                                                        tiny_model_dir):
    env = load_environment(str(GRADED), tokenizer=tokenizer, taskset={"num_tasks": 3}, max_seq_len=96,
                           max_new_tokens=10)
    try:
        assert isinstance(env, V1Env) and env.name == "graded_v1" and env.harness == "null"
        assert [row.prompt for row in env.dataset] == [
            [{"role": "user", "content": f"Say something short about: {w}"}] for w in ("hello", "world", "stone")]
        assert env.unstated_limits == frozenset()  # both limits given
        row = env.dataset[2]

        async def group():
            return await env.rollout_group(engine, row, "g", 3, seed=77)

        rollouts = asyncio.run(group())
        again = asyncio.run(group())  # another event loop (the generator makes one per batch at k = 0): same group
        assert [r.completion_ids for r in again] == [r.completion_ids for r in rollouts]
        expected_prompt = tokenizer.apply_chat_template(row.prompt, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
        for i, rollout in enumerate(rollouts):
            assert rollout.prompt_ids == list(expected_prompt) and rollout.group_id == "g"
            assert rollout.completion_mask == [1] * len(rollout.completion_ids)  # one model turn, all sampled
            # the endpoint's calls recorded the engine's version of each token in the episode's RolloutSampling
            assert rollout.completion_versions == [engine.policy_version] * len(rollout.completion_ids)

            async def alone():  # episode i's one model call samples with derive_seed(derive_seed(77, i), 0)
                with sampling_for_rollout(RolloutSampling(seed=derive_seed(77, i))):
                    return await engine.sample(rollout.prompt_ids, 10)

            sample = asyncio.run(alone())
            assert rollout.completion_ids == sample.token_ids
            assert rollout.completion_logprobs == pytest.approx(sample.logprobs, abs=1e-5)
            reply = tokenizer.decode(rollout.completion_ids, skip_special_tokens=True).strip()
            assert rollout.completion == [{"role": "assistant", "content": reply}]
            assert rollout.reward == pytest.approx(1.0 / (1.0 + len(reply)))
            assert rollout.metrics == {"reply_chars": float(len(reply)), "reward/shortness": rollout.reward}
            assert rollout.truncated == (sample.finish_reason == "length")
        assert len({tuple(r.completion_ids) for r in rollouts}) == 3
    finally:
        env.close()


def test_limits_the_run_gives_reach_the_endpoint(engine, tokenizer):
    env = load_environment(str(TEMPLATE), tokenizer=tokenizer, harness="inprocess", taskset={"num_tasks": 2})
    try:
        assert env.unstated_limits == {"max_seq_len", "max_new_tokens"}  # v1 states neither: the trainer's flags
        env.adopt_limits(max_seq_len=40, max_new_tokens=3)
        assert (env.endpoint.max_model_len, env.endpoint.max_new_tokens) == (40, 3)
        rollouts = asyncio.run(env.rollout_group(engine, env.dataset[0], "g", 2, seed=1))
        assert all(len(r.completion_ids) <= 3 for r in rollouts) and any(r.truncated for r in rollouts)
    finally:
        env.close()


def test_failures_and_settings_that_cannot_act_are_clear_errors(engine, tokenizer):
    env = load_environment(str(GRADED), tokenizer=tokenizer, harness="inprocess",
                           taskset={"num_tasks": 3, "boom": True}, max_seq_len=96, max_new_tokens=6)
    try:
        with pytest.raises(RolloutError, match=r"graded_v1 on task 1: .*the reward exploded on purpose"):
            asyncio.run(env.rollout_group(engine, env.dataset[1], "g", 2, seed=1))
        with pytest.raises(ValueError, match="chat_template_kwargs.*v1's train client renders them"):
            env.use_chat_template_kwargs({"enable_thinking": False})
        env.use_chat_template_kwargs({})  # none: nothing to refuse
    finally:
        env.close()
    with pytest.raises(RolloutError, match="was closed"):
        asyncio.run(env.rollout_group(engine, env.dataset[0], "g", 1, seed=1))
    with pytest.raises(ValueError, match=r"(?s)failed to load: ValidationError.*taskset.nope.*Extra inputs are not permitted"):
        load_environment(str(TEMPLATE), tokenizer=tokenizer, taskset={"nope": 1})
    with pytest.raises(ValueError, match="failed to load: .*no_such_harness"):
        load_environment(str(TEMPLATE), tokenizer=tokenizer, harness="no_such_harness")
    with pytest.raises(ValueError, match="verifiers v1 environment: pass the policy's tokenizer"):
        load_environment(str(TEMPLATE))
    with pytest.raises(ValueError, match="--tool_mode text cannot reach .*renders tools itself"):
        load_environment(str(TEMPLATE), tokenizer=tokenizer, tool_mode="text")


def test_a_failing_episode_stops_the_others_of_its_group_down_to_the_engine(engine, tokenizer):
    # A group's episodes were gathered plainly: one failing left the others running, in the trainer and in the worker,
    # playing and sampling for nobody while the group was retried. They are cancelled, down to the engine's call.
    env = load_environment(str(TEMPLATE), tokenizer=tokenizer, harness="inprocess", taskset={"num_tasks": 2})

    async def group():
        waiting, stopped = asyncio.Event(), asyncio.Event()

        class OneHangsOneFails:  # the engine: the first call waits (until cancelled), the second fails
            eos_token_ids, sampling, policy_version = engine.eos_token_ids, engine.sampling, 0

            async def sample(self, prompt_ids, max_new_tokens):
                if not waiting.is_set():
                    waiting.set()
                    try:
                        await asyncio.Event().wait()
                    finally:
                        stopped.set()
                raise ValueError("the engine failed on purpose")

        with pytest.raises(RolloutError, match="the engine failed on purpose"):
            await env.rollout_group(OneHangsOneFails(), env.dataset[0], "g", 2, seed=1)
        await asyncio.wait_for(stopped.wait(), 60)  # the other episode's call was cancelled, not left waiting

    try:
        asyncio.run(group())
        process = env.worker.process
    finally:
        env.close()
    assert process.returncode == 0  # closed with no episode left to finish, not killed
