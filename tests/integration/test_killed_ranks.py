"""A rank killed with SIGKILL (the OOM killer, a node's cleanup): the launch ends by itself within a bound, a survivor
says which rank died and how to resume, and ``--resume_from_checkpoint latest`` ends with the uninterrupted run's
parameters (ZeRO-3 replay, and a live DDP run whose killed rank held the embedded engine). Then without a human:
``accelerate launch --max_restarts 1`` with ``--resume_from_checkpoint auto`` restarts the workers after the kill,
and they resume by themselves and end with the uninterrupted run's parameters.

Real launches of ``examples/train.py`` (2 processes on CPU), real signals; a checkpoint every step, and the kill
comes once ``checkpoint-2`` is published, while later steps are still to come.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.helpers.launches import (COMMON, LIVE, ROOT, SCRIPT, accelerate, assert_equal_parameters, launch_env, logged_steps,
                                    run, with_flags)
from verifiers_rl.training.run_state import resolve_checkpoint
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts

pytestmark = pytest.mark.distributed

# From the kill to the launcher's exit. The survivors exit at once on the launcher's SIGTERM (they see the dead
# pid); without that they would sit in their step until TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s) ends them.
ENDS_WITHIN_S = 20
SAVE_EVERY_STEP = ["--save_strategy", "steps", "--save_steps", "1"]


@pytest.fixture(scope="module")
def rollouts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("killed") / "rollouts.jsonl"
    write_rollouts(path, random_rollouts(24, 4, vocab_size=390, seed=7, fully_masked_fraction=0.1))
    return path


@dataclass
class KilledLaunch:
    returncode: int
    killed_pid: int
    ended_after_kill_s: float
    log: str
    leftover: list[int]


def rank_of(process: psutil.Process) -> int | None:
    try:
        rank = process.environ().get("RANK")
    except psutil.Error:
        return None
    return int(rank) if rank is not None else None


def launch_and_kill(prefix: list[str], out: Path, args: list[str], log: Path, victim: int, after: int,
                    timeout_s: float = 300) -> KilledLaunch:
    """Launch; once ``out/checkpoint-<after>`` is published, SIGKILL the worker of rank ``victim``; wait for the
    launcher to end. Every process of the launch seen meanwhile must be gone at the end."""
    env = launch_env()
    with log.open("w") as handle:
        command = prefix + [SCRIPT, *with_flags(["--output_dir", str(out), *COMMON], args)]
        launcher = subprocess.Popen(command, cwd=ROOT, env=env,
                                    stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, psutil.Process] = {}
    killed_pid, killed_at = None, None
    deadline = time.monotonic() + timeout_s
    try:
        while launcher.poll() is None:
            assert time.monotonic() < deadline, f"the launch did not end:\n{log.read_text()[-4000:]}"
            try:
                seen.update((c.pid, c) for c in psutil.Process(launcher.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            if killed_pid is None and (out / f"checkpoint-{after}").is_dir():
                victims = [p for p in seen.values() if p.is_running() and rank_of(p) == victim]
                assert victims, f"no worker of rank {victim}"
                # The training process itself (a worker may have children of its own, which carry RANK too).
                worker = min(victims, key=lambda p: len(p.parents()))
                worker.send_signal(signal.SIGKILL)
                killed_pid, killed_at = worker.pid, time.monotonic()
            time.sleep(0.05)
        ended = time.monotonic()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert killed_pid is not None, f"the run ended before checkpoint-{after} was seen:\n{log.read_text()[-4000:]}"
    psutil.wait_procs(list(seen.values()), timeout=10)
    leftover = [pid for pid, p in seen.items() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return KilledLaunch(launcher.returncode, killed_pid, ended - killed_at, log.read_text(), leftover)


def assert_ended_naming_the_dead_rank(run_: KilledLaunch, victim: int, out: Path) -> Path:
    """The launch failed within the bound, left no process, and a survivor's line names the dead rank and the
    checkpoint to resume from (the newest intact one, which ``latest`` picks); returns that checkpoint."""
    print(f"\nthe launch ended {run_.ended_after_kill_s:.1f} s after rank {victim} was killed")
    assert run_.returncode != 0, run_.log[-4000:]
    assert run_.ended_after_kill_s < ENDS_WITHIN_S, run_.ended_after_kill_s
    assert not run_.leftover, f"processes left behind: {run_.leftover}"
    assert "Saved the model and tokenizer" not in run_.log  # the kill came mid-run
    died = re.search(rf"process {victim} \(pid {run_.killed_pid}\) died .*; resume with --resume_from_checkpoint latest "
                     rf"\(or auto\): the newest complete checkpoint is (\S+)\.", run_.log)
    assert died, run_.log[-6000:]
    newest = Path(died.group(1))
    assert newest == resolve_checkpoint("latest", out)
    assert int(newest.name.split("-")[1]) >= 2
    return newest


def test_zero3_rank_killed_ends_the_launch_and_latest_resumes_exactly(tiny_model_dir, rollouts_file, tmp_path):
    prefix = accelerate("zero3_cpu.yaml")
    args = ["--model", tiny_model_dir, "--rollouts_path", str(rollouts_file), "--rollouts_per_step", "8",
            "--max_steps", "8"]
    run(prefix, tmp_path / "full", args, tmp_path / "full.log")

    out = tmp_path / "killed"
    killed = launch_and_kill(prefix, out, args + SAVE_EVERY_STEP, tmp_path / "killed.log", victim=1, after=2)
    newest = assert_ended_naming_the_dead_rank(killed, 1, out)

    log = run(prefix, out, args + ["--resume_from_checkpoint", "latest"], tmp_path / "resumed.log")
    assert logged_steps(log)[0] == int(newest.name.split("-")[1]) + 1
    assert_equal_parameters(out, tmp_path / "full", initial=newest)


def test_live_rank0_with_the_engine_killed_then_latest_resumes_exactly(tiny_model_dir, tmp_path):
    """k = 1: the killed rank 0 held the engine, the generator one step ahead and the rollouts file; the checkpoint
    holds the batch generated ahead, and the resumed run regenerates nothing twice."""
    prefix = accelerate("ddp_cpu.yaml")
    args = ["--model", tiny_model_dir, *LIVE, "--max_off_policy_steps", "1", "--max_steps", "6"]
    run(prefix, tmp_path / "full", args + ["--save_rollouts_path", str(tmp_path / "full.jsonl")], tmp_path / "full.log")

    out, rollouts = tmp_path / "killed", tmp_path / "killed.jsonl"
    killed = launch_and_kill(prefix, out, args + SAVE_EVERY_STEP + ["--save_rollouts_path", str(rollouts)],
                             tmp_path / "killed.log", victim=0, after=2)
    newest = assert_ended_naming_the_dead_rank(killed, 0, out)

    log = run(prefix, out, args + ["--save_rollouts_path", str(rollouts), "--resume_from_checkpoint", "latest"],
              tmp_path / "resumed.log")
    assert logged_steps(log)[0] == int(newest.name.split("-")[1]) + 1
    assert_equal_parameters(out, tmp_path / "full", initial=newest)
    assert rollouts.read_bytes() == (tmp_path / "full.jsonl").read_bytes()


def test_elastic_restart_resumes_by_itself_and_equals_the_uninterrupted_run(tiny_model_dir, rollouts_file, tmp_path):
    """``accelerate launch --max_restarts 1`` (torch elastic, static rendezvous as in accelerate_configs/) and the
    same command as the first launch: ``--resume_from_checkpoint auto``."""
    prefix = accelerate("ddp_cpu.yaml")
    args = ["--model", tiny_model_dir, "--rollouts_path", str(rollouts_file), "--rollouts_per_step", "8",
            "--max_steps", "8"]
    run(prefix, tmp_path / "full", args, tmp_path / "full.log")

    out = tmp_path / "elastic"
    restarted = launch_and_kill(prefix + ["--max_restarts", "1"], out,
                                args + SAVE_EVERY_STEP + ["--resume_from_checkpoint", "auto"], tmp_path / "elastic.log",
                                victim=1, after=2)
    log = restarted.log
    assert restarted.returncode == 0, log[-6000:]
    assert not restarted.leftover, f"processes left behind: {restarted.leftover}"
    # The first attempt started fresh (auto, no checkpoint yet); the restart resumed from a checkpoint of the first.
    assert "restart 1 of this launch (torch elastic): resuming from" in log, log[-6000:]
    resumed_from = Path(re.search(r"restart 1 of this launch \(torch elastic\): resuming from (\S+)\.", log).group(1))
    step = int(resumed_from.name.split("-")[1])
    assert resumed_from.parent == out and step >= 2
    assert f"process 1 (pid {restarted.killed_pid}) died" in log
    # The first attempt started at step 1 and got past the checkpoint; the restart trained the steps after it.
    first, restart = log.split("restart 1 of this launch")
    assert logged_steps(first)[0] == 1 and logged_steps(first)[-1] >= step
    assert logged_steps(restart) == list(range(step + 1, 9))
    assert_equal_parameters(out, tmp_path / "full", initial=resumed_from)
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == [f"checkpoint-{n}" for n in range(1, 9)]


# --- the survivor's side, on its own -------------------------------------------------------------------------------

SURVIVOR = """
import os, sys, time
from verifiers_rl.training import distributed
from verifiers_rl.training.preemption import PreemptionSignal
distributed._peers = [(distributed.socket.gethostname(), os.getpid()), (distributed.socket.gethostname(), int(sys.argv[1]))]
signals = PreemptionSignal(lambda: distributed.lost_peer_note(0, sys.argv[2]))
signals.install()
print("ready", flush=True)
deadline = time.monotonic() + 20
while time.monotonic() < deadline and signals.received is None:
    time.sleep(0.01)  # busy in a step, outside any collective
print("flag", signals.received, flush=True)
"""


@pytest.mark.parametrize("peer", ["dead", "alive"])
def test_a_survivor_signalled_after_a_peer_died_names_it_and_exits_at_once(peer, tmp_path):
    """The launcher SIGTERMs the survivors once a worker died. A survivor busy outside a collective would finish its
    step first (a preemption) and be SIGKILLed TORCH_ELASTIC_SHUTDOWN_TIMEOUT later; it sees the dead pid instead,
    names it and the checkpoint to resume from, and exits at once. With every peer alive SIGTERM stays a
    preemption (a flag)."""
    (tmp_path / "checkpoint-3").mkdir()
    for name in ("trainer_state.json", "verifiers_rl_state.json"):
        (tmp_path / "checkpoint-3" / name).write_text("{}")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    if peer == "dead":
        other.kill()
        other.wait()
    try:
        env = launch_env(threads=None)
        survivor = subprocess.Popen([sys.executable, "-c", SURVIVOR, str(other.pid), str(tmp_path)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert survivor.stdout.readline().strip() == "ready"
        sent = time.monotonic()
        survivor.send_signal(signal.SIGTERM)
        out, err = survivor.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        other.kill()
        other.wait()
    if peer == "dead":
        assert survivor.returncode == -signal.SIGTERM and took < 5, (survivor.returncode, took, err)
        assert (f"verifiers_rl: [rank 0] process 1 (pid {other.pid}) died" in err
                and f"the newest complete checkpoint is {tmp_path / 'checkpoint-3'}. SIGTERM from the launcher: "
                    "exiting now." in err), err
        assert "flag" not in out
    else:
        assert survivor.returncode == 0 and f"flag {int(signal.SIGTERM)}" in out, (out, err)
        assert "finishing the current optimizer step" in err and "died" not in err
