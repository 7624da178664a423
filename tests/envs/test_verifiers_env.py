"""Classic verifiers environments (vf.SingleTurnEnv, vf.MultiTurnEnv, vf.ToolEnv, vf.ReasoningGymEnv) through
VerifiersEnv and EngineClient: the trained ids are the sampled ids, rewards are the rubric's, seeds reach every
model call, failures are clear errors, and each trains 2 live steps with the tiny model."""

import asyncio
import copy

import pytest
import verifiers as vf

from verifiers_rl.core.rollout import NOT_SAMPLED
from verifiers_rl.envs import RolloutError, RolloutSampling, load_environment, sampling_for_rollout
from verifiers_rl.envs.adapters.verifiers_env import VerifiersEnv
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig

from . import vf_envs
from .scripted import ScriptedSampler
from .templates import TOOL_TEMPLATE
from .verifiers_checks import model_turns, rubric_reward

SPEC = "vf:tests.envs.vf_envs"
# Short model turns keep the tests with the tiny model (which rarely stops by itself) fast.
SHORT = {"sampling_args": {"max_tokens": 8}}


class RecordingSampler:
    """Passes calls to an engine and keeps every (prompt ids, sample): what the model really sampled."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    async def sample(self, prompt_ids, max_new_tokens):
        sample = await self.engine.sample(prompt_ids, max_new_tokens)
        self.calls.append((list(prompt_ids), sample))
        return sample


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(temperature=1.0, max_new_tokens=16))


def assert_trained_ids_are_sampled_ids(rollouts, calls):
    """Every model turn of every rollout is one recorded sample, verbatim, sampled from exactly the sequence
    before it; and every recorded sample is in some rollout."""
    unmatched = [(prompt, sample.token_ids, sample.logprobs) for prompt, sample in calls]
    for rollout in rollouts:
        sequence = rollout.prompt_ids + rollout.completion_ids
        for start, ids, logprobs in model_turns(rollout):
            unmatched.remove((sequence[:start], ids, logprobs))  # ValueError if the model never sampled it
        assert all(lp == 0.0 for lp, m in zip(rollout.completion_logprobs, rollout.completion_mask) if m == 0)
    assert unmatched == []


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_rollouts_train_the_sampled_ids_and_the_rubric_rewards(tokenizer, engine, kind):
    env = load_environment(SPEC, tokenizer=tokenizer, kind=kind, max_turns=3, **SHORT)
    assert isinstance(env, VerifiersEnv) and env.name == "tests.envs.vf_envs"
    assert len(env.dataset) == 8 and len(env.eval_dataset) == 4  # get_dataset() / eval_dataset
    recorder = RecordingSampler(engine)
    rollouts = asyncio.run(env.rollout_group(recorder, env.dataset[2], "g", 4, seed=11))
    assert_trained_ids_are_sampled_ids(rollouts, recorder.calls)
    assert [r.reward for r in rollouts] == pytest.approx(rubric_reward(rollouts))
    assert all(r.group_id == "g" and r.prompt[-1]["content"] == "Say a word like stone." for r in rollouts)
    turns = [len(model_turns(r)) for r in rollouts]
    if kind == "single":
        assert turns == [1, 1, 1, 1]
    else:
        # The environment's turns ("Go on (k).") are environment tokens between the model's turns.
        assert all(r.metrics["num_turns"] == t for r, t in zip(rollouts, turns)) and max(turns) == 3
        text = tokenizer.decode([t for r in rollouts for t, m in zip(r.completion_ids, r.completion_mask) if m == 0])
        assert "<|im_start|>user\nGo on (1).<|im_end|>\n<|im_start|>assistant\n" in text and "Go on (2)." in text
    for r in rollouts:
        assert len(r.prompt_ids) + len(r.completion_ids) <= env.max_seq_len
        # The engine's per-token versions reach the record (issue 37): sampled tokens, not the environment's.
        assert r.completion_versions == [engine.policy_version if m else NOT_SAMPLED for m in r.completion_mask]
        r.validate()


def test_same_seed_same_rollouts_other_seed_others(tokenizer, engine):
    env = load_environment(SPEC, tokenizer=tokenizer, kind="multi", max_turns=2, **SHORT)

    def run(seed):
        return asyncio.run(env.rollout_group(engine, env.dataset[0], 0, 3, seed=seed))

    def ids(rollouts):
        return [(r.prompt_ids, r.completion_ids, r.completion_mask, r.reward) for r in rollouts]

    first, again = run(5), run(5)
    assert ids(again) == ids(first)
    # Log-probs to float tolerance: a later turn's requests may share an engine batch with other rollouts' in one
    # run and not in the other (timing), which moves the last bits of the logits.
    for a, b in zip(again, first):
        assert a.completion_logprobs == pytest.approx(b.completion_logprobs, abs=1e-5)
    assert ids(run(6)) != ids(first)
    assert len({tuple(r.completion_ids) for r in first}) == 3  # the rollouts of a group differ from each other


@pytest.mark.parametrize("template", ["text", "template"])
def test_tool_env_calls_tools_from_sampled_text(tokenizer, template):
    tok = tokenizer
    if template == "template":
        tok = copy.deepcopy(tokenizer)
        tok.chat_template = TOOL_TEMPLATE
    env = load_environment(SPEC, tokenizer=tok, kind="tool")
    assert env.client(None).renderer(env.tools).mode == template
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."]
    sampled = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns]
    sampler = ScriptedSampler(list(sampled))
    (rollout,) = asyncio.run(env.rollout_group(sampler, env.dataset[0], 0, 1, seed=0))
    assert [ids for _, ids, _ in model_turns(rollout)] == sampled
    assert rollout.reward == 1.0 and rollout.metrics["add_calls"] == 1.0  # the ToolEnv's own monitor rubric
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant"]
    assert rollout.completion[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert rollout.completion[1]["content"] == "5"
    call_id = rollout.completion[0]["tool_calls"][0]["id"]  # 9 letters and digits, as Mistral's template asks
    assert rollout.completion[1]["tool_call_id"] == call_id and len(call_id) == 9 and call_id.isalnum()
    prompt = tok.decode(rollout.prompt_ids)
    assert '"name": "add"' in prompt and ("# Tools\n<tools>" in prompt) == (template == "template")
    result = "<tool_response>\n5\n</tool_response>" if template == "template" else "<|im_start|>tool\n5<|im_end|>"
    assert result in tok.decode(sampler.calls[1][0]) and sampler.calls[1][0] == rollout.prompt_ids + rollout.completion_ids[
        : len(rollout.completion_ids) - len(sampled[1])
    ]


def test_tool_call_ids_are_unique_within_a_verifiers_episode(tokenizer):
    """The client kept a model's 9-character id as written: one used twice (in a turn, or in two turns) gave two
    verifiers tool messages the same tool_call_id. A repeated id is replaced by a generated one."""
    env = load_environment(SPEC, tokenizer=tokenizer, kind="tool")
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": %d}, "id": "abc123xyz"}</tool_call>'
    turns = [call % 1 + call % 2, call % 3, "It is 5."]
    sampler = ScriptedSampler([tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in turns])
    (rollout,) = asyncio.run(env.rollout_group(sampler, env.dataset[0], 0, 1, seed=0))
    assert [(m["tool_call_id"], m["content"]) for m in rollout.completion if m["role"] == "tool"] == [
        ("abc123xyz", "2"), ("call00001", "3"), ("call01000", "4")]


def test_a_verifiers_tool_env_that_max_turns_stops_with_calls_pending_is_truncated(tokenizer):
    """verifiers' ToolEnv stopped at max_turns after a turn that called a tool (its stop condition max_turns_reached):
    the call never ran, yet the rollout was not marked truncated, as our ToolEnv marks it, so it trained as a
    finished episode under --mask_truncated_completions. A rollout that answers on its last allowed turn is not."""
    env = load_environment(SPEC, tokenizer=tokenizer, kind="tool", max_turns=2)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": %d}}</tool_call>'

    def roll(*turns):
        sampler = ScriptedSampler([tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id]
                                   for t in turns])
        (rollout,) = asyncio.run(env.rollout_group(sampler, env.dataset[0], 0, 1, seed=0))
        return rollout

    cut = roll(call % 3, call % 4)
    assert cut.truncated and [m["role"] for m in cut.completion] == ["assistant", "tool", "assistant"]
    assert not roll(call % 3, "It is 5.").truncated


def test_a_verifiers_tool_env_reads_calls_whose_markers_are_special_tokens(tokenizer):
    """The client decoded a reply with skip_special_tokens=True: a tokenizer whose <tool_call> and </tool_call> are
    special tokens lost the markers, and verifiers' ToolEnv never saw a call."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    env = load_environment(SPEC, tokenizer=tok, kind="tool")
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."]
    sampler = ScriptedSampler([tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns])
    (rollout,) = asyncio.run(env.rollout_group(sampler, env.dataset[0], 0, 1, seed=0))
    assert [(m["role"], m["content"]) for m in rollout.completion] == [
        ("assistant", ""), ("tool", "5"), ("assistant", "It is 5.")]
    assert rollout.completion[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}


def test_limits_default_to_the_environment_and_a_long_prompt_stops_as_truncated(tokenizer):
    env = load_environment(SPEC, tokenizer=tokenizer, kind="multi", max_seq_len=300, sampling_args={"max_tokens": 9})
    assert (env.max_seq_len, env.max_new_tokens, env.unstated_limits) == (300, 9, frozenset())
    free = load_environment(SPEC, tokenizer=tokenizer, kind="single")
    assert (free.max_seq_len, free.max_new_tokens) == (1024, 256)
    assert free.unstated_limits == {"max_seq_len", "max_new_tokens"}
    # The second turn's prompt leaves no room: the environment stops the rollout (prompt_too_long), truncated.
    prompt_len = len(env.prompt_ids(env.dataset[0].prompt))
    env.adopt_limits(max_seq_len=prompt_len + 12)
    sampler = ScriptedSampler([[5] * 9, [6] * 9])
    (rollout,) = asyncio.run(env.rollout_group(sampler, env.dataset[0], 0, 1))
    assert sampler.calls[0][1] == 9 and len(sampler.calls) == 1 and rollout.truncated
    assert len(rollout.prompt_ids) + len(rollout.completion_ids) <= prompt_len + 12


def test_an_argument_verifiers_only_keeps_as_an_attribute_is_said(tokenizer, caplog):
    # verifiers' Environment takes unknown keywords and sets them as attributes: a misspelt argument acted on nothing.
    logger = "verifiers_rl.envs.loading"
    with caplog.at_level("WARNING", logger=logger):
        env = load_environment(SPEC, tokenizer=tokenizer, kind="multi", num_exampels=3, max_turns=2, max_seq_len=300)
    said = [r.getMessage() for r in caplog.records if r.name == logger]
    assert said == [f"Environment {SPEC!r}: its arguments ['num_exampels'] (--env_args) are parameters of neither its "
                    "loader nor its environment's class: verifiers only keeps them as attributes of the environment, "
                    "which nothing of verifiers reads. A misspelt argument?"], said
    assert env.vf_env.max_turns == 2 and env.max_seq_len == 300  # the loader's and the class's own act, unsaid
    caplog.clear()
    with caplog.at_level("WARNING", logger=logger):
        load_environment(SPEC, tokenizer=tokenizer, kind="single", num_examples=3)
    assert not [r for r in caplog.records if r.name == logger]


class FailingSampler:
    async def sample(self, prompt_ids, max_new_tokens):
        raise RuntimeError("the inference server is down")


def test_failures_are_clear_errors(tokenizer, engine):
    env = load_environment(SPEC, tokenizer=tokenizer, kind="single")
    with pytest.raises(RolloutError, match=r"tests.envs.vf_envs failed on dataset row 0: ModelError <- RuntimeError: "
                                           r"the inference server is down"):
        asyncio.run(env.rollout_group(FailingSampler(), env.dataset[0], 0, 2))
    broken = load_environment(SPEC, tokenizer=tokenizer, kind="broken_env", fail_after=0, **SHORT)
    with pytest.raises(RolloutError, match="failed on dataset row 1: ConnectionError: the game server went away"):
        asyncio.run(broken.rollout_group(engine, broken.dataset[1], 0, 2))
    rubric = load_environment(SPEC, tokenizer=tokenizer, kind="broken_rubric", **SHORT)
    with pytest.raises(RolloutError, match="the verifiers rubric failed on dataset row 0: IndexError"):
        asyncio.run(rubric.rollout_group(engine, rubric.dataset[0], 0, 2))

    # A model call from loop.run_in_executor (as some environments make) loses the rollout's seed: refused.
    client = env.client(FailingSampler())

    def call():
        return asyncio.run(client.get_response([vf.UserMessage(content="hi")], "m", {}, state={"trajectory": []}))

    async def from_the_rollout(through_executor):
        with sampling_for_rollout(RolloutSampling(seed=1)):
            if through_executor:
                return await asyncio.get_running_loop().run_in_executor(None, call)
            return await asyncio.to_thread(call)

    with pytest.raises(vf.ModelError) as error:
        asyncio.run(from_the_rollout(through_executor=True))
    assert "ran outside its rollout's context" in str(error.value.__cause__)
    with pytest.raises(vf.ModelError) as error:  # asyncio.to_thread carries the context: the engine is reached
        asyncio.run(from_the_rollout(through_executor=False))
    assert "the inference server is down" in str(error.value.__cause__)


def test_a_rollout_that_fails_stops_the_rest_of_its_group(tokenizer, engine):
    # The group is generated again or dropped: its other episodes, left running, played on unseen.
    env = load_environment(SPEC, tokenizer=tokenizer, kind="one_sandbox_gone", max_turns=20, **SHORT)

    async def failing_group():
        with pytest.raises(RolloutError, match="ConnectionError: sandbox gone"):
            await env.rollout_group(ScriptedSampler([[5, tokenizer.eos_token_id]] * 100), env.dataset[0], 0, 3)
        played = env.vf_env.turns_played
        await asyncio.sleep(0.3)  # time for the other two episodes' 19 turns each, had they gone on
        return played, env.vf_env.turns_played

    played, later = asyncio.run(failing_group())
    assert later == played, f"the failed group's other episodes played {later - played} more turns after it failed"


def test_an_environment_that_provides_advantages_is_refused(tokenizer):
    class OwnAdvantages(vf.Rubric):
        @property
        def has_advantages(self):
            return True

    env = vf.SingleTurnEnv(dataset=vf_envs.dataset(2), rubric=OwnAdvantages(funcs=[vf_envs.vowel_fraction]))
    with pytest.raises(ValueError, match=r"provides its own advantages .* \(--scale_rewards\)"):
        VerifiersEnv(env, tokenizer)


def test_verifiers_reasoning_gym_env_rows(tokenizer):
    env = load_environment(SPEC, tokenizer=tokenizer, kind="reasoning_gym", num_examples=6)
    ours = load_environment("reasoning_gym:leg_counting", tokenizer=tokenizer, size=6, eval_size=4)
    assert [r.prompt for r in env.dataset] == [r.prompt for r in ours.dataset]
    assert [r.prompt for r in env.eval_dataset] == [r.prompt for r in ours.eval_dataset]


def live_config(tmp_path, env, **overrides):
    from verifiers_rl.config.rl_config import RLConfig

    return RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
                    max_steps=2, learning_rate=1e-3, rollouts_per_step=8, num_generations=4,
                    max_seq_len=env.max_seq_len, max_off_policy_steps=0, gradient_checkpointing=False,
                    disable_tqdm=True, seed=0, **overrides)


@pytest.mark.parametrize("kind", ["single", "multi", "tool", "reasoning_gym"])
def test_two_live_steps_with_the_tiny_model(tiny_model_dir, tmp_path, kind):
    """RLTrainer on each verifiers environment through the embedded engine, k = 0: the trainer's log-probs of the
    trained tokens equal the sampler's (IS ratio 1), which holds only if the ids, masks and log-probs line up."""
    from transformers import AutoTokenizer

    from verifiers_rl.core.rollout import read_rollouts
    from verifiers_rl.training.trainer import RLTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vf_env = vf_envs.load_environment(kind=kind, max_turns=2)
    env = VerifiersEnv(vf_env, tokenizer, max_new_tokens=12)
    config = live_config(tmp_path, env, save_rollouts_path=str(tmp_path / "seen.jsonl"))
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(max_new_tokens=12), generate_in_loop_thread=True)
    trainer = RLTrainer(tiny_model_dir, config, processing_class=tokenizer, environment=env, engine=engine)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2 and all(abs(entry["is_ratio"] - 1) < 1e-4 for entry in logged)
    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert len(seen) == 16 and {r.policy_version for r in seen} == {0, 1}
    if kind == "multi":
        assert any(0 in r.completion_mask for r in seen)  # environment turns were masked out of the loss


@pytest.mark.distributed
@pytest.mark.parametrize("kind, error", [
    ("broken_env", "RolloutError: tests.envs.vf_envs failed on dataset row .*the game server went away"),
    ("broken_rubric", "RolloutError: tests.envs.vf_envs: the verifiers rubric failed on dataset row .*IndexError"),
])
def test_environment_error_stops_every_rank_with_our_error(tiny_model_dir, tmp_path, kind, error):
    """2-process DDP: the verifiers environment fails mid-rollout, or its rubric fails while scoring, on the main
    process (where generation runs); both ranks stop with the RolloutError naming it."""
    import json
    import re

    from tests.helpers.launches import ROOT, accelerate, launch

    env_args = {"kind": kind, "fail_after": 4, "max_seq_len": 64, "sampling_args": {"max_tokens": 8}}
    result = launch(accelerate("ddp_cpu.yaml"),
                    [str(ROOT / "tests" / "live" / "live_run.py"), "--model", tiny_model_dir, "--out", str(tmp_path),
                     "--k", "1", "--steps", "3", "--env", SPEC, "--env_args", json.dumps(env_args)],
                    tmp_path / "run.log")
    log = (tmp_path / "run.log").read_text()
    assert result.returncode != 0
    assert re.search(error, log), log[-3000:]
    assert "The main process failed:" in log  # rank 1 stopped with the same error instead of waiting


def test_our_adapter_and_verifiers_reasoning_gym_env_give_the_same_rollouts(tokenizer, engine):
    """The same reasoning-gym task through our adapter and through verifiers' ReasoningGymEnv, same rows and seed:
    the same token ids, and the same rewards (both score the <answer> tag with the task's score_answer)."""
    # ReasoningGymEnv takes no sampling_args: the wrapper's max_new_tokens bounds its turns as ours does.
    theirs = VerifiersEnv(vf_envs.load_environment(kind="reasoning_gym", num_examples=4), tokenizer, max_new_tokens=16)
    ours = load_environment("reasoning_gym:leg_counting", tokenizer=tokenizer, size=4, eval_size=4, max_new_tokens=16)
    for index in range(2):
        a = asyncio.run(theirs.rollout_group(engine, theirs.dataset[index], 0, 2, seed=index))
        b = asyncio.run(ours.rollout_group(engine, ours.dataset[index], 0, 2, seed=index))
        assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
        assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
        assert [r.reward for r in a] == [r.reward for r in b]
    # On written answers (the tiny model never answers right): the right one scores 1 under both rubrics.
    row = ours.dataset[0]
    right = [{"role": "assistant", "content": f"<think>x</think>\n<answer>{row.answer}</answer>"}]
    assert asyncio.run(ours.rubric.score(row.prompt, right, row.answer, {}, row.info)).reward == 1.0
