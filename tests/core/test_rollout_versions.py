"""Rollout.completion_versions (issue 37): which policy version sampled each completion token. Checked when a record
is read, written in saved records, absent from files written before (which still read); staleness is the oldest
sampled token's."""

from __future__ import annotations

import json

import pytest

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.rollout import NOT_SAMPLED, Rollout, RolloutFormatError, read_rollouts, write_rollouts
from verifiers_rl.core.sampling import RolloutSampling, Sample, set_completion_versions
from verifiers_rl.rollouts.generator import ReplaySource
from verifiers_rl.training.batching import BatchingConfig
from verifiers_rl.training.step_batches import StepBatches


def multi_turn(versions=None, policy_version=5) -> Rollout:
    # two model turns around an environment reply (mask 0)
    return Rollout(prompt_ids=[1, 2], completion_ids=[3, 4, 9, 9, 5, 6], completion_mask=[1, 1, 0, 0, 1, 1],
                   reward=1.0, group_id=0, completion_logprobs=[-0.5] * 6, policy_version=policy_version,
                   completion_versions=versions)


def test_versions_are_saved_read_back_and_old_records_still_read(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    write_rollouts(path, [multi_turn([3, 3, NOT_SAMPLED, NOT_SAMPLED, 5, 5]), multi_turn(None)])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["completion_versions"] == [3, 3, -1, -1, 5, 5]
    assert "completion_versions" not in lines[1]  # a record without them reads as before
    first, second = read_rollouts(path)
    assert first.completion_versions == [3, 3, -1, -1, 5, 5] and second.completion_versions is None
    assert (first.oldest_version(), second.oldest_version()) == (3, 5)


@pytest.mark.parametrize("versions,message", [
    ([3, 3, -1, -1, 5], "has 5 entries but `completion_ids` has 6"),
    ([3, 3, -1, -1, 5, -2], "must be >= 0, or -1"),
    ([3, -1, -1, -1, 5, 5], "a trained token (`completion_mask` 1) has no policy version"),
    ([3, 3, -1, -1, 5, 5.0], "must be a list of integers"),
])
def test_inconsistent_versions_are_refused_by_name(versions, message):
    with pytest.raises(RolloutFormatError, match=r"rollout 7: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        multi_turn(versions).validate("rollout 7")


def test_staleness_is_the_oldest_sampled_tokens(tmp_path):
    # The rollout's policy_version says 5, but its first turn was sampled by version 3 (a weight update between
    # turns); at step 6 its staleness is 3, not 1. Environment tokens (-1) count for nothing.
    replay = tmp_path / "replay.jsonl"
    write_rollouts(replay, [multi_turn([3, 3, -1, -1, 5, 5]), multi_turn([5] * 2 + [-1] * 2 + [5] * 2)])
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", rollouts_per_step=2, num_generations=2,
                    save_rollouts_path=str(tmp_path / "saved.jsonl"))
    steps = StepBatches(ReplaySource(replay, 2), args, BatchingConfig(max_seq_len=16), "cpu", global_step=lambda: 6)
    (rank_batch,) = steps.plan(0)
    assert rank_batch.stats.extra["staleness_max"] == 3 and rank_batch.stats.extra["staleness_mean"] == 2
    assert [r.completion_versions for r in read_rollouts(args.save_rollouts_path)] == [
        [3, 3, -1, -1, 5, 5], [5, 5, -1, -1, 5, 5]]


def test_recorded_versions_reach_the_trained_tokens_in_order():
    # Two model calls of 2 tokens each, the second after a weight load: turn by turn, env tokens NOT_SAMPLED.
    sampling = RolloutSampling(seed=1)
    sampling.record_versions([3, 3]), sampling.record_versions([4, 5])
    rollout = multi_turn()
    set_completion_versions(rollout, sampling)
    assert rollout.completion_versions == [3, 3, NOT_SAMPLED, NOT_SAMPLED, 4, 5]
    rollout.validate()


def test_unmatched_counts_give_every_trained_token_the_oldest_version():
    # A truncated or re-tokenised completion: which token came from which call is unknown, so the oldest holds.
    sampling = RolloutSampling()
    sampling.record_versions([4, 3, 5])
    rollout = multi_turn()
    set_completion_versions(rollout, sampling)
    assert rollout.completion_versions == [3, 3, NOT_SAMPLED, NOT_SAMPLED, 3, 3]
    untouched, already = multi_turn(), multi_turn([1, 1, -1, -1, 1, 1])
    set_completion_versions(untouched, RolloutSampling())  # an engine that records nothing
    set_completion_versions(already, sampling)
    assert untouched.completion_versions is None and already.completion_versions == [1, 1, -1, -1, 1, 1]


def test_a_samples_versions_are_checked_against_its_tokens():
    Sample([1, 2], [-0.1, -0.2], "stop", versions=[0, 1]).validate(4)
    with pytest.raises(ValueError, match="2 token ids but 1 versions"):
        Sample([1, 2], [-0.1, -0.2], "stop", versions=[0]).validate(4)
