"""A checkpoint is data, not code: a rank's batch slice round-trips through safetensors + JSON, and a crafted file
(a pickle, an unknown record type) is refused without running anything; so is a pickle planted in DeepSpeed's own
files of a real ZeRO-3 checkpoint (a real 2-process CPU launch resumes from it), with the manifest rewritten to
match, as whoever crafts a checkpoint would."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from transformers.trainer_pt_utils import safe_globals

from tests.helpers.checkpoints import plant
from tests.helpers.launches import accelerate, run
from verifiers_rl import compat
from verifiers_rl.training.batching import BatchingConfig, plan_batch
from verifiers_rl.training.run_state import CheckpointError, load_rank_batch, save_rank_batch
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts


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


ZERO3_FILES = ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]


@pytest.fixture(scope="module")
def zero3_run(tiny_model_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """A real 2-process ZeRO-3 replay on CPU with a checkpoint after step 1; and the arguments that run it."""
    work = tmp_path_factory.mktemp("zero3-crafted")
    write_rollouts(work / "rollouts.jsonl", random_rollouts(8, 4, vocab_size=390, seed=5))
    args = ["--model", tiny_model_dir, "--rollouts_path", str(work / "rollouts.jsonl"), "--rollouts_per_step", "8",
            "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1"]
    run(accelerate("zero3_cpu.yaml"), work / "run", args, work / "run.log")
    return work / "run", args


@pytest.mark.distributed
def test_every_file_of_a_real_zero3_checkpoint_loads_as_data(zero3_run):
    checkpoint = zero3_run[0] / "checkpoint-1"
    files = sorted(checkpoint.glob("global_step1/*.pt")) + sorted(checkpoint.glob("*.pt*"))
    assert [p.name for p in files[:4]] == sorted(["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                  "zero_pp_rank_1_mp_rank_00_model_states.pt",
                                                  "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
    for file in files:
        with safe_globals():  # HF's numpy allowlist, as HF's own RNG load sets it
            assert isinstance(compat.load_as_data(file, str(checkpoint)), dict), file


@pytest.mark.distributed
@pytest.mark.parametrize("name", ZERO3_FILES)
def test_a_pickle_planted_in_a_deepspeed_file_is_refused_unrun_naming_file_and_checkpoint(zero3_run, name, tmp_path):
    folder, args = zero3_run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    checkpoint, marker = copy / "checkpoint-1", tmp_path / "planted-code-ran"
    plant(checkpoint / "global_step1" / name, checkpoint, marker)
    log = run(accelerate("zero3_cpu.yaml"), copy, args + ["--resume_from_checkpoint", str(checkpoint)],
              tmp_path / "resumed.log", expect=1)
    assert not marker.exists(), "the planted code ran"
    assert f"global_step1/{name} of checkpoint {checkpoint} was refused" in log, log[-6000:]
    assert "Unsupported global: GLOBAL io.open" in log  # what the planted pickle calls
    assert "The main process failed: CheckpointError" in log  # rank 1 stopped with the refusal, not a lost peer
