"""The difficulty curriculum (rollouts/curriculum.py): pass rates over a window, easy/hard thresholds (inclusive),
set-aside epochs, a mixture entry's own settings, the draws that skip set-aside rows (and draw as without a
curriculum while none is), the fall-back when every row is set aside, the state's round trip, and the generator
that records every group and publishes its state with the batch (a snapshot resumes to the same batches)."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.curriculum import CurriculumSettings
from verifiers_rl.envs import Rubric, Sample, SingleTurnEnv, load_environment
from verifiers_rl.envs.mixture import MixtureError, load_mixture, parse_entries
from verifiers_rl.rollouts.curriculum import Curriculum, build_curriculum
from verifiers_rl.rollouts.generator import AsyncGenerator
from verifiers_rl.training.run_state import RunState, load_run_state, pending_stats, save_run_state

EASY_HARD = CurriculumSettings(window=2, easy_above=0.75, hard_below=0.25, set_aside_epochs=1)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def scripted_env(tokenizer, rewards: list[float | None]) -> SingleTurnEnv:
    """Row i's every rollout scores ``rewards[i]``; a row of None scores 1 for a completion of token 7, else 0 (half
    of each group under ``AlternatingEngine``)."""
    seven = tokenizer.decode([7])

    def row_reward(completion, info) -> float:
        return float(completion[-1]["content"] == seven) if info["reward"] is None else info["reward"]

    rows = [{"question": f"Say something ({i}).", "info": {"reward": r}} for i, r in enumerate(rewards)]
    return SingleTurnEnv(rows, Rubric([row_reward]), tokenizer, max_new_tokens=4, max_seq_len=64, name="scripted")


class AlternatingEngine:
    """Stands in for the model: token 7, then 8, then 7... in call order (a group's rollouts call in turn)."""

    policy_version = 0

    def __init__(self):
        self.calls = 0

    async def sample(self, prompt_ids, max_new_tokens):
        self.calls += 1
        return Sample([7 + self.calls % 2], [-0.5], "stop")


def mixture(tokenizer, curricula=(None, None)):
    entries = [{"env": "reverse_text", "weight": 1, "env_args": {"num_examples": 6}},
               {"env": "arithmetic", "weight": 2, "env_args": {"num_examples": 5}}]
    for entry, curriculum in zip(entries, curricula):
        if curriculum is not None:
            entry["curriculum"] = curriculum
    load = lambda entry: load_environment(entry.env, tokenizer=tokenizer, **entry.env_args)  # noqa: E731
    return load_mixture(parse_entries(json.dumps(entries)), load, lambda env, entry: None)


def config(**curriculum) -> RLConfig:
    return RLConfig(output_dir="unused", use_cpu=True, report_to="none", seed=5, **curriculum)


def test_pass_rate_is_the_window_mean_and_thresholds_are_inclusive(tokenizer):
    env = scripted_env(tokenizer, [0.0] * 6)
    curriculum = Curriculum(env, env.dataset, [EASY_HARD], seed=0)
    curriculum.record(0, [1, 1, 0, 1])  # 0.75: the window (2) is not full yet
    assert not curriculum.set_aside
    curriculum.record(0, [1, 1, 1, 0.5])  # pass_reward 1.0: 0.5 fails -> (0.75 + 0.75) / 2 = 0.75, at the threshold
    curriculum.record(1, [0, 0, 0, 0])
    curriculum.record(1, [0, 0, 1, 0])  # 0.125 <= 0.25
    curriculum.record(2, [1, 0, 1, 0])
    curriculum.record(2, [1, 0, 0, 1])  # 0.5: neither
    curriculum.record(3, [1, 1, 1, 1])
    curriculum.record(3, [0, 0, 0, 0])  # 0.5: the mean of the window, not its last group
    assert curriculum.set_aside == {0: (2, "easy"), 1: (2, "hard")}  # epoch 0 + 1 epoch + 1: back in epoch 2
    assert 0 not in curriculum.history and curriculum.history[2] == [0.5, 0.5]  # judged afresh once it is back
    assert curriculum.metrics() == {"curriculum/set_aside": 2.0, "curriculum/set_aside_easy": 1.0,
                                    "curriculum/set_aside_hard": 1.0}
    lenient = Curriculum(env, env.dataset, [CurriculumSettings(pass_reward=0.5, easy_above=1.0)], seed=0)
    lenient.record(4, [0.5, 0.9, 1.0])  # every reward >= 0.5 passes: 1.0 >= easy_above 1.0
    assert lenient.set_aside == {4: (2, "easy")}


def test_a_group_of_branching_episodes_counts_each_episode_once(tokenizer):
    from verifiers_rl.core.rollout import Rollout

    env = scripted_env(tokenizer, [0.0] * 2)
    curriculum = Curriculum(env, env.dataset, [CurriculumSettings(easy_above=0.75)], seed=0)
    branches = [Rollout([1], [2], [1], 1.0, "g", episode_id="a") for _ in range(3)]
    curriculum.record_group(env.dataset[0], [*branches, Rollout([1], [2], [1], 0.0, "g")])
    assert not curriculum.set_aside and curriculum.history == {0: [0.5]}  # 1 of 2 episodes, not 3 of 4 rollouts


def test_draws_skip_a_set_aside_row_for_its_epochs_and_equal_the_plain_draws_until_then(tokenizer):
    env = scripted_env(tokenizer, [0.0] * 6)
    plain = AsyncGenerator(env, None, rollouts_per_step=4, num_generations=2, seed=3)  # 2 prompts per batch
    expected = [row for index in range(12) for _, row in plain._rows_of(index)]  # 4 epochs of 6 rows
    for epochs, back in ((1, True), (0, False)):
        curriculum = Curriculum(env, env.dataset, [CurriculumSettings(easy_above=1.0, set_aside_epochs=epochs)],
                                seed=3)
        first = [row for _, row in curriculum.draw(list(range(6)))]
        assert first == expected[:6]  # nothing set aside: the generator's own order
        dropped = first[2]
        curriculum.record(dropped, [1.0, 1.0])
        later = [row for _, row in curriculum.draw(list(range(6, 6 + 17)))]
        assert later[:5] == [row for row in expected[6:12] if row != dropped]  # epoch 1 without it
        if back:  # set aside in epoch 0 for 1 epoch: drawn again in epoch 2, in its place
            assert later[5:11] == expected[12:18] and later[11:17] == expected[18:24]
        else:
            assert dropped not in later and len(later) == 17
        assert curriculum.metrics()["curriculum/set_aside"] == (0.0 if back else 1.0)


def test_a_mixture_draws_as_without_a_curriculum_until_a_row_is_set_aside(tokenizer):
    env = mixture(tokenizer)
    curriculum = Curriculum(env, env.dataset, [CurriculumSettings(hard_below=0.0)] * 2, seed=5)
    assert [row for _, row in curriculum.draw(list(range(40)))] == env.draw_rows(list(range(40)), seed=5)
    assert curriculum.refill(3, 1, 50) == env.draw_refill(3, 1, 50, seed=5)

    fresh = Curriculum(env, env.dataset, [CurriculumSettings(hard_below=0.0)] * 2, seed=5)
    arithmetic = list(env.entry_rows(1))
    for row in arithmetic[:4]:
        fresh.record(row, [0.0, 0.0])  # hard in epoch 0, for 1 epoch
    drawn = [row for _, row in fresh.draw(list(range(60)))]
    plain = env.draw_rows(list(range(60)), seed=5)
    assert [r for r in drawn if r not in arithmetic] == [r for r in plain if r not in arithmetic]  # the other entry
    mine = [r for r in drawn if r in arithmetic]
    # Epochs 0 and 1 hold the one row left, once each; from epoch 2 the entry's own orders, whole.
    expected = [arithmetic[4]] * 2 + [r for epoch in range(2, 20) for r in env.entry_order(1, epoch, 5)]
    assert len(mine) > 10 and mine == expected[:len(mine)]
    assert set(fresh.refill(4, 1, 30)) & set(arithmetic) <= set(arithmetic)
    assert fresh.metrics()["env/arithmetic/curriculum/set_aside"] == 0.0  # back


def test_each_mixture_entry_takes_its_own_curriculum(tokenizer):
    env = mixture(tokenizer, curricula=({"easy_above": 0.5, "set_aside_epochs": 0}, None))
    curriculum = build_curriculum(config(curriculum_hard_below=0.0), env, list(env.dataset))
    assert [s.easy_above for s in curriculum.settings] == [0.5, None]
    assert [s.hard_below for s in curriculum.settings] == [0.0, 0.0]  # the flag where the entry says nothing
    text, arithmetic = env.entry_rows(0)[0], env.entry_rows(1)[0]
    for row in (text, arithmetic):
        curriculum.record(row, [1.0, 0.0])  # 0.5: easy for the entry that says so
    assert curriculum.set_aside == {text: (None, "easy")}  # set_aside_epochs 0: for good
    metrics = curriculum.metrics()
    assert metrics["env/reverse_text/curriculum/set_aside_easy"] == 1.0
    assert metrics["env/arithmetic/curriculum/set_aside"] == 0.0 and metrics["curriculum/set_aside"] == 1.0
    assert build_curriculum(config(), mixture(tokenizer), []) is None  # no threshold anywhere: off
    only_one = build_curriculum(config(), mixture(tokenizer, curricula=(None, {"hard_below": 0.0})), [])
    assert [s.active for s in only_one.settings] == [False, True]


@pytest.mark.parametrize("curriculum, message", [
    ({"easy": 1.0}, "unknown key(s) 'easy'"),
    ([0.5], "\"curriculum\" must be a mapping"),
    ({"easy_above": 0}, "curriculum.easy_above must be > 0"),
    ({"hard_below": 1}, "curriculum.hard_below must be < 1"),
    ({"window": 0}, "curriculum.window must be >= 1"),
    ({"window": 1.5}, "curriculum.window must be an integer"),
    ({"set_aside_epochs": -1}, "curriculum.set_aside_epochs must be >= 0"),
    ({"pass_reward": "high"}, "curriculum.pass_reward must be a finite number"),
    ({"easy_above": 0.5, "hard_below": 0.5}, "curriculum.hard_below (0.5) must be below curriculum.easy_above"),
])
def test_a_bad_entry_curriculum_is_refused_naming_the_entry(curriculum, message):
    entries = [{"env": "arithmetic", "name": "sums", "curriculum": curriculum}]
    with pytest.raises(MixtureError) as error:
        parse_entries(json.dumps(entries))
    assert message in str(error.value) and "entry 0 (arithmetic)" in str(error.value)


def test_an_entry_that_tunes_a_curriculum_without_a_threshold_is_refused_naming_it(tokenizer):
    env = mixture(tokenizer, curricula=({"window": 2}, {"hard_below": 0.0}))
    with pytest.raises(ValueError, match=r"--env entry 'reverse_text': curriculum: \{'window': 2\} tunes a "
                                         r"curriculum, which acts only with easy_above or hard_below"):
        build_curriculum(config(), env, list(env.dataset))
    # With a threshold from the flags the entry's window acts.
    assert build_curriculum(config(curriculum_easy_above=1.0), env, list(env.dataset)).settings[0].window == 2


def test_an_entry_that_crosses_the_flags_is_refused_naming_it(tokenizer):
    env = mixture(tokenizer, curricula=(None, {"hard_below": 0.6}))
    with pytest.raises(ValueError, match=r"--env entry 'arithmetic': curriculum.hard_below \(0.6\) must be below "
                                         r"curriculum.easy_above \(0.5\)"):
        build_curriculum(config(curriculum_easy_above=0.5), env, list(env.dataset))


def test_an_entry_whose_every_row_is_set_aside_draws_them_anyway(tokenizer, caplog):
    env = scripted_env(tokenizer, [0.0] * 4)
    curriculum = Curriculum(env, env.dataset, [CurriculumSettings(hard_below=0.0, set_aside_epochs=0)], seed=1)
    plain = [row for _, row in Curriculum(env, env.dataset, [CurriculumSettings()], seed=1).draw(list(range(12)))]
    for row in range(4):
        curriculum.record(row, [0.0])
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.rollouts.curriculum"):
        drawn = [row for _, row in curriculum.draw(list(range(12)))]
    assert drawn == plain  # in order, as though none were set aside; no endless search
    assert "every row of the environment is set aside" in caplog.text
    assert curriculum.metrics()["curriculum/set_aside_hard"] == 4.0


def test_the_state_round_trips_through_json(tokenizer):
    env = mixture(tokenizer)
    settings = [CurriculumSettings(window=2, easy_above=0.5, hard_below=0.0, set_aside_epochs=2)] * 2
    curriculum = Curriculum(env, env.dataset, settings, seed=5)
    for position, row in curriculum.draw(list(range(30))):
        curriculum.record(row, [float(position % 3 == 0), 0.0, 0.0, float(position % 2)])
    assert curriculum.set_aside and curriculum.history  # something to carry over
    again = Curriculum(env, env.dataset, settings, seed=5)
    again.load_json(json.loads(json.dumps(curriculum.to_json())), "checkpoint-2")
    assert again.to_json() == curriculum.to_json()
    assert again.draw(list(range(30, 60))) == curriculum.draw(list(range(30, 60)))
    other = Curriculum(scripted_env(tokenizer, [0.0] * 3), list(range(3)), [settings[0]], seed=5)
    with pytest.raises(ValueError, match="checkpoint-2: the curriculum tracked environments"):
        other.load_json(curriculum.to_json(), "checkpoint-2")


@pytest.mark.parametrize("k, filter_groups", [(0, False), (1, True)])
def test_the_generator_sets_rows_aside_logs_it_and_a_snapshot_resumes_to_the_same_batches(tokenizer, k,
                                                                                        filter_groups, tmp_path):
    # Rows 0-1 always pass (easy), 2-3 never (hard), 4-9 half the time (with filter_groups rows 0-3 have no signal:
    # refills come from the rows not set aside, and their groups are recorded too).
    env = scripted_env(tokenizer, [1.0, 1.0, 0.0, 0.0] + [None] * 6)
    args = config(curriculum_easy_above=1.0, curriculum_hard_below=0.0, curriculum_pass_reward=1.0)

    def generator():
        return AsyncGenerator(env, AlternatingEngine(), rollouts_per_step=8, num_generations=2, seed=5,
                              max_off_policy_steps=k, filter_groups=filter_groups, max_refill_batches=1,
                              timeout_s=60, curriculum=build_curriculum(args, env, list(env.dataset)))

    def rows_of(batch):
        return [r.prompt[-1]["content"] for r in batch.rollouts[::2]]

    def take(gen, indices, checkpoint_after=None):
        batches, saved = [], None
        try:
            for index in indices:
                batches.append(gen.batch(index))
                if index == checkpoint_after:
                    gen.wait_for_older_batches(index + 1)  # k = 1: the next batch is generated ahead, and pending
                    saved = gen.snapshot()  # as a checkpoint after this batch is trained
                gen.engine.policy_version = index + 1  # as a weight load would
                gen.weights_updated()
        finally:
            gen.close()
        return batches, saved

    batches, (pending, state, counts_saved) = take(generator(), range(6), checkpoint_after=2)
    seen = [row for batch in batches for row in rows_of(batch)]
    counts = [(b.stats["curriculum/set_aside_easy"], b.stats["curriculum/set_aside_hard"]) for b in batches]
    firsts = [f"Say something ({i})." for i in range(4)]
    if not filter_groups:  # every group is a batch's: epoch 0 is positions 0-9, epoch 1 without rows 0-3 is 10-15
        assert sorted(seen[:4]) == firsts and counts[:3] == [(2.0, 2.0)] * 3, (seen, counts)
        assert not set(seen[4:16]) & set(firsts) and set(seen[16:]) & set(firsts), seen
        assert counts[3] == (0.0, 0.0)  # the cursor is in epoch 2: they are back
    else:  # rows 0-3 have no signal: dropped and refilled from the rows not set aside
        assert (2.0, 2.0) in counts and all(len(b.rollouts) == 8 for b in batches), counts
        assert sum(b.stats["groups_dropped"] for b in batches) >= 4
    assert len(pending) == k and state["cursors"] != [0]
    resumed = generator()
    resumed.engine.policy_version = 3
    saved = RunState(0, 3, 0, 1, 8, 1, 0, {}, {})  # the counts through the checkpoint's state file, as JSON
    save_run_state(tmp_path, saved, pending, state, counts_saved)
    counts_read = pending_stats(load_run_state(tmp_path))
    assert sorted(counts_read) == sorted(pending) == list(range(3, 3 + k))
    resumed.restore(3, pending, json.loads(json.dumps(state)), stats=counts_read)
    again, _ = take(resumed, range(3, 6))
    assert [rows_of(b) for b in again] == [rows_of(b) for b in batches[3:]]
    # Every batch logs the counts the uninterrupted run logged, the pending ones' read back from the checkpoint.
    assert [b.stats for b in again] == [b.stats for b in batches[3:]]
