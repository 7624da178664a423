"""The trainer's parts in a real (one-process) live run: the step's wall time and its parts, the batch a rollout
source hands over, and the output layer patch that must leave TRL's own in place."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoTokenizer, TrainerCallback

from tests.live.toy_env import load_environment as load_toy
from verifiers_rl.training import segmented_attention  # noqa: E402
from verifiers_rl.config.rl_config import RLConfig  # noqa: E402
from verifiers_rl.inference.embedded.engine import EmbeddedEngine  # noqa: E402
from verifiers_rl.training.trainer import RLTrainer  # noqa: E402

LOAD_DELAY_S = 0.4
PARTS = ("between_steps_time", "wait_time", "train_time", "weight_sync_time")


class SlowLoadEngine(EmbeddedEngine):
    """An engine whose weight load takes LOAD_DELAY_S longer, like a remote server's: the step must include it."""

    def load_weights(self, named_tensors, version):
        time.sleep(LOAD_DELAY_S)
        return super().load_weights(named_tensors, version)


class StepEnds(TrainerCallback):
    """Added after every callback of the trainer: when each optimizer step (weight sync included) was over."""

    def __init__(self):
        self.ends: list[float] = []
        self.run_attention: list[bool] = []  # whether run-by-run attention was installed at each step's end

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        self.run_attention.append(segmented_attention.installed())


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = RLConfig(output_dir=str(tmp_path_factory.mktemp("parts")), use_cpu=True, report_to="none",
                    save_strategy="no", max_steps=4, rollouts_per_step=8, num_generations=4, max_seq_len=64,
                    max_off_policy_steps=1, logging_steps=1, weight_sync_probe_every=2, gradient_checkpointing=False,
                    disable_tqdm=True, cast_lm_head_to_fp32=True)
    trainer = RLTrainer(tiny_model_dir, args, processing_class=tokenizer, environment=load_toy(tokenizer),
                        engine=SlowLoadEngine(tiny_model_dir, tokenizer))
    ends = StepEnds()
    trainer.add_callback(ends)
    segmented_attention.install()  # as an earlier forward with runs would have left it
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "step_time" in entry]
    return trainer, logged, ends


def test_step_time_is_the_wall_time_between_optimizer_steps_and_its_parts_add_up(timed_run):
    _, logged, steps = timed_run
    ends = steps.ends
    assert len(logged) == 4
    for entry in logged:
        # Each part is timed on its own (train: training_step to the optimizer step); what none covers (the
        # scheduler, HF's bookkeeping) is logged apart, and is small: a part timed wrong or twice shows here.
        assert 0 <= entry["other_time"] < max(0.05, 0.1 * entry["step_time"]), entry
        assert sum(entry[name] for name in PARTS) + entry["other_time"] == pytest.approx(entry["step_time"], abs=1e-6)
        # The engine's load is part of the step (the old step_time ended before the weight sync).
        assert entry["weight_sync_time"] >= LOAD_DELAY_S
        assert entry["weight_sync_s"] >= LOAD_DELAY_S
        assert entry["weight_sync_time"] == pytest.approx(
            entry["weight_sync_wait_s"] + entry["weight_sync_s"] + entry["weight_sync_probe_s"], abs=0.01)
        assert entry["train_time"] > 0 and entry["wait_time"] >= 0
    for previous_end, end, entry in zip(ends, ends[1:], logged[1:]):
        # Measured from outside the trainer: the time between two step ends is the logged step time.
        assert entry["step_time"] == pytest.approx(end - previous_end, abs=0.05)


def test_run_by_run_attention_is_in_place_while_training_and_removed_after(timed_run):
    _, _, steps = timed_run
    assert steps.run_attention == [True] * 4  # nothing removes it mid-run
    assert not segmented_attention.installed()  # train() gave transformers its own sdpa back


def test_a_live_batch_reports_its_generation_time_and_staleness(timed_run):
    _, logged, _ = timed_run
    assert all(entry["generation_time"] > 0 for entry in logged)
    assert [entry["staleness_max"] for entry in logged] == [0, 1, 1, 1]  # k = 1: one step ahead after the first


def test_the_output_layer_patch_leaves_trls_fp32_head_in_place(timed_run):
    # cast_lm_head_to_fp32 puts an instance `forward` on the output layer; the log-prob forward swaps in its own for
    # one call and must put TRL's back (deleting its own would delete TRL's).
    trainer, _, _ = timed_run
    head = trainer.model.get_output_embeddings()
    assert "forward" in head.__dict__ and head.forward.__name__ == "cast_forward_to_fp32"
    assert head.forward(torch.zeros(1, head.in_features)).dtype == torch.float32


def test_a_step_that_trains_no_token_logs_no_token_metric(tiny_model_dir, tmp_path):
    """A batch whose every completion is masked (all truncated, --mask_truncated_completions) logged is_ratio 0.0,
    entropy 0.0 and kl 0.0, means over no token: a false 0 in a user's plot. Those keys are now absent from that
    step's entry (as clip_ratio/low_min already was), and the next step, which trains tokens, has them."""
    from verifiers_rl.core.rollout import write_rollouts
    from verifiers_rl.rollouts.synthetic import random_rollouts

    rollouts = random_rollouts(4, 4, vocab_size=390, seed=1)  # 2 batches of 8
    for rollout in rollouts[:8]:
        rollout.truncated = True
    write_rollouts(tmp_path / "r.jsonl", rollouts)
    args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no",
                    rollouts_path=str(tmp_path / "r.jsonl"), rollouts_per_step=8, max_steps=2, max_seq_len=64,
                    mask_truncated_completions=True, beta=0.1, logging_steps=1,
                    disable_tqdm=True, print_samples_every=0, gradient_checkpointing=False)
    trainer = RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    trainer.train()
    first, second = [entry for entry in trainer.state.log_history if "loss_tokens" in entry]
    token_metrics = {"entropy", "is_ratio", "is_weight", "is_clipped_fraction", "kl", "clip_ratio/region_mean"}
    assert first["loss_tokens"] == 0 and not token_metrics & set(first), first
    assert second["loss_tokens"] > 0 and token_metrics <= set(second) and second["entropy"] > 0, second
