"""Durable runs: a resumed run ends with the parameters of the run left uninterrupted (replay under one process, DDP
and ZeRO-3, part-way through a num_iterations batch; live at k = 0 and k = 1), SIGTERM finishes the step, writes a
checkpoint and stops every rank (one process and a real 2-process DDP launch, then resumed; under continuous
generation it loses no group and trains none twice), checkpoints are complete or absent, and a resume that does not
fit the run is a clear error.

Every run is the real ``examples/train.py``, as a user launches it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from verifiers_rl.training.run_state import CheckpointError, check_fits, load_run_state, publish, resolve_checkpoint
from verifiers_rl.core.rollout import group_by_id, read_rollouts, write_rollouts
from verifiers_rl.rollouts.continuous import position_of
from verifiers_rl.rollouts.synthetic import random_rollouts

from tests.helpers.launches import (COMMON, LIVE, ROOT, SCRIPT, accelerate, assert_equal_parameters, final_parameters,
                                    launch_env, logged_steps, run, with_flags)


@pytest.fixture(scope="module")
def rollouts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "rollouts.jsonl"
    write_rollouts(path, random_rollouts(12, 4, vocab_size=390, seed=5, fully_masked_fraction=0.1))
    return path


# --- replay ---------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["single", "ddp", "zero3"])
def test_replay_resume_part_way_through_a_batch_equals_the_uninterrupted_run(backend, tiny_model_dir, rollouts_file,
                                                                             tmp_path):
    """num_iterations 2: checkpoint-3 falls after the first of batch 1's two updates, so the resumed run needs the
    saved slices (proximal log-probs from older weights) on every rank."""
    prefix = [sys.executable] if backend == "single" else accelerate(f"{backend}_cpu.yaml")
    args = ["--model", tiny_model_dir, "--rollouts_path", str(rollouts_file), "--rollouts_per_step", "8",
            "--max_steps", "5", "--num_iterations", "2", "--save_strategy", "steps"]
    # One process also checks --save_total_limit: a checkpoint every step, the newest 3 kept.
    args += ["--save_steps", "1", "--save_total_limit", "3"] if backend == "single" else ["--save_steps", "3"]
    run(prefix, tmp_path / "full", args, tmp_path / "full.log")
    kept = sorted(p.name for p in (tmp_path / "full").iterdir() if p.name.startswith(("checkpoint-", ".partial")))
    # (HF also saves at the last step.)
    assert kept == (["checkpoint-3", "checkpoint-4", "checkpoint-5"] if backend == "single" else ["checkpoint-3", "checkpoint-5"])
    checkpoint = tmp_path / "full" / "checkpoint-3"
    state = load_run_state(checkpoint)
    assert (state.global_step, state.next_batch, state.iteration) == (3, 2, 1) and state.mid_batch()
    world = 1 if backend == "single" else 2
    assert sorted(p.name for p in checkpoint.glob("rank_batch-*.safetensors")) == [f"rank_batch-{r}.safetensors" for r in range(world)]

    log = run(prefix, tmp_path / "resumed", args + ["--resume_from_checkpoint", str(checkpoint)], tmp_path / "resumed.log")
    assert logged_steps(log) == [4, 5]  # numbered from the checkpoint on
    assert_equal_parameters(tmp_path / "resumed", tmp_path / "full", initial=checkpoint)


def saved_reference(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's reference model under model.safetensors' names (the tiny model ties its output layer to the
    input embedding: HF keeps the embedding's name, safetensors' save_model the output layer's)."""
    weights = load_file(checkpoint / "reference_model.safetensors")
    weights["model.embed_tokens.weight"] = weights.pop("lm_head.weight")
    return weights


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["single", "zero3"])
def test_a_synced_reference_model_mixes_as_trl_says_and_resumes_exactly(backend, tiny_model_dir, rollouts_file,
                                                                       tmp_path):
    """--sync_ref_model (TRL's callback): the reference becomes alpha * policy + (1 - alpha) * reference every
    ref_model_sync_steps steps; the checkpoint keeps it, so a run resumed between two mixes (its KL term against the
    mixed reference) ends with the uninterrupted run's parameters and reference."""
    prefix = [sys.executable] if backend == "single" else accelerate(f"{backend}_cpu.yaml")
    args = ["--model", tiny_model_dir, "--rollouts_path", str(rollouts_file), "--rollouts_per_step", "8",
            "--max_steps", "5", "--beta", "0.5", "--sync_ref_model", "true", "--ref_model_sync_steps", "2",
            "--ref_model_mixup_alpha", "0.5", "--save_strategy", "steps", "--save_steps", "1"]
    run(prefix, tmp_path / "full", args, tmp_path / "full.log")
    full = tmp_path / "full"
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    policy = {step: final_parameters(full / f"checkpoint-{step}") for step in (2, 4)}
    reference = {step: saved_reference(full / f"checkpoint-{step}") for step in (1, 2, 3, 4)}
    for name, start in initial.items():
        mixed2 = 0.5 * policy[2][name] + 0.5 * start
        torch.testing.assert_close(reference[1][name], start)  # no mix before step 2
        torch.testing.assert_close(reference[2][name], mixed2, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(reference[3][name], mixed2)
        torch.testing.assert_close(reference[4][name], 0.5 * policy[4][name] + 0.5 * mixed2, rtol=1e-6, atol=1e-7)
    assert max(float((reference[2][k] - initial[k]).abs().max()) for k in initial) > 1e-4, "the mix moved it"

    checkpoint = full / "checkpoint-3"
    run(prefix, tmp_path / "resumed", args + ["--resume_from_checkpoint", str(checkpoint)], tmp_path / "resumed.log")
    assert_equal_parameters(tmp_path / "resumed", full, initial=checkpoint)
    resumed, want = saved_reference(tmp_path / "resumed" / "checkpoint-5"), saved_reference(full / "checkpoint-5")
    assert want.keys() == initial.keys() and all(torch.equal(resumed[k], want[k]) for k in want)
    if backend == "single":  # a checkpoint without the reference (its run's stayed the initial model) is refused
        mix = ("--sync_ref_model", "--ref_model_sync_steps", "--ref_model_mixup_alpha")  # refused without the first
        plain = [a for i, a in enumerate(args) if a not in mix and args[i - 1] not in mix]
        run(prefix, tmp_path / "plain", with_flags(plain, ["--max_steps", "1"]), tmp_path / "plain.log")
        log = run(prefix, tmp_path / "bad", args + ["--resume_from_checkpoint", str(tmp_path / "plain" / "checkpoint-1")],
                  tmp_path / "bad.log", expect=1)
        assert "has no reference_model.safetensors: it was written by a run without --sync_ref_model" in log


# --- live -----------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_live_resume_at_k0_regenerates_the_same_batches(tiny_model_dir, tmp_path):
    args = ["--model", tiny_model_dir, *LIVE, "--max_off_policy_steps", "0", "--max_steps", "6",
            "--save_strategy", "steps", "--save_steps", "3"]
    run([sys.executable], tmp_path / "full", args + ["--save_rollouts_path", str(tmp_path / "full.jsonl")],
        tmp_path / "full.log")
    checkpoint = tmp_path / "full" / "checkpoint-3"
    log = run([sys.executable], tmp_path / "resumed",
              args + ["--resume_from_checkpoint", str(checkpoint), "--save_rollouts_path", str(tmp_path / "resumed.jsonl")],
              tmp_path / "resumed.log")
    assert logged_steps(log) == [4, 5, 6]
    assert_equal_parameters(tmp_path / "resumed", tmp_path / "full", initial=checkpoint)
    # The batches generated after the resume are the ones the uninterrupted run generated, token for token.
    full, resumed = read_rollouts(tmp_path / "full.jsonl"), read_rollouts(tmp_path / "resumed.jsonl")
    assert len(full) == 48 and len(resumed) == 24
    assert [r.to_json() for r in resumed] == [r.to_json() for r in full[24:]]


def start(prefix, out: Path, args: list[str], log: Path) -> subprocess.Popen:
    env = launch_env()
    with log.open("w") as handle:
        command = prefix + [SCRIPT, *with_flags(["--output_dir", str(out), *COMMON], args)]
        return subprocess.Popen(command, cwd=ROOT, env=env,
                                stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def stop_after_step(process: subprocess.Popen, log: Path, step: int, timeout_s: float = 300) -> tuple[int, list[int]]:
    """SIGTERM ``process`` once ``step`` is logged; return its exit status and every pid of its tree seen meanwhile."""
    deadline = time.monotonic() + timeout_s
    tree: set[int] = set()
    while f"step {step}/" not in log.read_text():
        assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "the run never reached the step"
        tree |= {child.pid for child in psutil.Process(process.pid).children(recursive=True)}
        time.sleep(0.1)
    tree |= {child.pid for child in psutil.Process(process.pid).children(recursive=True)}
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s), sorted(tree)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_a_finished_run_resumed_with_more_steps_goes_on_from_its_weights(tiny_model_dir, tmp_path):
    """k = 1: the last checkpoint of a finished run holds no batch generated ahead, and the batch after it needs
    weights older than the checkpoint's. The resumed run waited for that batch before loading any weights, until
    --generation_timeout_s; now the checkpoint's weights generate it."""
    args = ["--model", tiny_model_dir, *LIVE, "--max_off_policy_steps", "1", "--save_strategy", "steps",
            "--save_steps", "2", "--generation_timeout_s", "30"]
    run([sys.executable], tmp_path / "run", args + ["--max_steps", "4"], tmp_path / "first.log")
    log = run([sys.executable], tmp_path / "run", args + ["--max_steps", "6", "--resume_from_checkpoint", "latest",
                                                           "--save_rollouts_path", str(tmp_path / "more.jsonl")],
              tmp_path / "more.log")
    assert logged_steps(log) == [5, 6]
    versions = [rollout.policy_version for rollout in read_rollouts(tmp_path / "more.jsonl")]
    # Batch 5 too: it needs version 4 (k = 1), and step 5's load waits for it (the exact schedule).
    assert versions == [4] * 16, versions


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["single", "ddp"])
def test_sigterm_checkpoints_stops_and_the_resumed_run_equals_the_uninterrupted_one(backend, tiny_model_dir, tmp_path):
    """k = 1 (generation one step ahead, a batch pending in the checkpoint). ``single``: SIGTERM to the script;
    ``ddp``: SIGTERM to ``accelerate launch``, which forwards it to both ranks."""
    prefix = [sys.executable] if backend == "single" else accelerate("ddp_cpu.yaml")
    args = ["--model", tiny_model_dir, *LIVE, "--max_off_policy_steps", "1", "--max_steps", "12",
            "--save_strategy", "no"]
    run(prefix, tmp_path / "full", args + ["--save_rollouts_path", str(tmp_path / "full.jsonl")], tmp_path / "full.log")

    out, rollouts = tmp_path / "stopped", tmp_path / "stopped.jsonl"
    process = start(prefix, out, args + ["--save_rollouts_path", str(rollouts)], tmp_path / "stopped.log")
    status, tree = stop_after_step(process, tmp_path / "stopped.log", step=3)
    log = (tmp_path / "stopped.log").read_text()
    assert "SIGTERM: finishing the current optimizer step" in log
    checkpoints = [p.name for p in out.iterdir() if "checkpoint" in p.name]
    assert len(checkpoints) == 1 and checkpoints[0].startswith("checkpoint-"), checkpoints  # complete, renamed
    step = int(checkpoints[0].split("-")[1])
    assert 3 <= step < 12
    ranks = [0] if backend == "single" else [0, 1]
    for rank in ranks:  # every rank names the checkpoint
        assert f"[rank {rank}] Training stopped by SIGTERM after step {step}: checkpoint saved to {out / checkpoints[0]}" in log
    assert f"stopped at step {step} of 12" in log
    if backend == "single":
        assert status == 128 + signal.SIGTERM
    else:
        assert status != 0  # torchrun reports the signal it got
    alive = [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {alive}"
    # k = 1: the batch generated ahead, and the one after it if the generator finished it (with the weights just
    # synced, as the schedule says) before the checkpoint was written: which of the two is timing.
    saved = load_run_state(out / checkpoints[0])
    assert saved.pending_batches in ([saved.next_batch], [saved.next_batch, saved.next_batch + 1]), saved
    # Their generation counts are kept with them, to be logged when they are trained.
    assert sorted(saved.pending_stats) == sorted(map(str, saved.pending_batches)), saved
    assert all(stats["rollouts_failed"] == 0 for stats in saved.pending_stats.values()), saved

    log = run(prefix, out, args + ["--save_rollouts_path", str(rollouts), "--resume_from_checkpoint", "latest"],
              tmp_path / "resumed.log")
    assert logged_steps(log)[0] == step + 1
    assert_equal_parameters(out, tmp_path / "full", initial=out / checkpoints[0])
    # The rollouts file lost what was appended after the checkpoint and holds every batch once, as the
    # uninterrupted run's does.
    assert rollouts.read_bytes() == (tmp_path / "full.jsonl").read_bytes()


@pytest.mark.distributed
def test_sigterm_under_continuous_generation_loses_no_group_and_trains_none_twice(tiny_model_dir, tmp_path):
    """--groups_in_flight: the checkpoint SIGTERM writes keeps the finished groups not yet trained and the positions in
    flight; the resumed run (the embedded engine serving continuously) trains every position of the run once."""
    args = ["--model", tiny_model_dir, *LIVE, "--max_off_policy_steps", "1", "--groups_in_flight", "3",
            "--continuous_batching_rows", "6", "--max_steps", "8", "--save_strategy", "no"]
    out, rollouts = tmp_path / "stopped", tmp_path / "stopped.jsonl"
    process = start([sys.executable], out, args + ["--save_rollouts_path", str(rollouts)], tmp_path / "stopped.log")
    status, _ = stop_after_step(process, tmp_path / "stopped.log", step=3)
    assert status == 128 + signal.SIGTERM, (tmp_path / "stopped.log").read_text()[-3000:]
    (checkpoint,) = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
    saved = load_run_state(checkpoint)
    assert saved.generator is not None and (saved.pending_batches or saved.generator["in_flight"])
    log = run([sys.executable], out, args + ["--save_rollouts_path", str(rollouts), "--resume_from_checkpoint", "latest"],
              tmp_path / "resumed.log")
    assert logged_steps(log)[0] == saved.global_step + 1
    trained = read_rollouts(rollouts)
    assert len(trained) == 8 * 8
    groups = group_by_id(trained)
    assert all(len(members) == 4 for members in groups)  # whole groups, none trained twice under one id
    # every position once: none lost at the stop, none trained twice
    assert sorted(position_of(members[0].group_id)[0] for members in groups) == list(range(16))


# --- checkpoints are complete or absent; bad resumes --------------------------------------------------------------


def test_a_checkpoint_is_published_whole_and_latest_never_picks_a_partial_one(tmp_path):
    complete = tmp_path / "checkpoint-2"
    complete.mkdir()
    for name in ("trainer_state.json", "verifiers_rl_state.json"):
        (complete / name).write_text("{}")
    # A run killed while writing checkpoint-4 leaves it under its partial name.
    partial = tmp_path / ".partial-checkpoint-4" / "checkpoint-4"
    partial.mkdir(parents=True)
    (partial / "trainer_state.json").write_text("{}")
    assert resolve_checkpoint("latest", tmp_path) == complete
    with pytest.raises(CheckpointError, match="not a complete verifiers_rl checkpoint"):
        resolve_checkpoint(str(partial), tmp_path)
    # Once complete it replaces an older folder of the same name in one rename.
    (partial / "verifiers_rl_state.json").write_text('{"new": 1}')
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "stale").write_text("old")
    publish(tmp_path / ".partial-checkpoint-4", tmp_path / "checkpoint-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert not (tmp_path / "checkpoint-4" / "stale").exists()
    assert resolve_checkpoint("latest", tmp_path) == tmp_path / "checkpoint-4"


def trainer_for(model_dir: str, rollouts: Path, out: Path, **overrides):
    from transformers import AutoTokenizer

    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.training.trainer import RLTrainer

    args = RLConfig(output_dir=str(out), use_cpu=True, report_to="none", rollouts_path=str(rollouts),
                    rollouts_per_step=8, max_steps=2, save_strategy="steps", save_steps=2, disable_tqdm=True,
                    learning_rate=1e-3, gradient_checkpointing=False, **overrides)
    return RLTrainer(model_dir, args, processing_class=AutoTokenizer.from_pretrained(model_dir))


def test_bad_resumes_are_clear_errors(tiny_model_dir, rollouts_file, tmp_path):
    from verifiers_rl.core.models import build_tiny_model

    trainer_for(tiny_model_dir, rollouts_file, tmp_path / "run").train()
    checkpoint = tmp_path / "run" / "checkpoint-2"

    def refused(spec, message: str, model=tiny_model_dir, rollouts=rollouts_file) -> None:
        trainer = trainer_for(model, rollouts, tmp_path / "again")
        with pytest.raises(CheckpointError, match=message):
            trainer.train(resume_from_checkpoint=str(spec))
        assert trainer.state.global_step == 0  # nothing trained

    refused(tmp_path / "nowhere", "no such folder")
    # A finished run (max_steps 2) resumed as it was: the trainer waited --generation_timeout_s for a batch past it.
    refused(checkpoint, r"checkpoint-2 is at step 2 and this run ends at step 2 .*nothing is left to train. Raise "
                        r"--max_steps")
    # The run's folder: it said a run was killed while saving there.
    refused(tmp_path / "run", r"is a run's folder, not a checkpoint: name one of its checkpoints \(.*checkpoint-2\), "
            r"or pass --resume_from_checkpoint latest with --output_dir")
    refused("latest", "no intact checkpoint-N folder in --output_dir")  # tmp_path / "again" has none
    half = tmp_path / "half"
    half.mkdir()
    (half / "trainer_state.json").write_text("{}")
    refused(half, r"not a complete verifiers_rl checkpoint \(no verifiers_rl_state.json\)")
    other_model = build_tiny_model(tmp_path / "other-model", hidden_size=96)
    refused(checkpoint, r"the model differs \(hidden_size: 64 there, 96 here.*--model", model=str(other_model))
    changed = tmp_path / "changed.jsonl"
    write_rollouts(changed, random_rollouts(12, 4, vocab_size=390, seed=6))
    refused(checkpoint, r"the rollouts file's contents differ .*--rollouts_path", rollouts=changed)
    trainer_for(tiny_model_dir, rollouts_file, tmp_path / "weights-only", save_only_model=True).train()
    refused(tmp_path / "weights-only" / "checkpoint-2", r"holds no optimizer state \(written with --save_only_model\)")
    state, other_size = load_run_state(checkpoint), load_run_state(checkpoint)
    other_size.rollouts_per_step = 4
    with pytest.raises(CheckpointError, match=r"rollouts_per_step is 8 there, 4 here \(--rollouts_per_step\)"):
        check_fits(state, other_size, checkpoint)


@pytest.mark.distributed
def test_a_bad_resume_stops_every_rank(tiny_model_dir, rollouts_file, tmp_path):
    args = ["--model", tiny_model_dir, "--rollouts_path", str(rollouts_file), "--rollouts_per_step", "8",
            "--max_steps", "2", "--resume_from_checkpoint", "latest"]
    log = run(accelerate("ddp_cpu.yaml"), tmp_path / "empty", args, tmp_path / "ddp.log", expect=1)
    assert "no intact checkpoint-N folder in --output_dir" in log
    assert "The main process failed: CheckpointError" in log  # rank 1 raised the same error instead of waiting
