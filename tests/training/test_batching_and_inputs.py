"""Batching rules (counts before splitting, truncation before counts, balanced ranks) and clear errors on bad input."""

import json
from dataclasses import replace

import pytest
import torch

from verifiers_rl.training import batching
from verifiers_rl.training.batching import (
    MICRO_BATCH_OVERHEAD_TOKENS,
    BatchingConfig,
    SequenceTooLongError,
    assign_to_ranks,
    cheapest_layout,
    compute_advantages,
    layout,
    plan_batch,
    prepare_sequences,
)
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.rollouts.generator import split_into_batches
from verifiers_rl.training.loss import importance_weights
from verifiers_rl.training.prefix import ROOT, best_part_size, common_prefix_length
from verifiers_rl.core.rollout import Rollout, RolloutFormatError, read_rollouts, write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts

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
    # Choices are Literal types (validate and the command line read the same ones), numbers follow their field's range.
    with pytest.raises(ValueError, match="Unknown filter_groups 'all'; expected one of none, zero_variance"):
        RLConfig(filter_groups="all", **common)
    with pytest.raises(ValueError, match="weight_sync_probe_tokens must be 0 or >= 2, got 1"):
        RLConfig(weight_sync_probe_tokens=1, **common)
    with pytest.raises(ValueError, match="max_refill_batches must be >= 0, got -1"):
        RLConfig(max_refill_batches=-1, **common)
    with pytest.raises(ValueError, match="max_completion_length must be >= 1, got 0"):
        RLConfig(max_completion_length=0, **common)
    # A group of one has advantage 0 (its reward minus its own mean): nothing to learn from, and no division by 0.
    for groups in (1, 0):
        with pytest.raises(ValueError, match=f"num_generations must be >= 2 when generating .*, got {groups}"):
            RLConfig(num_generations=groups, rollouts_per_step=4, **common)
    assert RLConfig(num_generations=1, rollouts_path="r.jsonl", **common).num_generations == 1  # replay: groups come from the file
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


def test_a_replays_over_long_rollout_is_refused_before_training_naming_its_place(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from verifiers_rl.training.trainer import RLTrainer

    rollouts = random_rollouts(4, 4, vocab_size=390, seed=3)
    prompt = len(rollouts[5].prompt_ids)
    rollouts[5].completion_ids = rollouts[5].completion_ids + [7] * 100  # the second batch's (4 a step)
    rollouts[5].completion_mask = rollouts[5].completion_mask + [1] * 100
    rollouts[5].completion_logprobs = rollouts[5].completion_logprobs + [-1.0] * 100
    path = tmp_path / "overlong.jsonl"
    write_rollouts(path, rollouts)

    def trainer(**settings) -> RLTrainer:
        settings = {"max_seq_len": 64, **settings}
        args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", rollouts_path=str(path),
                        rollouts_per_step=4, max_steps=2, save_strategy="no", **settings)
        return RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))

    total = prompt + len(rollouts[5].completion_ids)
    with pytest.raises(SequenceTooLongError, match=rf"^{path}: rollout 6 \(group '{rollouts[5].group_id}'\) has "
                                                   rf"{total} tokens \(prompt {prompt}\), more than max_seq_len=64\. "
                                                   r"Raise --max_seq_len, or pass --overlong truncate"):
        trainer()
    assert trainer(overlong="truncate").state.global_step == 0  # cut when its batch is trained: accepted
    with pytest.raises(SequenceTooLongError, match=r"its prompt alone fills it"):
        trainer(overlong="truncate", max_seq_len=prompt)


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
    # The choice is checked once, by the config (batching trusts a BatchingConfig built from one).
    with pytest.raises(ValueError, match="Unknown scale_rewards 'median'"):
        RLConfig(output_dir="/tmp/unused", report_to="none", scale_rewards="median")


def test_a_multi_branch_episode_counts_once_in_its_groups_baseline_and_each_branch_is_a_sequence():
    # Group a: episode 0 of one branch (reward 1), episode 1 of three branches (reward 0, a v1 sub-agent's);
    # group b: two episodes of one branch. By hand, over EPISODES: a's mean 0.5 and std sqrt(0.5) (not the
    # branches' mean 0.25), the batch's std over the rewards 1, 0, 0.5, 1.5.
    def rollout(group, episode, reward):
        return Rollout([1, 2], [3, 4], [1, 1], reward, group, completion_logprobs=[-1.0, -1.0], episode_id=episode)

    rollouts = [rollout("a", 0, 1.0), rollout("a", 1, 0.0), rollout("a", 1, 0.0), rollout("a", 1, 0.0),
                rollout("b", None, 0.5), rollout("b", None, 1.5)]
    half = 0.5 / (0.5 ** 0.5 + 1e-4)
    by_mode = {"group": [half, -half, -half, -half, -half, half], "none": [0.5, -0.5, -0.5, -0.5, -0.5, 0.5]}
    batch_std = (1.25 / 3) ** 0.5 + 1e-4
    by_mode["batch"] = [0.5 / batch_std] + [-0.5 / batch_std] * 3 + [-0.5 / batch_std, 0.5 / batch_std]
    for mode, expected in by_mode.items():
        (rank_batch,) = plan_batch(rollouts, BatchingConfig(max_seq_len=8, rows_per_micro_batch=6, scale_rewards=mode))
        (mb,) = rank_batch.micro_batches
        got = [float(mb.advantages[row, 0]) for row in range(6)]
        order = mb.batch_positions
        assert [got[order.index(i)] for i in range(6)] == pytest.approx(expected, rel=1e-6), mode
        # Normalisation: every branch is a sequence in the global counts, as any rollout is.
        assert (rank_batch.counts.valid_sequences, rank_batch.counts.loss_tokens) == (6, 12)
    # An episode's branches carry its one reward.
    rollouts[2].reward = 1.0
    with pytest.raises(ValueError, match="branches of episode 1 of group 'a' but have different rewards"):
        plan_batch(rollouts, BatchingConfig(max_seq_len=8))


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


def parts_of(rank_batches):
    """(rank, micro-batch, batch positions of each shared-row segment) for every segment of every micro-batch."""
    found = []
    for rank, rank_batch in enumerate(rank_batches):
        for k, mb in enumerate(rank_batch.micro_batches):
            if mb.shared is None:
                found += [(rank, k, [p]) for p in mb.batch_positions]
                continue
            block = mb.shared.block.view(-1)
            block_of = [int(block[mb.shared.source[mb.seq_index == j][-1]]) for j in range(mb.num_sequences)]
            for segment in sorted(set(block_of)):
                found.append((rank, k, [mb.batch_positions[j] for j in range(mb.num_sequences) if block_of[j] == segment]))
    return found


def test_shared_prompts_keep_groups_together_within_the_limits():
    rollouts = random_rollouts(6, 4, vocab_size=50, seed=12, completion_len=(1, 30))
    groups = [r.group_id for r in rollouts]
    for config in [BatchingConfig(mode="padded", rows_per_micro_batch=4, max_seq_len=64, share_prompt_training="on"),
                   BatchingConfig(mode="padded", rows_per_micro_batch=3, max_seq_len=64, share_prompt_training="on"),
                   BatchingConfig(mode="packed", max_tokens_per_microbatch=64, max_seq_len=64, share_prompt_training="on"),
                   BatchingConfig(mode="packed", max_tokens_per_microbatch=512, max_seq_len=64, share_prompt_training="on",
                                  world_size=3)]:
        rank_batches = plan_batch(rollouts, config)
        parts = parts_of(rank_batches)
        assert sorted(p for _, _, members in parts for p in members) == list(range(len(rollouts)))
        for _, _, members in parts:
            assert len({groups[p] for p in members}) == 1, "a shared row holds one group's sequences"
        for rank_batch in rank_batches:
            for mb in rank_batch.micro_batches:
                if config.mode == "padded":
                    assert mb.num_sequences <= config.rows_per_micro_batch
                else:
                    assert mb.computed_tokens <= config.max_tokens_per_microbatch
        sizes = sorted(len(members) for _, _, members in parts)
        if config.mode == "padded" and config.rows_per_micro_batch == 4:
            assert sizes == [4] * 6  # whole groups, one row each
        if config.mode == "padded" and config.rows_per_micro_batch == 3:
            assert sizes == [1] * 6 + [3] * 6  # a group of 4 is split, its prompt forwarded once per part
        assert rank_batches[0].stats.computed_tokens < sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)


def test_a_group_is_split_so_that_every_rank_has_work():
    rollouts = random_rollouts(1, 6, vocab_size=50, seed=3)
    rank_batches = plan_batch(rollouts, BatchingConfig(world_size=4, mode="padded", rows_per_micro_batch=8,
                                                       max_seq_len=64, share_prompt_training="on"))
    assert all(rb.micro_batches[0].num_sequences > 0 for rb in rank_batches)
    assert sum(rb.micro_batches[0].num_sequences for rb in rank_batches) == 6


def test_auto_shares_short_completions_and_not_long_ones():
    """Dense attention (an eager model): the modelled cost of a row is tokens + attention_cost * tokens^2: one row
    per group when the prompt dominates, one row per sequence when a shared row's dense attention would cost more
    than the prompt saves."""
    cost = 3.3e-4  # SmolLM2-135M's ratio (policy.attention_cost)
    assert best_part_size(40, [16] * 4, cost) == 4
    assert best_part_size(100, [1000] * 8, cost) == 1
    assert 1 < best_part_size(40, [200] * 8, cost) < 8
    short = [Rollout([5] * 40, [10 + i] * 16, [1] * 16, float(i % 2), "short") for i in range(4)]
    long = [Rollout([7] * 100, [10 + i] * 1000, [1] * 1000, float(i % 2), "long") for i in range(4)]
    config = dict(mode="padded", rows_per_micro_batch=4, max_seq_len=2048, attention_cost=cost, share_prompt_training="auto")
    (short_batch,) = plan_batch(short, BatchingConfig(**config))
    (long_batch,) = plan_batch(long, BatchingConfig(**config))
    assert short_batch.micro_batches[0].shared is not None and short_batch.stats.computed_tokens == 40 + 4 * 16
    assert long_batch.micro_batches[0].shared is None and long_batch.stats.computed_tokens == 4 * 1100


def test_auto_micro_batching_takes_the_layout_of_lower_modelled_cost():
    """Without a varlen kernel, ``auto`` lays each batch out padded or packed, whichever the cost model says is
    cheaper, and the micro-batches are exactly those of the mode it chose."""
    cost = 3.3e-4

    def groups(prompt_lengths, completion_len):
        return [Rollout([3 + g] * p, [10 + i] * completion_len, [1] * completion_len, float(i % 2), f"g{g}")
                for g, p in enumerate(prompt_lengths) for i in range(4)]

    # Groups of unequal prompts in short rows: padded rows would pad three groups to the longest, one packed row
    # pads nothing and its dense attention is cheap (the quickstart's shape).
    short = groups([20, 40, 60, 80], 16)
    # Long rows: one packed row's attention over every group costs more than the padding of separate rows.
    long = groups([400, 420], 300)
    config = BatchingConfig(mode="auto", rows_per_micro_batch=16, max_seq_len=2048, max_tokens_per_microbatch=8192,
                            attention_cost=cost, share_prompt_training="on")
    for rollouts, expected in [(short, "packed"), (long, "padded")]:
        sequences = prepare_sequences(rollouts, [0.0] * len(rollouts), config.max_seq_len)
        options = {mode: layout(sequences, config, mode).modelled_cost(cost) for mode in ("padded", "packed")}
        assert min(options, key=options.get) == expected, options
        assert cheapest_layout(sequences, config).mode == expected
        (chosen,) = plan_batch(rollouts, config)
        (explicit,) = plan_batch(rollouts, replace(config, mode=expected))
        assert chosen.stats.extra["packed_micro_batches"] == float(expected == "packed")
        assert len(chosen.micro_batches) == len(explicit.micro_batches)
        for a, b in zip(chosen.micro_batches, explicit.micro_batches):
            assert a.packed == b.packed and a.batch_positions == b.batch_positions
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.shared.input_ids, b.shared.input_ids)
    padded = layout(prepare_sequences(short, [0.0] * 16, 2048), config, "padded")
    one_micro_batch = 4 * (80 + 64 + cost * (80 + 64) ** 2) + MICRO_BATCH_OVERHEAD_TOKENS
    assert padded.modelled_cost(cost) == pytest.approx(one_micro_batch)


def test_auto_counts_what_each_micro_batch_costs_beyond_its_rows(monkeypatch):
    """A multi-turn step of uniform lengths (8 groups x 4 of ~118-token rows, the long-tail benchmark's uniform
    multi-turn shape): its packed rows attend causally run by run and model marginally fewer cells than one padded
    micro-batch, but take 7 micro-batches more. Charged ``MICRO_BATCH_OVERHEAD_TOKENS`` each, ``auto`` keeps the one
    padded micro-batch; without that term it chose packed (where it measured slower, benchmarks/packing.py)."""
    rollouts = random_rollouts(8, 4, vocab_size=390, seed=3, prompt_len=(40, 40), completion_len=(76, 80))
    config = BatchingConfig(mode="auto", rows_per_micro_batch=32, max_seq_len=171, max_tokens_per_microbatch=684,
                            attention_cost=7.8125e-4, run_attention=True, share_prompt_training="auto")
    sequences = prepare_sequences(rollouts, [0.0] * len(rollouts), config.max_seq_len)
    options = {mode: layout(sequences, config, mode) for mode in ("padded", "packed")}
    counts = {mode: sum(map(len, option.micro_batches)) for mode, option in options.items()}
    assert counts == {"padded": 1, "packed": 8}
    costs = {mode: option.modelled_cost(config.attention_cost, True) for mode, option in options.items()}
    rows_alone = {mode: costs[mode] - counts[mode] * MICRO_BATCH_OVERHEAD_TOKENS for mode in costs}
    assert rows_alone["packed"] < rows_alone["padded"] < costs["packed"]
    assert cheapest_layout(sequences, config).mode == "padded"
    assert plan_batch(rollouts, config)[0].stats.extra["packed_micro_batches"] == 0.0
    monkeypatch.setattr(batching, "MICRO_BATCH_OVERHEAD_TOKENS", 0)
    assert cheapest_layout(sequences, config).mode == "packed"


def test_shared_prefix_is_compared_not_assumed():
    """A group whose prompts differ (a replay file may say so) shares only the tokens that agree; a group whose
    completions all start with the same turn shares it too; the two groups' common first tokens are the packed
    row's root, held once."""
    rollouts = [Rollout([1, 2, 3, 4], [9, 9], [1, 1], 1.0, "a"), Rollout([1, 2, 5, 4], [9, 8], [1, 1], 0.0, "a"),
                Rollout([1, 2], [7, 7, 6], [1, 0, 1], 1.0, "b"), Rollout([1, 2], [7, 7, 5, 5], [1, 0, 1, 1], 0.0, "b")]
    (rank_batch,) = plan_batch(rollouts, BatchingConfig(mode="packed", max_seq_len=16, max_tokens_per_microbatch=64,
                                                        share_prompt_training="on"))
    (mb,) = rank_batch.micro_batches
    assert rank_batch.stats.unique_tokens == (2 + 4 + 4) + (4 + 1 + 2)
    assert mb.computed_tokens == rank_batch.stats.unique_tokens - 2  # [1, 2] once for both groups
    assert mb.shared.input_ids[0, :2].tolist() == [1, 2] and bool((mb.shared.block[0, :2] == ROOT).all())
    assert common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 3 and common_prefix_length([[1], [2]]) == 0


def test_share_prompt_must_be_a_known_mode():
    # Checked once, by the config; BatchingConfig is built from a checked config.
    with pytest.raises(ValueError, match="share_prompt_training"):
        RLConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", share_prompt_training="always")


def test_reward_function_std_and_terminated_lengths_take_trls_edge_values():
    """rewards/<fn>/std read 0.0 where one episode had the function's value; TRL's nanstd (its own code, run here)
    gives NaN there. With every rollout truncated, *_terminated_length are 0, as TRL's (it measures a zero)."""
    import math

    from trl.trainer.utils import nanstd

    from verifiers_rl.training.step_batches import rollout_metrics

    rollouts = random_rollouts(num_groups=1, group_size=3, vocab_size=50, seed=0)
    for rollout, metrics in zip(rollouts, ({"everyone": 0.25, "some": 0.25}, {"everyone": 1.0}, {"everyone": 0.5})):
        rollout.metrics, rollout.truncated = metrics, True  # "some" scored one episode alone
    metrics = rollout_metrics(rollouts)
    assert math.isnan(metrics["rewards/some/std"]) and math.isnan(nanstd(torch.tensor([0.25])).item())
    assert metrics["rewards/everyone/std"] == pytest.approx(nanstd(torch.tensor([0.25, 1.0, 0.5])).item())
    assert [metrics[f"completions/{s}_terminated_length"] for s in ("mean", "min", "max")] == [0.0, 0.0, 0.0]


def test_reward_std_of_one_episode_is_nan_as_trls_overall_and_per_environment():
    """A batch of one episode (a replay of one-rollout groups with --rollouts_per_step 1) has no spread: reward_std
    and env/<name>/reward_std read 0.0 there while rewards/<fn>/std and evaluation's read NaN (TRL's nanstd); the
    step line then leaves the ± out (TRL's log turns NaN into None)."""
    import math

    from trl.trainer.utils import nanstd

    from verifiers_rl.training.progress import format_step_line
    from verifiers_rl.training.step_batches import environment_metrics

    rollouts = random_rollouts(num_groups=1, group_size=1, vocab_size=50, seed=0)
    rollouts[0].env = "mix_a"
    assert math.isnan(nanstd(torch.tensor([rollouts[0].reward])).item())
    assert math.isnan(plan_batch(rollouts, BatchingConfig(max_seq_len=64))[0].stats.reward_std)
    assert math.isnan(environment_metrics(rollouts, {})["env/mix_a/reward_std"])
    assert format_step_line(1, 2, {"reward": 0.5, "reward_std": None}) == "step 1/2 | reward 0.500"
