"""Batching rules (counts before splitting, truncation before counts, balanced ranks) and clear errors on bad input."""

import json

import pytest
import torch

from verifiers_rl.batching import (
    BatchingConfig,
    SequenceTooLongError,
    assign_to_ranks,
    compute_advantages,
    plan_batch,
)
from verifiers_rl.config import RLConfig
from verifiers_rl.generator import split_into_batches
from verifiers_rl.loss import importance_weights
from verifiers_rl.rollouts import Rollout, RolloutFormatError, read_rollouts, write_rollouts
from verifiers_rl.synthetic import random_rollouts

GOOD = {"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "completion_mask": [1, 0, 1],
        "completion_logprobs": [-0.1, -0.2, -0.3], "reward": 1.0, "group_id": "a"}


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_round_trip(tmp_path):
    rollouts = random_rollouts(2, 3, vocab_size=50)
    write_rollouts(tmp_path / "r.jsonl", rollouts)
    assert read_rollouts(tmp_path / "r.jsonl") == rollouts


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", r"r.jsonl:2: not valid JSON"),
        (json.dumps({**GOOD, "completion_mask": [1, 1]}), r"r.jsonl:2: `completion_mask` has 2 entries but `completion_ids` has 3"),
        (json.dumps({**GOOD, "completion_logprobs": [-0.1]}), r"r.jsonl:2: `completion_logprobs` has 1 entries"),
        (json.dumps({**GOOD, "completion_logprobs": [-0.1, 0.5, -1]}), r"log-probs <= 0"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "reward"}), r"r.jsonl:2: missing field\(s\) reward"),
        (json.dumps({**GOOD, "rewards": 1}), r"unknown field\(s\) rewards"),
        (json.dumps({**GOOD, "prompt_ids": []}), r"`prompt_ids` is empty"),
        (json.dumps({**GOOD, "completion_mask": [1, 2, 1]}), r"only 0 and 1"),
        (json.dumps({**GOOD, "reward": "high"}), r"`reward` must be a finite number"),
        (json.dumps([1, 2]), r"expected a JSON object"),
    ],
)
def test_malformed_rollout_lines_name_file_line_and_problem(tmp_path, line, message):
    path = write_lines(tmp_path / "r.jsonl", [json.dumps(GOOD), line])
    with pytest.raises(RolloutFormatError, match=message):
        read_rollouts(path)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(RolloutFormatError, match="holds no rollouts"):
        read_rollouts(write_lines(tmp_path / "r.jsonl", ["", "  "]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rollouts(tmp_path / "missing.jsonl")


def test_unknown_loss_type_and_other_bad_knobs(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="Unknown loss_type 'dapo2'"):
        RLConfig(loss_type="dapo2", **common)
    with pytest.raises(ValueError, match="Unknown importance_correction"):
        RLConfig(importance_correction="sometimes", **common)
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        RLConfig(micro_batching="packed", max_seq_len=512, max_tokens_per_microbatch=100, **common)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0.0"):
        RLConfig(temperature=0.0, **common)
    # Choices are Literal types (validate and the command line read the same ones), numbers follow config.RANGES.
    with pytest.raises(ValueError, match="Unknown filter_groups 'all'; expected one of none, zero_variance"):
        RLConfig(filter_groups="all", **common)
    with pytest.raises(ValueError, match="weight_sync_probe_tokens must be 0 or >= 2, got 1"):
        RLConfig(weight_sync_probe_tokens=1, **common)
    with pytest.raises(ValueError, match="max_refill_batches must be >= 0, got -1"):
        RLConfig(max_refill_batches=-1, **common)
    from transformers import HfArgumentParser

    choices = {a.dest: a.choices for a in HfArgumentParser(RLConfig)._actions}
    assert choices["filter_groups"] == ("none", "zero_variance")
    assert choices["micro_batching"] == ("padded", "packed", "auto")
    # The other ranks wait for a batch inside a collective that gives up at ddp_timeout.
    with pytest.raises(ValueError, match=r"ddp_timeout \(600 s\) must exceed generation_timeout_s \(900 s\)"):
        RLConfig(ddp_timeout=600, generation_timeout_s=900, **common)


def test_config_carries_checkpointing_over_without_a_deprecation_warning(tmp_path):
    import warnings

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5 flags TRL's gradient_checkpointing default
        default = RLConfig(**common)
        off = RLConfig(gradient_checkpointing=False, **common)
        new_name = RLConfig(activation_checkpointing=False, **common)
    assert default.activation_checkpointing is True and default.gradient_checkpointing is True  # TRL's default
    assert off.activation_checkpointing is False and off.gradient_checkpointing is False
    assert new_name.activation_checkpointing is False and new_name.gradient_checkpointing is False


def overlong_rollouts():
    return [
        Rollout([1, 2, 3], [4, 5, 6, 7, 8, 9], [1, 1, 1, 1, 1, 1], 1.0, "g", [-1.0] * 6),
        Rollout([1, 2, 3], [4, 5], [1, 1], 0.0, "g", [-1.0] * 2),
    ]


def test_too_long_sequence_is_refused_by_default():
    with pytest.raises(SequenceTooLongError, match=r"9 tokens \(prompt 3\), more than max_seq_len=6.*--overlong truncate"):
        plan_batch(overlong_rollouts(), BatchingConfig(max_seq_len=6))


def test_truncation_happens_before_counts():
    (rank_batch,) = plan_batch(overlong_rollouts(), BatchingConfig(max_seq_len=6, overlong="truncate", mode="padded", rows_per_micro_batch=2))
    # 3 of the first completion's 6 tokens survive, plus 2 of the second.
    assert rank_batch.counts.loss_tokens == 5
    assert rank_batch.micro_batches[0].input_ids.shape[1] == 6
    assert rank_batch.stats.truncated_fraction == 0.5
    # mask_truncated_completions drops the truncated one from the counts entirely.
    (masked,) = plan_batch(overlong_rollouts(), BatchingConfig(max_seq_len=6, overlong="truncate", mask_truncated_completions=True))
    assert masked.counts.loss_tokens == 2 and masked.counts.valid_sequences == 1
    with pytest.raises(SequenceTooLongError, match="prompt 3"):
        plan_batch(overlong_rollouts(), BatchingConfig(max_seq_len=3, overlong="truncate"))


def test_counts_are_global_and_identical_on_every_rank():
    rollouts = random_rollouts(6, 4, vocab_size=50, seed=9, fully_masked_fraction=0.25)
    rank_batches = plan_batch(rollouts, BatchingConfig(world_size=3, mode="padded", rows_per_micro_batch=2, max_seq_len=64))
    tokens = sum(sum(m for m in r.completion_mask) for r in rollouts)
    valid = sum(1 for r in rollouts if any(r.completion_mask))
    for rank_batch in rank_batches:
        assert rank_batch.counts.loss_tokens == tokens
        assert rank_batch.counts.valid_sequences == valid
        assert rank_batch.counts.horizon == 64
    seen = sorted(p for rb in rank_batches for mb in rb.micro_batches for p in mb.batch_positions)
    assert seen == list(range(len(rollouts))), "every rollout lands on exactly one rank, none dropped"


def test_ranks_are_balanced_by_tokens():
    lengths = [100, 90, 10, 10, 10, 10, 10, 10, 10, 10, 5, 5]
    ranks = assign_to_ranks(lengths, 2)
    loads = [sum(lengths[i] for i in rank) for rank in ranks]
    assert abs(loads[0] - loads[1]) <= 10
    assert sorted(i for rank in ranks for i in rank) == list(range(len(lengths)))


def test_packed_rows_respect_the_budget_and_waste_nothing():
    rollouts = random_rollouts(8, 4, vocab_size=50, seed=4, completion_len=(1, 60))
    (rank_batch,) = plan_batch(rollouts, BatchingConfig(mode="packed", max_tokens_per_microbatch=128, max_seq_len=80))
    for mb in rank_batch.micro_batches:
        assert mb.input_ids.shape == (1, mb.real_tokens) and mb.real_tokens <= 128
        starts = (mb.position_ids[0] == 0).nonzero().flatten().tolist()
        assert len(starts) == mb.num_sequences  # positions restart at every sequence


def test_advantages_per_group():
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0]
    groups = ["a", "a", "b", "b", "c"]
    group = compute_advantages(rewards, groups, "group")
    assert group[0] == pytest.approx(0.5 / (torch.tensor([1.0, 0.0]).std().item() + 1e-4))
    assert group[2] == group[3] == 0.0 and group[4] == 0.0
    none = compute_advantages(rewards, groups, "none")
    assert none == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0])
    batch = compute_advantages(rewards, groups, "batch")
    assert batch[0] == pytest.approx(0.5 / (torch.tensor(rewards).std().item() + 1e-4))
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages(rewards, groups, "median")


def test_batches_hold_whole_groups():
    rollouts = random_rollouts(5, 4, vocab_size=50)
    batches = split_into_batches(rollouts, 8)
    assert [len(b) for b in batches] == [8, 8, 4]  # the smaller last batch is kept
    with pytest.raises(RolloutFormatError, match="must be a sum of whole groups"):
        split_into_batches(rollouts, 6)


def test_sequence_level_correction_uses_the_mean_not_the_sum():
    """A long completion whose every token differs by 0.02 nats keeps weight exp(0.02), not exp(0.02 * 200)."""
    proximal = torch.full((1, 201), -1.0)
    sampler = proximal - 0.02
    mask = torch.ones(1, 201)
    mask[0, 0] = 0
    seq_index = torch.zeros(1, 201, dtype=torch.long)
    weight, rho = importance_weights(proximal, sampler, mask, seq_index, "sequence_mask", cap=2.0)
    assert torch.allclose(weight[0, 1:], torch.tensor(0.02).exp())
    truncated, _ = importance_weights(proximal, proximal - 3.0, mask, seq_index, "token_truncate", cap=2.0)
    assert torch.allclose(truncated[0, 1:], torch.tensor(2.0))
    masked, _ = importance_weights(proximal, proximal - 3.0, mask, seq_index, "token_mask", cap=2.0)
    assert torch.all(masked[0, 1:] == 0)
