"""Continuous generation (``--groups_in_flight``, rollouts/continuous.py): batches of whole finished groups drawn and
seeded as batch at a time, a long group sliding to the batch of its deadline (never dropped), a group older than the
staleness bound all the same (a resumed one) dropped, counted and generated again under a new seed, and a checkpoint's finished groups and positions in flight resumed so that every position is trained once."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from verifiers_rl.envs import Rubric, SingleTurnEnv
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.rollouts.continuous import ContinuousGenerator, position_of
from verifiers_rl.rollouts.generator import AsyncGenerator, GenerationTimeout
from verifiers_rl.rollouts.groups import GenerationError

P, G = 2, 4  # prompts per batch, rollouts per group


def length_reward(completion) -> float:
    return float(len(completion[-1]["content"]))


class GatedEnv(SingleTurnEnv):
    """Row 0's rollouts, once sampled, wait until the gate opens (a slow tool or judge after the model's turn, so
    their tokens keep the version that sampled them); the rest finish at once."""

    gate_open = False

    async def generate(self, sampler, prompt, prompt_ids, state):
        trajectory = await super().generate(sampler, prompt, prompt_ids, state)
        deadline = time.monotonic() + 60
        while state["info"]["row"] == 0 and not self.gate_open:
            assert time.monotonic() < deadline, "the gate was never opened"
            await asyncio.sleep(0.01)
        return trajectory


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=5))
    return tokenizer, engine


def environment(tokenizer, gated: bool = False) -> SingleTurnEnv:
    rows = [{"question": f"Say something ({i}).", "info": {"row": i}} for i in range(12)]
    kind = GatedEnv if gated else SingleTurnEnv
    return kind(rows, Rubric([length_reward]), tokenizer, max_new_tokens=5, max_seq_len=64, name="gated")


def continuous(env, engine, total: int, in_flight: int = 3) -> ContinuousGenerator:
    engine.policy_version = 0
    generator = ContinuousGenerator(env, engine, rollouts_per_step=P * G, num_generations=G,
                                    groups_in_flight=in_flight, max_off_policy_steps=1, seed=3, timeout_s=60,
                                    shuffle=False)
    generator.total_batches = total
    return generator


def step(generator, index: int):
    """Batch ``index``, then the weight load after its optimizer step (the version; the weights stay the same)."""
    batch = generator.batch(index)
    generator.engine.policy_version = index + 1
    generator.weights_updated()
    return batch


def groups(rollouts) -> dict:
    found: dict = {}
    for rollout in rollouts:
        found.setdefault(rollout.group_id, []).append(rollout)
    return found


def wait_for_pending(generator, group_id: str) -> list:
    deadline = time.monotonic() + 60
    while True:
        waiting = [r for rollouts in generator.pending().values() for r in rollouts if r.group_id == group_id]
        if waiting:
            return waiting
        assert time.monotonic() < deadline, f"{group_id} never finished"
        time.sleep(0.02)


def test_batches_are_whole_finished_groups_drawn_and_seeded_as_batch_at_a_time(parts):
    tokenizer, engine = parts
    generator = continuous(environment(tokenizer), engine, total=4)
    try:
        batches = [step(generator, index) for index in range(4)]
    finally:
        generator.close()
    reference = AsyncGenerator(environment(tokenizer), engine, rollouts_per_step=P * G, num_generations=G,
                               max_off_policy_steps=0, seed=3, shuffle=False)
    engine.policy_version = 0
    expected = {position_of(gid)[0]: sorted(r.completion_ids for r in members)
                for index in range(4) for gid, members in groups(reference.batch(index).rollouts).items()}
    trained = {}
    for index, batch in enumerate(batches):
        found = groups(batch.rollouts)
        assert len(found) == P and all(len(members) == G for members in found.values())  # whole groups
        for gid, members in found.items():
            assert members[0].completion_versions is not None
            assert min(r.oldest_version() for r in members) >= generator.required_version(index)
            trained[position_of(gid)[0]] = sorted(r.completion_ids for r in members)
        assert batch.stats["groups_stale_dropped"] == 0 and batch.stats["staleness/token_max"] <= 1
        fractions = [batch.stats[f"staleness/token_fraction_{age}"] for age in (0, 1)]
        assert sum(fractions) == pytest.approx(1.0)
    # Positions 0..7 once each, and each group's tokens are what batch-at-a-time sampled at that position.
    assert trained == expected


def test_a_long_group_slides_to_its_deadline_and_holds_that_batch_never_dropped(parts):
    tokenizer, engine = parts
    env = environment(tokenizer, gated=True)
    generator = continuous(env, engine, total=4)
    try:
        first = step(generator, 0)  # position 0 (row 0) waits: started at version 0, it is due by batch 1 (k = 1)
        assert "p0" not in groups(first.rollouts)
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(generator.batch, 1)
            deadline = time.monotonic() + 60
            while sum(len(r) for r in generator.pending().values()) < P * G:  # a batch's worth finished meanwhile
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.5)
            assert not second.done()  # batch 1 waits for the group due by it, not for the first finished groups
            env.gate_open = True
            second = second.result(timeout=60)
        engine.policy_version = 2
        generator.weights_updated()
        later = [step(generator, index) for index in (2, 3)]
    finally:
        generator.close()
    batches = [first, second, *later]
    assert "p0" in groups(second.rollouts) and {r.oldest_version() for r in groups(second.rollouts)["p0"]} == {0}
    trained = [gid for batch in batches for gid in groups(batch.rollouts)]
    assert sorted(position_of(gid)[0] for gid in trained) == list(range(8)) and all("retry" not in gid for gid in trained)
    for index, batch in enumerate(batches):
        assert batch.stats["groups_stale_dropped"] == 0
        assert min(r.oldest_version() for r in batch.rollouts) >= generator.required_version(index)


def test_a_timeout_says_the_batch_waits_for_a_group_due_by_it_not_for_finished_groups(parts):
    tokenizer, engine = parts
    generator = continuous(environment(tokenizer, gated=True), engine, total=4)  # the gate stays shut
    try:
        step(generator, 0)
        generator.timeout_s = 1.0
        for position in (3, 4, 5):  # more than a batch's worth finished: position 0 alone holds batch 1
            wait_for_pending(generator, f"p{position}")
        with pytest.raises(GenerationTimeout, match=r"No rollouts for batch 1 within 1 s \(3 groups finished \(it "
                                                    r"takes 2\), but 1 of the 1 in flight are due by this batch, "
                                                    r"which waits for them; .*--generation_timeout_s"):
            generator.batch(1)
    finally:
        generator.close()


def test_a_group_older_than_its_batch_allows_is_dropped_counted_and_generated_again(parts):
    tokenizer, engine = parts
    reference = AsyncGenerator(environment(tokenizer), engine, rollouts_per_step=P * G, num_generations=G,
                               max_off_policy_steps=0, seed=3, shuffle=False)
    engine.policy_version = 0
    old = reference.batch(0).rollouts  # positions 0 and 1, sampled by version 0
    generator = continuous(environment(tokenizer), engine, total=5)
    generator.restore(3, {3: old})  # resumed at batch 3: its bound is version 2
    engine.policy_version = 3
    try:
        later = [step(generator, index) for index in (3, 4)]
    finally:
        generator.close()
    assert later[0].stats["groups_stale_dropped"] == 2
    trained = groups([r for batch in later for r in batch.rollouts])
    assert sorted(trained) == ["p0-retry1", "p1-retry1", "p8", "p9"]
    before = groups(old)
    for position in (0, 1):  # generated again under a new seed: other tokens
        (was,) = [gid for gid in before if position_of(gid)[0] == position]
        again = trained[f"p{position}-retry1"]
        assert sorted(r.completion_ids for r in again) != sorted(r.completion_ids for r in before[was])
    for index, batch in zip((3, 4), later):
        assert min(r.oldest_version() for r in batch.rollouts) >= generator.required_version(index)


def test_a_stale_refill_group_of_a_batch_at_a_time_checkpoint_is_dropped_and_a_new_position_takes_its_place(parts):
    # A batch-at-a-time checkpoint's pending batch may hold a dynamic-sampling refill group (b<i>-r<round>-<j>), which
    # stands for no position; resumed under continuous generation with a smaller k, it is stale like the others.
    tokenizer, engine = parts
    reference = AsyncGenerator(environment(tokenizer), engine, rollouts_per_step=P * G, num_generations=G,
                               max_off_policy_steps=0, seed=3, shuffle=False)
    engine.policy_version = 0
    old = reference.batch(0).rollouts  # b0-p0, b0-p1, sampled by version 0
    for rollout in old[G:]:
        rollout.group_id = "b0-r1-0"
    generator = continuous(environment(tokenizer), engine, total=5)
    generator.restore(3, {3: old})  # resumed at batch 3: its bound is version 2; positions go on at 8
    engine.policy_version = 3
    try:
        batch, after = step(generator, 3), step(generator, 4)
    finally:
        generator.close()
    assert batch.stats["groups_stale_dropped"] == 2
    # Which groups finish first is the engine's timing: over the two batches, the position again and new ones.
    trained = [*groups(batch.rollouts), *groups(after.rollouts)]
    assert "p0-retry1" in trained and "p8" in trained and len(set(trained)) == len(trained) == 4, trained
    assert not any(gid.startswith("b0-") for gid in trained), trained  # neither stale group trained


def test_a_checkpoint_keeps_finished_groups_and_positions_in_flight_and_a_resume_trains_each_once(parts):
    tokenizer, engine = parts
    env = environment(tokenizer, gated=True)  # row 0 never finishes before the checkpoint
    first = continuous(env, engine, total=4)
    try:
        before = [step(first, 0)]
        deadline = time.monotonic() + 60
        while not first.pending():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        pending, curriculum, positions = first.checkpoint_state()
    finally:
        first.close()
    assert curriculum is None and [0, 0] in positions["in_flight"]  # position 0, first generation
    saved = [r.group_id for rollouts in pending.values() for r in rollouts]

    resumed = continuous(environment(tokenizer), engine, total=4)
    resumed.restore(1, pending, None, positions=positions)
    engine.policy_version = 1  # the resumed run loads the checkpoint's weights first
    try:
        after = [step(resumed, index) for index in range(1, 4)]
    finally:
        resumed.close()
    trained = [gid for batch in before + after for gid in groups(batch.rollouts)]
    assert sorted(position_of(gid)[0] for gid in trained) == list(range(8))  # nothing lost, nothing twice
    assert "p0" in groups([r for batch in after for r in batch.rollouts])  # regenerated under its own seed
    assert set(saved) <= set(trained) and not any(b.stats["groups_stale_dropped"] for b in after)
    # A checkpoint of batch-at-a-time generation continues after its pending batches.
    plain = continuous(environment(tokenizer), engine, total=4)
    plain.restore(2, {2: before[0].rollouts})
    assert plain.checkpoint_state()[2] == {"next_position": 6, "in_flight": [], "counts": {}, "dropped_positions": []}


class FailsThenWaitsEnv(SingleTurnEnv):
    """Row 0's rollouts raise at once; row 1's wait until the gate opens, then raise where ``row_one_fails``."""

    gate_open = False
    row_one_fails = False

    async def generate(self, sampler, prompt, prompt_ids, state):
        if state["info"]["row"] == 0:
            raise ConnectionError("the sandbox of row 0 is gone")
        while state["info"]["row"] == 1 and not self.gate_open:
            await asyncio.sleep(0.01)
        if state["info"]["row"] == 1 and self.row_one_fails:
            raise ConnectionError("the sandbox of row 1 is gone")
        return await super().generate(sampler, prompt, prompt_ids, state)


@pytest.mark.parametrize("row_one_fails", [False, True])
def test_drops_before_a_checkpoint_count_in_the_resumed_runs_next_batch_and_its_stop(parts, row_one_fails):
    """Position 0 is dropped on errors before the checkpoint, position 1 still in flight. The resumed run's first
    batch logged groups_dropped_on_error 0 (the count since the last batch was not kept) and, where position 1 fails
    too, trained on where the uninterrupted run stops (every group of positions 0-1 dropped)."""
    tokenizer, engine = parts
    rows = [{"question": f"Say something ({i}).", "info": {"row": i}} for i in range(12)]

    def generator(gate_open):
        env = FailsThenWaitsEnv(rows, Rubric([length_reward]), tokenizer, max_new_tokens=5, max_seq_len=64, name="x")
        env.gate_open, env.row_one_fails = gate_open, row_one_fails
        made = continuous(env, engine, total=2)
        made.max_rollout_retries = made.groups.max_rollout_retries = 0
        made.max_failed_rollouts_fraction = 0.5
        return made

    first = generator(gate_open=False)
    try:
        first.start()
        deadline = time.monotonic() + 60
        while (positions := first.checkpoint_state()[2])["next_position"] < 2 or [0, 0] in positions["in_flight"]:
            assert time.monotonic() < deadline, "position 0 was never dropped"
            time.sleep(0.02)
        pending, _, positions = first.checkpoint_state()
    finally:
        first.close()
    assert not pending and [1, 0] in positions["in_flight"]  # position 0 dropped, position 1 waiting
    resumed = generator(gate_open=True)
    resumed.restore(0, pending, None, positions=positions)
    try:
        if row_one_fails:
            with pytest.raises(GenerationError, match=r"^Batch 0: 2 groups failed .*every group of positions 0-1"):
                resumed.batch(0)
        else:
            batch = resumed.batch(0)
            assert "p0" not in groups(batch.rollouts) and "p1" in groups(batch.rollouts)
            assert batch.stats["groups_dropped_on_error"] == 1 and batch.stats["rollouts_failed"] == 1
    finally:
        resumed.close()


class BrokenRowEnv(SingleTurnEnv):
    """Row 1's rollouts always raise (its sandbox is gone)."""

    async def generate(self, sampler, prompt, prompt_ids, state):
        if state["info"]["row"] == 1:
            raise ConnectionError("the sandbox of row 1 is gone")
        return await super().generate(sampler, prompt, prompt_ids, state)


def test_a_group_that_keeps_failing_is_dropped_and_counted_or_stops_the_run_by_flag(parts):
    tokenizer, engine = parts
    rows = [{"question": f"Say something ({i}).", "info": {"row": i}} for i in range(12)]

    def generator(fraction):
        env = BrokenRowEnv(rows, Rubric([length_reward]), tokenizer, max_new_tokens=5, max_seq_len=64, name="broken")
        made = continuous(env, engine, total=2)
        made.max_rollout_retries = made.groups.max_rollout_retries = 0
        made.max_failed_rollouts_fraction = fraction
        return made

    tolerant = generator(0.5)
    try:
        batch = tolerant.batch(0)  # position 1 (row 1) dropped, the next position drawn in its place
    finally:
        tolerant.close()
    assert batch.stats["groups_dropped_on_error"] == 1 and batch.stats["rollouts_failed"] == 1
    found = groups(batch.rollouts)
    assert len(found) == 2 and "p1" not in found and set(found) <= {"p0", "p2", "p3"}
    strict = generator(0.0)
    try:
        with pytest.raises(GenerationError, match=r"Batch 0: 1 groups failed 1 time\(s\) each \(--max_rollout_retries "
                                                  r"0\).*--max_failed_rollouts_fraction 0 .*row 1 is gone"):
            strict.batch(0)
    finally:
        strict.close()


class OddRowsBrokenEnv(SingleTurnEnv):
    """The odd rows' rollouts raise at once (their sandboxes are gone); the even rows' take a while, then sample and
    finish."""

    async def generate(self, sampler, prompt, prompt_ids, state):
        if state["info"]["row"] % 2:
            raise ConnectionError(f"the sandbox of row {state['info']['row']} is gone")
        await asyncio.sleep(0.5)  # the failures all come while the good groups are in flight
        return await super().generate(sampler, prompt, prompt_ids, state)


def test_groups_dropped_on_errors_stop_the_run_as_batch_at_a_time_does_whatever_the_fraction(parts):
    # --max_failed_rollouts_fraction 1 tolerates any share of failures; batch at a time still stops when every group
    # of a batch is dropped, and so does continuous generation when every group of a batch's positions is: not when
    # as many groups failed at once as a batch takes while the others were still sampling.
    tokenizer, engine = parts

    def generator(rows, fraction=1.0):
        env = OddRowsBrokenEnv([{"question": f"Say something ({i}).", "info": {"row": r}} for i, r in enumerate(rows)],
                               Rubric([length_reward]), tokenizer, max_new_tokens=5, max_seq_len=64, name="broken")
        made = continuous(env, engine, total=2, in_flight=8)
        made.max_rollout_retries = made.groups.max_rollout_retries = 0
        made.max_failed_rollouts_fraction = fraction
        return made

    # Half of each batch's positions fail at once, and 0.5 allows half, as batch at a time does: 3 failed (positions
    # 1, 3, 5) while the good ones of two batches sampled, more than 0.5 of (2 + 3), which stopped it at batch 0.
    for fraction in (1.0, 0.5):
        flaky = generator(range(12), fraction)  # positions 1, 3, 5, ... fail at once
        try:
            batch = flaky.batch(0)
        finally:
            flaky.close()
        found = groups(batch.rollouts)  # two whole groups of even rows, the odd ones dropped
        assert len(found) == 2 and all(position_of(gid)[0] % 2 == 0 for gid in found)
        assert batch.stats["groups_dropped_on_error"] >= 1
    broken = generator([1] * 12)  # every position fails
    try:
        with pytest.raises(GenerationError, match=r"^Batch 0: \d+ groups failed 1 time\(s\) each \(--max_rollout_"
                                                  r"retries 0\), among them every group of positions 0-1 \(the 2 a "
                                                  r"batch draws together\): none of them is left, which stops the run "
                                                  r"whatever --max_failed_rollouts_fraction allows\. Last error: "
                                                  r".*row 1 is gone"):
            broken.batch(0)
    finally:
        broken.close()


@pytest.mark.parametrize("kind", ["batch at a time", "continuous"])
def test_a_dataset_smaller_than_a_batch_is_warned_of_as_both_generators_repeat_its_prompts(parts, kind, caplog):
    tokenizer, engine = parts
    rows = [{"question": f"Say {i}."} for i in range(3)]
    small = SingleTurnEnv(rows, Rubric([length_reward]), tokenizer, max_new_tokens=5, max_seq_len=64, name="small")
    make = (lambda env, batch: AsyncGenerator(env, engine, rollouts_per_step=batch * G, num_generations=G)) \
        if kind == "batch at a time" else \
        (lambda env, batch: ContinuousGenerator(env, engine, rollouts_per_step=batch * G, num_generations=G,
                                                groups_in_flight=batch, max_off_policy_steps=1))
    with caplog.at_level("WARNING", logger="verifiers_rl.rollouts.generator"):
        make(small, 3)  # three prompts, three a batch: no repeats
        assert not caplog.records
        make(small, 4)
    assert [r.getMessage() for r in caplog.records] == [
        "The dataset of small has 3 prompts, fewer than the 4 a batch takes (--rollouts_per_step / --num_generations): "
        "every batch repeats prompts in several groups."]
