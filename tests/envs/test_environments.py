"""Environment, SingleTurnEnv and MultiTurnEnv: dataset validation, rollout records, token bookkeeping."""

import asyncio
import copy
import json
import logging

import pytest

from verifiers_rl.envs import MultiTurnEnv, RolloutError, Row, Rubric, Sample, SingleTurnEnv, TemplateError

from .scripted import ScriptedSampler


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def exact(completion, answer):
    return float(completion[-1]["content"] == answer)


class EchoEnv(MultiTurnEnv):
    """Answers "again <turn>" until the model says "stop"."""

    def is_completed(self, messages, state):
        return "stop" in messages[-1]["content"]

    async def env_response(self, messages, state):
        return [{"role": "user", "content": f"again {state['turn']}"}]


def test_single_turn_rollout_record(tokenizer):
    env = SingleTurnEnv(
        [{"question": "hello", "answer": "olleh", "info": {"id": 7}}],
        Rubric([exact]),
        tokenizer,
        system_prompt="Reverse.",
        max_new_tokens=8,
    )
    sampled = encode(tokenizer, "olleh") + [tokenizer.eos_token_id]
    sampler = ScriptedSampler([sampled])
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], "g0"))

    prompt = [{"role": "system", "content": "Reverse."}, {"role": "user", "content": "hello"}]
    prompt_ids = encode(tokenizer, tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
    assert rollout.prompt_ids == prompt_ids
    assert sampler.calls == [(prompt_ids, 8)]
    assert rollout.completion_ids == sampled
    assert rollout.completion_mask == [1] * len(sampled)
    assert rollout.completion_logprobs == [-0.5 - 0.01 * (100 + i) for i in range(len(sampled))]
    assert rollout.reward == 1.0 and rollout.metrics == {"exact": 1.0, "reward_errors": 0.0}
    assert rollout.group_id == "g0" and rollout.truncated is False
    assert rollout.prompt == prompt and rollout.completion == [{"role": "assistant", "content": "olleh"}]
    assert env.dataset[0].info == {"id": 7}
    rollout.validate()


def test_failing_reward_function_message_is_kept_in_the_rollout_record(tokenizer, tmp_path):
    from verifiers_rl.core.rollout import read_rollouts, write_rollouts

    def broken(completion):
        raise ZeroDivisionError("no answer to divide by")

    env = SingleTurnEnv([{"question": "hi", "answer": "ih"}], Rubric([exact, broken]), tokenizer, max_new_tokens=8)
    sampled = encode(tokenizer, "ih") + [tokenizer.eos_token_id]
    rollout = asyncio.run(env.rollout(ScriptedSampler([sampled]), env.dataset[0], "g0"))
    assert rollout.reward == 1.0 and rollout.metrics["reward_errors"] == 1.0
    assert rollout.reward_errors == {"broken": "ZeroDivisionError: no answer to divide by"}
    # The message survives the replay format (and a clean rollout writes no such field).
    write_rollouts(tmp_path / "r.jsonl", [rollout])
    assert read_rollouts(tmp_path / "r.jsonl")[0].reward_errors == rollout.reward_errors
    rollout.reward_errors = {}
    assert "reward_errors" not in json.loads(rollout.to_json())


def test_single_turn_truncation_by_max_new_tokens_and_by_max_seq_len(tokenizer):
    long = encode(tokenizer, "a long reply that goes on")
    env = SingleTurnEnv([{"question": "hi"}], Rubric(), tokenizer, max_new_tokens=3)
    rollout = asyncio.run(env.rollout(ScriptedSampler([long]), env.dataset[0], 0))
    assert rollout.truncated and rollout.completion_ids == long[:3]

    prompt_len = len(asyncio.run(env.rollout(ScriptedSampler([[5]]), env.dataset[0], 0)).prompt_ids)
    env = SingleTurnEnv([{"question": "hi"}], Rubric(), tokenizer, max_new_tokens=50, max_seq_len=prompt_len + 2)
    sampler = ScriptedSampler([long])
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))
    assert (
        sampler.calls[0][1] == 2
        and rollout.truncated
        and len(rollout.prompt_ids + rollout.completion_ids) == prompt_len + 2
    )


def test_rollout_group_runs_n_rollouts_of_one_row(tokenizer):
    env = SingleTurnEnv([{"question": "a"}, {"question": "b"}], Rubric(), tokenizer)
    rollouts = asyncio.run(env.rollout_group(ScriptedSampler([[5], [6], [7]]), env.dataset[1], "g1", 3))
    assert len(rollouts) == 3 and {r.group_id for r in rollouts} == {"g1"}
    assert sorted(r.completion_ids[0] for r in rollouts) == [5, 6, 7]
    assert all(r.prompt == [{"role": "user", "content": "b"}] for r in rollouts)


def test_multi_turn_keeps_sampled_tokens_verbatim_and_masks_environment_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    turns = [
        tokenizer.convert_tokens_to_ids(["c", "a", "t"]) + [eos],  # not how the tokenizer would encode "cat"
        encode(tokenizer, "dog"),  # stopped without eos: the template's end-of-turn is the environment's
        encode(tokenizer, "stop") + [eos],
    ]
    assert turns[0][:-1] != encode(tokenizer, "cat")
    env = EchoEnv([{"question": "go"}], Rubric(), tokenizer)
    sampler = ScriptedSampler(turns)
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))

    ids, mask, logprobs = rollout.completion_ids, rollout.completion_mask, rollout.completion_logprobs
    assert [t for t, m in zip(ids, mask) if m == 1] == [t for turn in turns for t in turn]
    expected_logprobs = [
        -0.5 - 0.01 * (100 * call + i) for call, turn in enumerate(turns, start=1) for i in range(len(turn))
    ]
    assert [lp for lp, m in zip(logprobs, mask) if m == 1] == expected_logprobs
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)

    # Environment segments: after an eos only the newline is missing; without eos the end-of-turn token comes first.
    segments, current = [], []
    for token, m in zip(ids, mask):
        if m == 0:
            current.append(token)
        elif current:
            segments, current = segments + [current], []
    assert [tokenizer.decode(s) for s in segments] == [
        "\n<|im_start|>user\nagain 1<|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|>\n<|im_start|>user\nagain 2<|im_end|>\n<|im_start|>assistant\n",
    ]
    assert segments[1][0] == eos

    # Each sample continues the whole sequence so far; the sequence reads exactly as the chat template renders it.
    starts = [i for i in range(len(ids)) if mask[i] == 1 and (i == 0 or mask[i - 1] == 0)]
    assert [call[0] for call in sampler.calls] == [rollout.prompt_ids + ids[:start] for start in starts]
    rendered = tokenizer.apply_chat_template(rollout.prompt + rollout.completion, tokenize=False)
    assert tokenizer.decode(rollout.prompt_ids + ids) + "\n" == rendered
    assert [m["content"] for m in rollout.completion] == ["cat", "again 1", "dog", "again 2", "stop"]
    assert rollout.truncated is False


def test_multi_turn_stops_at_max_turns_and_when_the_sequence_is_full(tokenizer):
    eos = tokenizer.eos_token_id
    env = EchoEnv([{"question": "go"}], Rubric(), tokenizer, max_turns=2)
    rollout = asyncio.run(env.rollout(ScriptedSampler([[5, eos], [6, eos]]), env.dataset[0], 0))
    assert [m["role"] for m in rollout.completion] == ["assistant", "user", "assistant"] and not rollout.truncated

    prompt_len = len(rollout.prompt_ids)
    env = EchoEnv([{"question": "go"}], Rubric(), tokenizer, max_seq_len=prompt_len + 10)
    rollout = asyncio.run(env.rollout(ScriptedSampler([[5, eos]]), env.dataset[0], 0))
    assert rollout.truncated and rollout.completion_ids == [5, eos]  # the environment's reply would not fit


@pytest.mark.parametrize("limit,value", [("max_turns", None), ("max_turns", 2.5), ("max_new_tokens", None),
                                         ("max_seq_len", "512")])
def test_a_limit_that_is_not_a_whole_number_is_refused_by_name(tokenizer, limit, value):
    # As --env_args '{"max_turns": null}' passes it: it said "'<' not supported between NoneType and int", or a
    # max_turns of 2.5 ran three model turns.
    with pytest.raises(ValueError, match=rf"EchoEnv: {limit} must be an int >= \d+, got {value!r}"):
        EchoEnv([{"question": "go"}], Rubric(), tokenizer, **{limit: value})
    import numpy as np

    assert EchoEnv([{"question": "go"}], Rubric(), tokenizer, **{limit: np.int64(64)}).max_seq_len > 2  # an int


def test_a_single_turn_environment_refuses_max_turns_by_name(tokenizer):
    # As --env_args '{"max_turns": 3}' passes it to reverse_text: Python's "got multiple values for keyword argument".
    with pytest.raises(ValueError, match=r"SingleTurnEnv: max_turns=3 is refused: a single-turn environment has one "
                                         r"model turn; use a MultiTurnEnv for several"):
        SingleTurnEnv([{"question": "go"}], Rubric(), tokenizer, max_turns=3)
    assert SingleTurnEnv([{"question": "go"}], Rubric(), tokenizer, max_turns=1).max_turns == 1  # what it is


def test_a_multi_turn_environment_without_env_response_is_refused_when_built(tokenizer):
    # It failed only at the first model turn that ended before max_new_tokens (with a real model perhaps steps into
    # the run, as a dropped group), with NotImplementedError.
    class NoReply(MultiTurnEnv):
        pass

    with pytest.raises(ValueError, match=r"^NoReply: NoReply defines no env_response\(messages, state\), which a "
                                         r"MultiTurnEnv of max_turns=10 calls after each model turn but its last"):
        NoReply([{"question": "go"}], Rubric(), tokenizer)
    assert NoReply([{"question": "go"}], Rubric(), tokenizer, max_turns=1).max_turns == 1  # never called: taken


def test_is_completed_sees_the_last_allowed_turn_too(tokenizer):
    # A game that records the outcome when it checks the model's turn, and a reward that reads it: an answer on the
    # last allowed turn scored as if never given when max_turns ended the episode before is_completed ran.
    class Game(EchoEnv):
        def is_completed(self, messages, state):
            state["solved"] = "stop" in messages[-1]["content"]
            return state["solved"]

    def solved(state):
        return float(state.get("solved", False))

    eos = tokenizer.eos_token_id
    env = Game([{"question": "go"}], Rubric([solved]), tokenizer, max_turns=2)
    sampler = ScriptedSampler([[5, eos], encode(tokenizer, "stop") + [eos]])
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))
    assert [m["content"] for m in rollout.completion][-1] == "stop" and rollout.reward == 1.0


def test_the_environments_reply_can_end_the_episode(tokenizer):
    # is_completed runs after model turns only: a game decided by the model's move still asked for another model
    # turn after announcing the outcome. As in verifiers' MultiTurnEnv, the reply set as final_env_response ends it.
    class Game(EchoEnv):
        def env_response(self, messages, state):
            reply = [{"role": "user", "content": "You win."}]
            if state["turn"] == 2:
                state["final_env_response"] = reply
            return reply

    def heard_outcome(completion):
        return float(completion[-1]["content"] == "You win.")

    eos = tokenizer.eos_token_id
    env = Game([{"question": "go"}], Rubric([heard_outcome]), tokenizer, max_turns=5)
    sampler = ScriptedSampler([[5, eos], [6, eos], [7, eos]])
    rollout = asyncio.run(env.rollout(sampler, env.dataset[0], 0))
    assert len(sampler.calls) == 2 and rollout.reward == 1.0 and not rollout.truncated
    assert [m["role"] for m in rollout.completion] == ["assistant", "user", "assistant", "user"]
    assert [t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m] == [5, eos, 6, eos]
    assert rollout.completion_ids[-2:] == [6, eos]  # the final reply is no tokens: no model turn follows it


def test_template_that_is_not_prefix_consistent_is_a_clear_error(tokenizer):
    counting = copy.deepcopy(tokenizer)
    counting.chat_template = "{{ messages | length }} messages\n" + tokenizer.chat_template
    env = EchoEnv([{"question": "go"}], Rubric(), counting)
    with pytest.raises(RolloutError, match="not prefix-consistent") as caught:
        asyncio.run(env.rollout(ScriptedSampler([[5, counting.eos_token_id]]), env.dataset[0], 0))
    assert isinstance(caught.value.__cause__, TemplateError)


def test_an_environment_raising_mid_rollout_names_itself_and_the_row(tokenizer):
    class GameServerEnv(MultiTurnEnv):
        def env_response(self, messages, state):
            raise ConnectionError("game server down")

    env = GameServerEnv([{"question": "a"}, {"question": "b"}], Rubric(), tokenizer)
    with pytest.raises(RolloutError, match="GameServerEnv failed on dataset row 1: ConnectionError: game server down"):
        asyncio.run(env.rollout(ScriptedSampler([[5]]), env.dataset[1], 0))


def test_a_rollout_that_fails_stops_the_rest_of_its_group(tokenizer):
    # The group is generated again (or dropped): its other episodes left running would play on unseen beside the
    # retry's, holding the engine's rows and the environment's resources (a sandbox, a game server) meanwhile.
    class SandboxEnv(MultiTurnEnv):
        failed = False
        turns_played = 0

        async def env_response(self, messages, state):
            if not self.failed:  # one episode's sandbox fails; the others go on
                self.failed = True
                raise ConnectionError("sandbox gone")
            await asyncio.sleep(0.01)
            self.turns_played += 1
            return [{"role": "user", "content": "more"}]

    env = SandboxEnv([{"question": "go"}], Rubric(), tokenizer, max_turns=20)

    async def failing_group():
        with pytest.raises(RolloutError, match="sandbox gone"):
            await env.rollout_group(ScriptedSampler([[5, tokenizer.eos_token_id]] * 100), env.dataset[0], 0, 3)
        played = env.turns_played
        await asyncio.sleep(0.3)  # time for the other two episodes' 19 turns each, had they gone on
        return played, env.turns_played

    played, later = asyncio.run(failing_group())
    assert later == played, f"the failed group's other episodes played {later - played} more turns after it failed"


def test_a_trl_form_reward_that_fails_stops_the_others_of_its_group(tokenizer):
    # TRL's form: one reward function raising left the other (async) ones running unseen while the group was retried.
    from verifiers_rl.envs.adapters.trl_dataset import RewardFunctionsEnv

    steps = []

    async def judge(completions, **kwargs):  # an LLM judge polling its server
        for _ in range(30):
            await asyncio.sleep(0.01)
            steps.append(1)
        return [0.0] * len(completions)

    async def broken(completions, **kwargs):
        await asyncio.sleep(0.02)
        raise ConnectionError("judge gone")

    env = RewardFunctionsEnv([{"prompt": "go"}], [judge, broken], tokenizer, max_new_tokens=4, max_seq_len=64)

    async def failing_group():
        with pytest.raises(RolloutError, match="judge gone"):
            await env.rollout_group(ScriptedSampler([[5, tokenizer.eos_token_id]] * 2), env.dataset[0], 0, 2)
        done = len(steps)
        await asyncio.sleep(0.4)  # time for the judge's 30 polls, had it gone on
        return done, len(steps)

    done, later = asyncio.run(failing_group())
    assert later == done < 30, f"the judge polled {later - done} more times after its group failed"


def test_a_rollout_that_changes_its_task_leaves_the_dataset_row_as_it_was(tokenizer):
    # A game whose row gives the starting board and whose turns play on it in state["info"]: the dataset row's own
    # board was played on, so the group's other episodes, and every later epoch, began from a board already played.
    class Game(MultiTurnEnv):
        def env_response(self, messages, state):
            state["info"]["board"].append("X")
            return [{"role": "user", "content": " ".join(state["info"]["board"])}]

    def board_size(info, answer):
        return float(len(info["board"]) + len(answer))

    eos = tokenizer.eos_token_id
    env = Game([{"question": "play", "answer": ["win"], "info": {"board": ["."]}}], Rubric([board_size]), tokenizer,
               max_turns=3)
    rollouts = asyncio.run(env.rollout_group(ScriptedSampler([[5, eos]] * 9), env.dataset[0], 0, 3))
    assert [r.completion[-2]["content"] for r in rollouts] == [". X X"] * 3
    assert [r.reward for r in rollouts] == [4.0] * 3
    assert env.dataset[0].info == {"board": ["."]} and env.dataset[0].answer == ["win"]


def test_a_rollout_that_edits_its_messages_leaves_the_dataset_prompt_as_it_was(tokenizer):
    # An environment that keeps the game's state in the system message, edited in place: it edited the dataset row's
    # own prompt, so every later rollout of the row began from another prompt.
    class Game(MultiTurnEnv):
        def env_response(self, messages, state):
            messages[0]["content"] += " (moved)"
            return [{"role": "user", "content": "your move"}]

    eos = tokenizer.eos_token_id
    env = Game([{"question": "play"}], Rubric(), tokenizer, system_prompt="A game.", max_turns=2)
    first, second = (asyncio.run(env.rollout(ScriptedSampler([[5, eos]] * 2), env.dataset[0], 0)) for _ in range(2))
    assert first.prompt_ids == second.prompt_ids and env.dataset[0].prompt[0]["content"] == "A game."


def test_sampler_breaking_its_contract_is_a_clear_error(tokenizer):
    class OverlongSampler:
        async def sample(self, prompt_ids, max_new_tokens):
            return Sample([5] * (max_new_tokens + 1), [-1.0] * (max_new_tokens + 1), "stop")

    env = SingleTurnEnv([{"question": "a"}], Rubric(), tokenizer, max_new_tokens=4)
    with pytest.raises(RolloutError, match="returned 5 tokens, more than max_new_tokens=4"):
        asyncio.run(env.rollout(OverlongSampler(), env.dataset[0], 0))


def test_rows_whose_prompt_cannot_fit_are_dropped_at_load(tokenizer, caplog):
    short, long = {"question": "hi"}, {"question": "a fairly long question " * 4}
    fits = len(SingleTurnEnv([short], Rubric(), tokenizer).prompt_ids([{"role": "user", "content": "hi"}]))
    with caplog.at_level(logging.WARNING):
        env = SingleTurnEnv([long, short, long], Rubric(), tokenizer, max_seq_len=fits + 1, eval_dataset=[long, short])
    assert [row.index for row in env.dataset] == [1] and [row.index for row in env.eval_dataset] == [1]
    assert f"SingleTurnEnv: dropped 2 of the 3 rows of its dataset whose rendered prompt leaves no room for a " \
           f"completion within max_seq_len={fits + 1}" in caplog.text
    assert "dropped 1 of the 2 rows of its eval_dataset" in caplog.text
    with pytest.raises(ValueError, match=rf"no row of the dataset fits max_seq_len={fits}: every rendered prompt is "
                                         rf"{fits} tokens or longer. Raise the environment's max_seq_len"):
        SingleTurnEnv([short, long], Rubric(), tokenizer, max_seq_len=fits)
    # Only rows that fit are rolled out; one that does not, given directly, is still a clear error.
    with pytest.raises(RolloutError, match=r"SingleTurnEnv failed on dataset row 7: ValueError: the prompt is \d+ tokens"):
        asyncio.run(env.rollout(ScriptedSampler([]), Row(7, [{"role": "user", "content": long["question"]}]), 0))


def test_dataset_validation(tokenizer):
    with pytest.raises(ValueError, match="SingleTurnEnv: the dataset is empty"):
        SingleTurnEnv([], Rubric(), tokenizer)
    with pytest.raises(ValueError, match=r"dataset row 1 needs 'prompt' .* or 'question' .*; it has keys \['answer'\]"):
        SingleTurnEnv([{"question": "a"}, {"answer": "b"}], Rubric(), tokenizer)
    with pytest.raises(
        TypeError, match="dataset row 0, 'prompt': message 0 must be a dict with string 'role' and 'content'"
    ):
        SingleTurnEnv([{"prompt": [{"role": "user"}]}], Rubric(), tokenizer)
    with pytest.raises(TypeError, match="'info' must be a dict"):
        SingleTurnEnv([{"question": "a", "info": "x"}], Rubric(), tokenizer)
    with pytest.raises(TypeError, match=r"SingleTurnEnv: dataset row 1: 'question' must be a string, got int 0\."):
        SingleTurnEnv([{"question": "a"}, {"question": 0}], Rubric(), tokenizer)
    with pytest.raises(ValueError, match=r"SingleTurnEnv: eval_dataset row 0 needs 'prompt'"):  # which split it is in
        SingleTurnEnv([{"question": "a"}], Rubric(), tokenizer, eval_dataset=[{"answer": "b"}])
    no_template = copy.deepcopy(tokenizer)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        SingleTurnEnv([{"question": "a"}], Rubric(), no_template)


def test_prompt_rows_system_prompt_and_hf_datasets(tokenizer):
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "p"}], "answer": "1"}])
    env = SingleTurnEnv(rows, Rubric(), tokenizer, system_prompt="S")
    assert env.dataset[0].prompt == [{"role": "system", "content": "S"}, {"role": "user", "content": "p"}]
    assert env.dataset[0].answer == "1" and env.dataset[0].info == {}
    own_system = [{"role": "system", "content": "mine"}, {"role": "user", "content": "p"}]
    assert (
        SingleTurnEnv([{"prompt": own_system}], Rubric(), tokenizer, system_prompt="S").dataset[0].prompt == own_system
    )


def test_plain_hooks_run_one_at_a_time_on_the_event_loop(tokenizer):
    """The documented choice (docs/environments.md): a plain (def) env_response, is_completed or reward function runs
    on the event loop's thread, one at a time, unlike a plain tool (a worker thread), so user state shared between
    rollouts needs no lock. An unlocked read-modify-write with a pause inside, run by 4 concurrent rollouts, loses no
    update; in worker threads it would."""
    import threading
    import time

    shared = {"count": 0, "threads": set()}

    def bump():
        shared["threads"].add(threading.get_ident())
        count = shared["count"]
        time.sleep(0.005)  # another thread, if hooks ran in threads, would read the same count meanwhile
        shared["count"] = count + 1

    class Counting(MultiTurnEnv):
        def is_completed(self, messages, state):
            bump()
            return False

        def env_response(self, messages, state):
            bump()
            return [{"role": "user", "content": "again"}]

    def counted(completion):
        bump()
        return 1.0

    eos = tokenizer.eos_token_id
    env = Counting([{"question": "go"}], Rubric([counted]), tokenizer, max_turns=3)

    class Model:  # every turn "5 <eos>", yielding to the loop as an engine does
        async def sample(self, prompt_ids, max_new_tokens):
            await asyncio.sleep(0)
            return Sample([5, eos], [-1.0, -1.0], "stop")

    async def four():
        loop_thread = threading.get_ident()
        rollouts = await asyncio.gather(*(env.rollout(Model(), env.dataset[0], i) for i in range(4)))
        return loop_thread, rollouts

    loop_thread, rollouts = asyncio.run(four())
    assert [r.reward for r in rollouts] == [1.0] * 4
    assert shared["threads"] == {loop_thread}
    assert shared["count"] == 4 * (3 + 2 + 1)  # per rollout: 3 is_completed, 2 env_response, 1 reward
