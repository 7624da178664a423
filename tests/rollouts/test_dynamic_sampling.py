"""--filter_groups zero_variance (DAPO's dynamic sampling): groups whose rewards are all equal are dropped and live
generation refills the batch with informative groups; replay only filters. The 2-process agreement is in
tests/integration/test_distributed_equivalence.py (configuration grpo_filter_zero_variance_padded2)."""

from __future__ import annotations

import hashlib
import logging

import pytest
from transformers import AutoTokenizer

from verifiers_rl.envs import Rubric, SingleTurnEnv
from verifiers_rl.rollouts.generator import AsyncGenerator, drop_zero_variance_groups, has_signal
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.core.rollout import Rollout, write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts


def scripted_reward(completion, info) -> float:
    """0.5 for every sample of a 'constant' row (no signal); otherwise a value read off the sampled text, which
    differs between samples."""
    if info["constant"]:
        return 0.5
    text = completion[-1]["content"]
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 16**8


def environment(tokenizer, informative_rows: list[int], num_rows: int = 12) -> SingleTurnEnv:
    rows = [{"question": f"Say something ({i}).", "info": {"constant": i not in informative_rows, "row": i}}
            for i in range(num_rows)]
    return SingleTurnEnv(rows, Rubric([scripted_reward]), tokenizer, max_new_tokens=8, max_seq_len=64, name="scripted")


def generator(tiny_model_dir, env, k: int = 0, refills: int = 3) -> AsyncGenerator:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=8))
    return AsyncGenerator(env, engine, rollouts_per_step=16, num_generations=4, max_off_policy_steps=k, seed=3,
                          filter_groups=True, max_refill_batches=refills, timeout_s=120)


def groups_of(rollouts: list[Rollout]) -> dict:
    groups: dict = {}
    for rollout in rollouts:
        groups.setdefault(rollout.group_id, []).append(rollout)
    return groups


@pytest.mark.parametrize("k", [0, 1])
def test_live_batches_keep_exactly_the_informative_groups_and_stay_full(tiny_model_dir, k):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    informative = [1, 4, 6, 7, 9, 11]
    gen = generator(tiny_model_dir, environment(tokenizer, informative), k=k)
    try:
        for index in range(2):
            record = gen.batch(index)
            batch = record.rollouts
            if k:
                # as the trainer's weight load: after the batches the old version generates, never mid-batch
                gen.wait_for_older_batches(index + 1)
                with gen.hold_weights():
                    gen.engine.policy_version = index + 1
                gen.weights_updated()
            groups = groups_of(batch)
            assert len(batch) == 16 and len(groups) == 4  # the batch size holds
            # Batch at a time, refills included: every sampled token carries the batch's version.
            assert all(r.completion_versions == [r.policy_version] * len(r.completion_ids) for r in batch)
            for members in groups.values():
                assert len(members) == 4 and has_signal(members)
                assert members[0].prompt[-1]["content"] in {f"Say something ({i})." for i in informative}
            stats = record.stats
            assert stats["groups_kept"] == 4
            # Every constant row that was generated was dropped: at least those of the first pick.
            first_pick = [row for _, row in gen._rows_of(index)]
            constant_picked = sum(row not in informative for row in first_pick)
            assert stats["groups_dropped"] >= constant_picked
            assert (stats["refill_generations"] > 0) == (constant_picked > 0)  # refills only when groups were dropped
    finally:
        gen.close()


def test_a_batch_without_enough_signal_is_trained_as_it_is_with_a_warning(tiny_model_dir, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    gen = generator(tiny_model_dir, environment(tokenizer, informative_rows=[5]), refills=2)
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.rollouts.generator"):
        record = gen.batch(0)
    batch = record.rollouts
    groups = groups_of(batch)
    # One informative row: at most once per round (3 rounds: the batch and 2 refills), never a constant group.
    assert 1 <= len(groups) <= 3 and all(has_signal(g) for g in groups.values())
    assert record.stats["refill_generations"] == 2 and record.generation_s > 0
    assert "groups have reward variance after 2 refill round(s) (--max_refill_batches); training on them" in caplog.text

    nothing = generator(tiny_model_dir, environment(tokenizer, informative_rows=[]), refills=1)
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.rollouts.generator"):
        record = nothing.batch(0)
    assert len(record.rollouts) == 16 and record.stats["groups_kept"] == 0  # the unfiltered batch
    assert "none has any, so the unfiltered batch is trained" in caplog.text


def test_a_mixture_counts_the_groups_dropped_per_environment(tiny_model_dir):
    """env/<name>/groups_dropped is, per entry, the zero-variance groups generated of it (the batch's rows and every
    refill round's, drawn by the mixture), 0 for an entry in the batch with none dropped; they add up to the total."""
    from verifiers_rl.envs.mixture import MixtureEntry, MixtureEnv
    from verifiers_rl.training.step_batches import environment_metrics

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    kinds = {"flat": [], "mixed": [0, 2, 4], "lively": list(range(6))}  # each entry's informative rows
    mixture = MixtureEnv([MixtureEntry(name, weight, name=name, environment=environment(tokenizer, rows, 6))
                          for (name, rows), weight in zip(kinds.items(), (2, 2, 1))])
    gen = generator(tiny_model_dir, mixture, refills=2)
    try:
        record = gen.batch(0)
    finally:
        gen.close()
    logged = {**record.stats, **environment_metrics(record.rollouts, record.stats)}  # as StepBatches.plan logs
    drawn = [row for _, row in gen._rows_of(0)]
    for round_ in range(1, int(record.stats["refill_generations"]) + 1):
        drawn += mixture.draw_refill(0, round_, 4, seed=3)
    expected = {name: 0 for name in kinds}
    for row in drawn:
        name = mixture.entries[mixture.dataset[row].entry].name
        expected[name] += mixture.dataset[row].source.info["constant"]
    assert expected["flat"] > 0 and expected["mixed"] > 0 and expected["lively"] == 0
    assert {name: logged.get(f"env/{name}/groups_dropped") for name in ("flat", "mixed")} == \
        {"flat": expected["flat"], "mixed": expected["mixed"]}
    assert logged["env/lively/groups_dropped"] == 0  # in the batch, none dropped
    assert sum(expected.values()) == record.stats["groups_dropped"]
    assert "flat" not in {r.env for r in record.rollouts}  # every flat group was dropped, yet its count is logged


def failing_on_constant_rows(completion, info) -> float:
    """Raises on every 'constant' row (a reward error: it scores 0, so those groups have no signal)."""
    if info["constant"]:
        raise ValueError("cannot score this row")
    return scripted_reward(completion, info)


def test_reward_errors_count_the_groups_dynamic_sampling_dropped_and_its_refills(tiny_model_dir):
    """reward_errors was counted over the trained batch alone: a reward function that failed on every group the
    filter dropped (in the batch's first pick and in its refill rounds) was logged as 0 errors. Overall and per
    mixture entry, it counts every rollout generated."""
    from verifiers_rl.envs.mixture import MixtureEntry, MixtureEnv
    from verifiers_rl.rollouts.generator import as_batch
    from verifiers_rl.training.step_batches import environment_metrics

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"question": f"Say something ({i}).", "info": {"constant": i % 2 == 0}} for i in range(12)]
    env = SingleTurnEnv(rows, Rubric([failing_on_constant_rows]), tokenizer, max_new_tokens=8, max_seq_len=64,
                        name="failing")
    mixture = MixtureEnv([MixtureEntry("failing", 1, name="failing", environment=env)])
    gen = generator(tiny_model_dir, mixture, refills=2)
    try:
        record = as_batch(0, gen.batch(0))  # as StepBatches.plan takes it
    finally:
        gen.close()
    assert all(r.metrics["reward_errors"] == 0 for r in record.rollouts)  # every failing group was dropped
    assert record.stats["groups_dropped"] > 0
    assert record.stats["reward_errors"] == 4 * record.stats["groups_dropped"]  # 4 rollouts a group, 1 error each
    logged = {**record.stats, **environment_metrics(record.rollouts, record.stats)}
    assert logged["env/failing/reward_errors"] == record.stats["reward_errors"]


def test_replay_filters_only(tiny_model_dir, tmp_path):
    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.training.trainer import RLTrainer

    rollouts = random_rollouts(4, 4, vocab_size=390, seed=7)
    for i, rollout in enumerate(rollouts):
        rollout.reward = 1.0 if rollout.group_id in ("g0", "g2") else [0.0, 1.0, 0.5, 0.25][i % 4]
        rollout.env = "flat" if rollout.group_id in ("g0", "g1") else "other"  # a mixture run's file
    kept, dropped = drop_zero_variance_groups(rollouts)
    assert dropped == 2 and sorted({r.group_id for r in kept}) == ["g1", "g3"]
    write_rollouts(tmp_path / "r.jsonl", rollouts)
    args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no",
                    rollouts_path=str(tmp_path / "r.jsonl"), rollouts_per_step=16, max_steps=1, logging_steps=1,
                    filter_groups="zero_variance", disable_tqdm=True, gradient_checkpointing=False,
                    save_rollouts_path=str(tmp_path / "trained.jsonl"))
    trainer = RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "reward" in entry][0]
    assert (logged["groups_kept"], logged["groups_dropped"]) == (2, 2)
    # Per environment too, as live generation counts them: each dropped one of its groups.
    assert (logged["env/flat/groups_dropped"], logged["env/other/groups_dropped"]) == (1, 1), logged
    trained = (tmp_path / "trained.jsonl").read_text().splitlines()
    assert len(trained) == 8  # only the groups with signal reached the batch


@pytest.mark.parametrize("shuffle_dataset", [False, True])
def test_shuffle_dataset_false_draws_prompts_in_the_datasets_order(tiny_model_dir, tmp_path, shuffle_dataset):
    """TRL's shuffle_dataset reaches live generation (through RLConfig and make_source): False draws the rows in
    order, epoch after epoch; True a seeded shuffle, another each epoch."""
    from verifiers_rl import RLConfig
    from verifiers_rl.rollouts.generator import make_source

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = environment(tokenizer, informative_rows=list(range(12)))
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=8))
    config = RLConfig(output_dir=str(tmp_path), use_cpu=True, rollouts_per_step=16, num_generations=4, seed=3,
                      shuffle_dataset=shuffle_dataset)
    gen = make_source(config, None, env, engine)
    try:
        drawn = [row for index in range(6) for _, row in gen._rows_of(index)]  # two epochs of 12 rows
        in_order = list(range(12)) * 2
        assert (drawn == in_order) == (not shuffle_dataset)
        if shuffle_dataset:
            assert sorted(drawn[:12]) == list(range(12)) and drawn[:12] != drawn[12:]
        groups = groups_of(gen.batch(0).rollouts)  # the generated batch holds those rows' prompts
        prompts = {members[0].prompt[-1]["content"] for members in groups.values()}
        assert prompts == {f"Say something ({row})." for row in drawn[:4]}
    finally:
        gen.close()
