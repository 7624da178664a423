"""Checkpoints a cluster damages: each records what it holds; latest/auto skip a damaged newest one for the newest
intact one, a damaged one named explicitly is refused naming the file; auto starts fresh when there is none; a full
disk while saving (a real, small tmpfs where we may mount one) removes the partial folder, keeps the earlier
checkpoints loadable and stops with an error saying so."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tests.helpers.launches import accelerate, run as launch
from tests.helpers.checkpoints import plant
from verifiers_rl.training.run_state import CheckpointError, manifest_name, resolve_checkpoint
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts
from verifiers_rl.training.trainer import RLTrainer


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("safety") / "rollouts.jsonl"
    write_rollouts(path, random_rollouts(16, 4, vocab_size=390, seed=9))
    return path


def trainer(model_dir: str, rollouts: Path, out: Path, steps: int, save_every: int | None = 1, **others) -> RLTrainer:
    args = RLConfig(output_dir=str(out), use_cpu=True, report_to="none", rollouts_path=str(rollouts),
                    rollouts_per_step=8, max_steps=steps, **others,
                    **({"save_strategy": "steps", "save_steps": save_every} if save_every else {"save_strategy": "no"}),
                    disable_tqdm=True, learning_rate=1e-3, lr_scheduler_type="constant",
                    gradient_checkpointing=False)  # constant: runs of 3 and 4 steps share their first steps exactly
    return RLTrainer(model_dir, args, processing_class=AutoTokenizer.from_pretrained(model_dir))


def parameters(trainer: RLTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def run(tiny_model_dir, rollouts, tmp_path_factory):
    """Three steps, a checkpoint after each; and the same run uninterrupted to 4 steps (its final parameters)."""
    work = tmp_path_factory.mktemp("safety-run")
    trainer(tiny_model_dir, rollouts, work / "run", 3).train()
    straight = trainer(tiny_model_dir, rollouts, work / "straight", 4, save_every=None)
    straight.train()
    return work / "run", parameters(straight)


def cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "model.safetensors": cut,
    "optimizer.pt": cut,
    "trainer_state.json": cut,
    "verifiers_rl_state.json": cut,
    "deleted scheduler.pt": lambda path: path.with_name("scheduler.pt").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_latest_skips_a_damaged_newest_checkpoint_and_an_explicit_one_is_refused(run, tmp_path, damage, caplog):
    folder, _ = run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    name = damage.split()[-1]
    DAMAGE[damage](copy / "checkpoint-3" / name)
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.training.run_state"):
        assert resolve_checkpoint("latest", copy) == copy / "checkpoint-2"
        assert resolve_checkpoint("auto", copy) == copy / "checkpoint-2"
    assert f"Skipping {copy / 'checkpoint-3'}" in caplog.text and name in caplog.text
    with pytest.raises(CheckpointError, match=rf"checkpoint-3' cannot be resumed from: .*{name}"):
        resolve_checkpoint(str(copy / "checkpoint-3"), copy)


@pytest.mark.parametrize("name", ["trainer_state.json", "verifiers_rl_state.json", "config.json", "model.safetensors"])
def test_a_checkpoint_without_a_manifest_whose_file_is_cut_short_is_damaged(run, tmp_path, name, caplog):
    """An older (or hand-copied) checkpoint has no manifest to tell a copy that stopped part-way: files that do not
    parse say it."""
    folder, _ = run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    checkpoint = copy / "checkpoint-3"
    (checkpoint / manifest_name(0)).unlink()
    cut(checkpoint / name)
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.training.run_state"):
        assert resolve_checkpoint("latest", copy) == copy / "checkpoint-2"
        assert resolve_checkpoint("auto", copy) == copy / "checkpoint-2"
    assert re.search(rf"Skipping {checkpoint}: {name} does not parse as \w+ .*: cut short\?", caplog.text), caplog.text
    with pytest.raises(CheckpointError, match=rf"checkpoint-3' cannot be resumed from: {name} does not parse"):
        resolve_checkpoint(str(checkpoint), copy)


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
def test_a_pickle_planted_in_an_hf_file_is_refused_naming_file_and_checkpoint(run, tiny_model_dir, rollouts, tmp_path,
                                                                               name, caplog):
    """HF loads its files with weights_only=True already (nothing runs); the refusal now says which file, and
    ``latest`` passes over the checkpoint for the one before."""
    folder, _ = run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    checkpoint, marker = copy / "checkpoint-3", tmp_path / "planted-code-ran"
    plant(checkpoint / name, checkpoint, marker)
    resumed = trainer(tiny_model_dir, rollouts, copy, 4, save_every=None)
    with pytest.raises(CheckpointError, match=rf"{name} of checkpoint {checkpoint} was refused: .*GLOBAL io.open"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.training.run_state"):
        assert resolve_checkpoint("latest", copy) == copy / "checkpoint-2"
    assert f"Skipping {checkpoint}: {name} of checkpoint {checkpoint} was refused" in caplog.text
    assert not marker.exists()


def test_the_resumed_run_from_the_newest_intact_checkpoint_equals_the_uninterrupted_one(run, tiny_model_dir,
                                                                                       rollouts, tmp_path):
    folder, straight = run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    cut(copy / "checkpoint-3" / "model.safetensors")
    resumed = trainer(tiny_model_dir, rollouts, copy, 4, save_every=None)
    resumed.train(resume_from_checkpoint="latest")  # from checkpoint-2: steps 3 and 4 again
    got = parameters(resumed)
    worst = max(float((got[k] - straight[k]).abs().max() / straight[k].abs().max()) for k in straight)
    assert worst < 1e-6, worst


def test_every_file_of_a_published_checkpoint_is_in_its_manifest(run):
    import json

    folder, _ = run
    checkpoint = folder / "checkpoint-2"
    files = json.loads((checkpoint / manifest_name(0)).read_text())["files"]
    on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file() and p.name != manifest_name(0)}
    assert set(files) == on_disk and {"model.safetensors", "optimizer.pt", "verifiers_rl_state.json"} <= on_disk


def test_auto_starts_fresh_without_a_checkpoint_and_resumes_with_one(run, tiny_model_dir, rollouts, tmp_path):
    folder, straight = run
    fresh = trainer(tiny_model_dir, rollouts, tmp_path / "fresh", 1, save_every=None)
    fresh.train(resume_from_checkpoint="auto")
    assert fresh.state.global_step == 1
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    again = trainer(tiny_model_dir, rollouts, copy, 4, save_every=None)
    again.train(resume_from_checkpoint="auto")  # from checkpoint-3: one step
    got = parameters(again)
    assert max(float((got[k] - straight[k]).abs().max() / straight[k].abs().max()) for k in straight) < 1e-6


@pytest.mark.parametrize("where", ["train", "config"])
def test_an_empty_resume_is_refused_not_a_fresh_start(where, tiny_model_dir, rollouts, tmp_path):
    # An unset variable ("$CKPT") started afresh as if none were given, the run it meant to continue left behind.
    message = r"^resume_from_checkpoint is empty; pass a checkpoint folder, 'latest' or 'auto', or leave it out"
    with pytest.raises(ValueError, match=message):
        if where == "config":
            trainer(tiny_model_dir, rollouts, tmp_path / "run", 1, save_every=None, resume_from_checkpoint=" ")
        else:
            trainer(tiny_model_dir, rollouts, tmp_path / "run", 1, save_every=None).train(resume_from_checkpoint="")
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_auto_starting_fresh_cuts_the_rollouts_file_back_to_where_its_stopped_attempt_began(
        tiny_model_dir, rollouts, tmp_path, caplog):
    # The restarted attempt appended its batches after the stopped one's: batches 0 and 1 appeared twice.
    trainer(tiny_model_dir, rollouts, tmp_path / "once", 2, save_every=None,
            save_rollouts_path=str(tmp_path / "once.jsonl")).train()
    once = (tmp_path / "once.jsonl").read_bytes()
    saved = tmp_path / "trained.jsonl"
    saved.write_bytes(b"another run's line\n")  # what was there before: kept
    for _ in range(2):  # an attempt that wrote no checkpoint, then its restart
        trainer(tiny_model_dir, rollouts, tmp_path / "out", 2, save_every=None,
                save_rollouts_path=str(saved)).train(resume_from_checkpoint="auto")
    assert saved.read_bytes() == b"another run's line\n" + once
    # auto in another --output_dir starts another run: it appends, and cuts nothing of this one's.
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.training.checkpoints"):
        trainer(tiny_model_dir, rollouts, tmp_path / "other", 2, save_every=None,
                save_rollouts_path=str(saved)).train(resume_from_checkpoint="auto")
    assert saved.read_bytes() == b"another run's line\n" + once + once
    size = len(b"another run's line\n" + once)  # said, not silent
    assert f"--save_rollouts_path {saved} already holds {size} bytes of rollouts: this run appends" in caplog.text


def mounted_tmpfs(folder: Path, size: int) -> None:
    """A real filesystem of ``size`` bytes at ``folder`` (root mounts it; elsewhere the test is skipped, not faked)."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.strip()}")


def used_bytes(folder: Path) -> int:
    """What ``folder``'s files take on a tmpfs (whole pages)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob("*") if p.is_file())


def test_a_full_disk_while_saving_keeps_the_earlier_checkpoints_and_says_so(tiny_model_dir, rollouts, tmp_path):
    """A real full disk: the output folder is a tmpfs with room for about one and a half checkpoints (needs root to
    mount; where mounting is refused the test is skipped rather than faked)."""
    probe = tmp_path / "probe"
    trainer(tiny_model_dir, rollouts, probe, 1).train()
    size = sum(p.stat().st_size for p in (probe / "checkpoint-1").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    mounted_tmpfs(disk, int(size * 1.5))
    try:
        full = trainer(tiny_model_dir, rollouts, disk / "out", 3)
        with pytest.raises(CheckpointError, match=r"Writing checkpoint-2 to .*disk/out failed \(no space left on the "
                                                  r"device\); its partial folder is removed.*--resume_from_checkpoint latest"):
            full.train()
        names = sorted(p.name for p in (disk / "out").iterdir())
        assert "checkpoint-1" in names and not [n for n in names if n.startswith(".partial-") or n == "checkpoint-2"]
        assert resolve_checkpoint("latest", disk / "out") == disk / "out" / "checkpoint-1"  # intact and loadable
        load_file(disk / "out" / "checkpoint-1" / "model.safetensors")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)  # lazy: the trainer may still hold a file open


@pytest.mark.distributed
def test_a_disk_that_fills_inside_the_model_file_stops_both_ranks_saying_so(tiny_model_dir, rollouts, tmp_path):
    """Two processes (DDP); the tmpfs holds checkpoint-1 and half of checkpoint-2's model.safetensors, so safetensors
    (not torch.save) meets the full disk, on rank 0 only."""
    args = ["--model", tiny_model_dir, "--rollouts_path", str(rollouts), "--rollouts_per_step", "8",
            "--save_strategy", "steps", "--save_steps", "1"]
    launch(accelerate("ddp_cpu.yaml"), tmp_path / "probe", args + ["--max_steps", "1"], tmp_path / "probe.log")
    probe = tmp_path / "probe" / "checkpoint-1"
    disk = tmp_path / "disk"
    # checkpoint-1, checkpoint-2's config files (written before its weights), half its model file
    mounted_tmpfs(disk, used_bytes(probe) + 2 * 4096 + (probe / "model.safetensors").stat().st_size // 2)
    try:
        log = launch(accelerate("ddp_cpu.yaml"), disk / "out", args + ["--max_steps", "3"], tmp_path / "full.log",
                     expect=1)
        out = re.escape(str(disk / "out"))
        for rank in (0, 1):
            assert re.search(rf"\[rank {rank}\] verifiers-rl train: error: Writing checkpoint-2 to {out} "
                             r"failed \(no space left on the device\); its partial folder is removed", log), log[-6000:]
        assert "SafetensorError" in log  # the cause: the disk filled inside model.safetensors
        assert "died (killed" not in log  # rank 1 learned the error, not a lost peer
        names = sorted(p.name for p in (disk / "out").iterdir())
        assert "checkpoint-1" in names and not [n for n in names if n.startswith(".partial-") or n == "checkpoint-2"]
        assert resolve_checkpoint("latest", disk / "out") == disk / "out" / "checkpoint-1"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_partial_folder_left_by_a_killed_save_is_cleared_before_the_step_is_written_again(tiny_model_dir,
                                                                                             rollouts, tmp_path):
    """A run killed while writing checkpoint-1 leaves .partial-checkpoint-1 (never resumed); the restarted run writes
    step 1 again in that place, and nothing of the killed attempt's files ends up in the new checkpoint."""
    out = tmp_path / "out"
    stale = out / ".partial-checkpoint-1" / "checkpoint-1"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half a file")
    (stale / "left-by-the-killed-run.bin").write_bytes(b"x")
    trainer(tiny_model_dir, rollouts, out, 1).train(resume_from_checkpoint="auto")
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    assert not (out / "checkpoint-1" / "left-by-the-killed-run.bin").exists()
    assert resolve_checkpoint("latest", out) == out / "checkpoint-1"  # its manifest holds the new files only
    load_file(out / "checkpoint-1" / "model.safetensors")
