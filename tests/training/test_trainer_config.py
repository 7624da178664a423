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
