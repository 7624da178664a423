"""Continuous generation through the trainer (one process, the embedded engine serving continuously): a run trains batches of whole
finished groups with their staleness logged, a checkpoint keeps the finished groups not yet trained and the
positions in flight, and the resumed run trains every position of the uninterrupted run exactly once."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.live.toy_env import load_environment as load_toy
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.rollout import group_by_id, read_rollouts
from verifiers_rl.inference.embedded.engine import EmbeddedEngine
from verifiers_rl.rollouts.continuous import ContinuousGenerator, position_of
from verifiers_rl.training.run_state import load_run_state
from verifiers_rl.training.trainer import RLTrainer

STEPS, PROMPTS, GENERATIONS = 4, 2, 4


def train(model_dir, out, rollouts, resume=None):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = RLConfig(output_dir=str(out), use_cpu=True, report_to="none", save_strategy="steps", save_steps=2,
                    max_steps=STEPS, rollouts_per_step=PROMPTS * GENERATIONS, num_generations=GENERATIONS,
                    max_seq_len=64, max_off_policy_steps=1, groups_in_flight=3, logging_steps=1,
                    gradient_checkpointing=False, disable_tqdm=True, save_rollouts_path=str(rollouts),
                    print_samples_every=0, weight_sync_probe_tokens=0)
    # The engine serves continuously too (--continuous_batching_rows): loads land between its decode steps.
    engine = EmbeddedEngine(model_dir, tokenizer, continuous_rows=6)
    trainer = RLTrainer(model_dir, args, processing_class=tokenizer, environment=load_toy(tokenizer, num_examples=8),
                        engine=engine)
    assert isinstance(trainer.generator, ContinuousGenerator)
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        engine.close()
    return [entry for entry in trainer.state.log_history if "groups_stale_dropped" in entry]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("continuous")
    logged = train(tiny_model_dir, work / "out", work / "rollouts.jsonl")
    return work, logged


def batches(path) -> list[list]:
    rollouts = read_rollouts(path)
    size = PROMPTS * GENERATIONS
    return [rollouts[i:i + size] for i in range(0, len(rollouts), size)]


def test_a_continuous_run_trains_batches_of_whole_finished_groups(uninterrupted):
    work, logged = uninterrupted
    assert len(logged) == STEPS
    trained = batches(work / "rollouts.jsonl")
    assert len(trained) == STEPS
    for index, batch in enumerate(trained):
        groups = group_by_id(batch)
        assert len(groups) == PROMPTS and all(len(members) == GENERATIONS for members in groups)  # whole groups
        assert all(str(members[0].group_id).startswith("p") for members in groups)
        # every token within the bound: sampled by version (index - k) or newer
        assert min(r.oldest_version() for r in batch) >= max(0, index - 1)
    for entry in logged:
        assert entry["staleness_max"] <= 1 and 0 <= entry["staleness/token_mean"] <= 1
        assert entry["staleness/token_fraction_0"] + entry["staleness/token_fraction_1"] == pytest.approx(1.0)
    positions = sorted(position_of(members[0].group_id)[0] for batch in trained for members in group_by_id(batch))
    assert positions == list(range(STEPS * PROMPTS))


def test_a_resumed_continuous_run_trains_each_position_once(uninterrupted, tiny_model_dir):
    work, _ = uninterrupted
    checkpoint = work / "out" / "checkpoint-2"
    saved = load_run_state(checkpoint)
    assert saved.next_batch == 2 and saved.generator is not None
    # the run had gone on past the checkpoint: groups finished and not trained, or positions in flight
    assert saved.pending_batches or saved.generator["in_flight"]
    resumed_file = work / "resumed.jsonl"
    logged = train(tiny_model_dir, work / "resumed", resumed_file, resume=str(checkpoint))
    assert [entry["step"] for entry in logged] == list(range(1, STEPS + 1))  # the checkpoint's history, then ours
    before = batches(work / "rollouts.jsonl")[:2]
    trained = before + batches(resumed_file)
    ids = [members[0].group_id for batch in trained for members in group_by_id(batch)]
    assert sorted(position_of(gid)[0] for gid in ids) == list(range(STEPS * PROMPTS))  # none lost, none twice


def test_continuous_batching_rows_beside_an_engine_built_without_them_is_refused_by_name(tiny_model_dir, tmp_path):
    # The trainer builds no engine when one is given: the flag would leave the given engine decoding batch by batch.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1, rollouts_per_step=8,
                    num_generations=4, max_seq_len=64, groups_in_flight=2, continuous_batching_rows=4)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer)  # continuous_rows 0: batch by batch
    try:
        with pytest.raises(ValueError, match=r"^--continuous_batching_rows 4 sets the running batch of the engine the "
                                             r"trainer builds; the engine given to RLTrainer \(engine=\) was built "
                                             r"with continuous_rows=0 .*EmbeddedEngine\(\.\.\., continuous_rows=4\)"):
            RLTrainer(tiny_model_dir, args, processing_class=tokenizer, environment=load_toy(tokenizer), engine=engine)
    finally:
        engine.close()
    built = EmbeddedEngine(tiny_model_dir, tokenizer, continuous_rows=4)  # built as the flag says: taken
    try:
        trainer = RLTrainer(tiny_model_dir, args, processing_class=tokenizer, environment=load_toy(tokenizer),
                            engine=built)
        assert trainer.engine is built
    finally:
        built.close()
