"""RLTrainer keeps what it derives (the run's length, what TRL's constructor must see) in its own ``args``, a view of
the user's config (``RLConfig.trl_view``): the config the user built is left as they built it."""

from __future__ import annotations

import dataclasses

import pytest
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts
from verifiers_rl.training.trainer import RLTrainer


def test_the_trainer_leaves_the_users_config_as_built_and_counts_epochs_as_hf(tiny_model_dir, tmp_path):
    write_rollouts(tmp_path / "r.jsonl", random_rollouts(6, 4, vocab_size=390, seed=1))  # 3 batches of 8
    args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no",
                    rollouts_path=str(tmp_path / "r.jsonl"), rollouts_per_step=8, per_device_train_batch_size=2,
                    gradient_accumulation_steps=4, num_train_epochs=2.2, num_iterations=2, max_seq_len=64)
    before = dataclasses.asdict(args)
    trainer = RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    assert dataclasses.asdict(args) == before
    assert (args.max_steps, args.gradient_accumulation_steps, args.generation_batch_size) == (-1, 4, None)
    # HF's own count for an epoch of 3 batches x 2 iterations, at one HF step per optimizer step.
    epoch = DataLoader(range(3 * 2))
    *_, hf_max_steps = trainer.set_initial_training_values(args.trl_view(), epoch)
    assert trainer.args.max_steps == hf_max_steps == 14  # ceil(2.2 * 6)
    assert len(trainer.get_train_dataloader()) == 6  # an epoch: HF's epochs are the data's
    assert (trainer.args.gradient_accumulation_steps, trainer.args.generation_batch_size) == (1, 8)


def test_epochs_are_the_sources_so_an_epoch_strategy_acts_at_each_epochs_end(tiny_model_dir, tmp_path):
    # HF saves (and evaluates) at the end of each of its epochs: an epoch of the whole run acted only at its end.
    write_rollouts(tmp_path / "r.jsonl", random_rollouts(6, 4, vocab_size=390, seed=1))  # 3 batches of 8
    args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="epoch",
                    rollouts_path=str(tmp_path / "r.jsonl"), rollouts_per_step=8, num_train_epochs=2, max_seq_len=64,
                    logging_steps=1, print_samples_every=0, disable_tqdm=True)
    trainer = RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert [(log["step"], log["epoch"]) for log in trainer.state.log_history if "loss" in log][2::3] == [(3, 1.0),
                                                                                                          (6, 2.0)]


def test_a_run_of_no_step_is_refused_by_name(tiny_model_dir, tmp_path):
    write_rollouts(tmp_path / "r.jsonl", random_rollouts(2, 4, vocab_size=390, seed=1))
    args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no",
                    rollouts_path=str(tmp_path / "r.jsonl"), rollouts_per_step=8, num_train_epochs=0, max_seq_len=64)
    with pytest.raises(ValueError, match=r"num_train_epochs=0.* trains no step: set --max_steps N"):
        RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))


def test_an_engine_given_with_other_sampling_settings_than_the_config_is_refused_naming_both(tiny_model_dir, tmp_path):
    """An engine given to RLTrainer sampled with its own SamplingConfig while the trainer computed its log-probs at
    the config's temperature: a contradiction was trained unsaid (every importance ratio off). Refused, both values
    named; an engine built as the config says is taken."""
    from tests.live.toy_env import load_environment as load_toy
    from verifiers_rl.inference import EmbeddedEngine, SamplingConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    def config(**sampling):
        return RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", max_steps=1,
                        rollouts_per_step=8, num_generations=4, max_seq_len=64, top_k=5, **sampling)

    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=0.7, top_k=5, max_new_tokens=4))
    try:
        with pytest.raises(ValueError, match=r"^The engine given to RLTrainer \(engine=\) samples otherwise than the "
                                             r"run's config says: --temperature 1.0 but the engine's 0.7\. "):
            RLTrainer(tiny_model_dir, config(), processing_class=tokenizer, environment=load_toy(tokenizer),
                      engine=engine)
        trainer = RLTrainer(tiny_model_dir, config(temperature=0.7), processing_class=tokenizer,
                            environment=load_toy(tokenizer), engine=engine)
        assert trainer.engine is engine
    finally:
        engine.close()
