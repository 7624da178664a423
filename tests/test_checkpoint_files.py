"""A checkpoint is data, not code: a rank's batch slice round-trips through safetensors + JSON, and a crafted file
(a pickle, an unknown record type) is refused without running anything."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from verifiers_rl.batching import BatchingConfig, plan_batch
from verifiers_rl.checkpoint import CheckpointError, load_rank_batch, save_rank_batch
from verifiers_rl.synthetic import random_rollouts


def planned(**config):
    rollouts = random_rollouts(4, 4, vocab_size=390, seed=11)
    (rank_batch,) = plan_batch(rollouts, BatchingConfig(max_seq_len=512, max_tokens_per_microbatch=2048, **config), 3)
    for mb in rank_batch.micro_batches:
        mb.proximal_logps = torch.randn(mb.loss_mask.shape, dtype=torch.float64)
    return rank_batch


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        for name in a.__dataclass_fields__:
            assert_same(getattr(a, name), getattr(b, name))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b) and all(assert_same(x, y) is None for x, y in zip(a, b))
    else:
        assert a == b


@pytest.mark.parametrize("config", [dict(mode="padded"), dict(mode="packed", share_prompt_training="on")])
def test_a_rank_batch_round_trips_field_by_field(tmp_path, config):
    rank_batch = planned(**config)
    save_rank_batch(tmp_path, 1, rank_batch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_batch-1.json", "rank_batch-1.safetensors"]
    assert_same(rank_batch, load_rank_batch(tmp_path, 1))


class Exploit:
    def __reduce__(self):
        return (open, ("/tmp/verifiers_rl_exploit_marker", "w"))


def test_a_crafted_file_is_refused_and_never_run(tmp_path):
    marker = "/tmp/verifiers_rl_exploit_marker"
    import os

    if os.path.exists(marker):
        os.remove(marker)
    save_rank_batch(tmp_path, 0, planned(mode="padded"))
    (tmp_path / "rank_batch-0.safetensors").write_bytes(pickle.dumps(Exploit()))  # a pickle where tensors belong
    with pytest.raises(CheckpointError, match="cannot read this rank's batch"):
        load_rank_batch(tmp_path, 0)
    assert not os.path.exists(marker)
    save_rank_batch(tmp_path, 0, planned(mode="padded"))
    record = json.loads((tmp_path / "rank_batch-0.json").read_text())
    record["dataclass"] = "Popen"  # only the batch's own dataclasses can be named
    (tmp_path / "rank_batch-0.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="unknown record type 'Popen'"):
        load_rank_batch(tmp_path, 0)
    (tmp_path / "rank_batch-0.json").unlink()
    with pytest.raises(CheckpointError, match="rank_batch-0.json is missing"):
        load_rank_batch(tmp_path, 0)
