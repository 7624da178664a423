"""The launcher's ``--then`` supervision (``verifiers_rl.inference.vllm.processes.run_preemptible``) on real processes
and real signals, without a vLLM server (``tests/vllm_backend/test_vllm_training.py`` runs it with one).

The signals go to this test process itself, from a helper thread, while ``run_preemptible`` holds SIGTERM and SIGINT
(it must run on the main thread, as in the launcher); the command is ``tests/inference/preemptible_cmd.py``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

from verifiers_rl.inference.vllm.processes import run_preemptible

from tests.helpers.continuous import wait_until

CMD = [sys.executable, str(Path(__file__).parent / "preemptible_cmd.py")]


def signals_seen(out: Path) -> int:
    path = out / "signals"
    return len(path.read_text().split()) if path.exists() else 0


def send_to_self(out: Path, plan: list[tuple[int, int]]) -> threading.Thread:
    """For each (signal, n): once the command is ready and has seen n signals, send ``signal`` to this process."""

    def run():
        wait_until(lambda: (out / "ready.json").exists(), timeout=60, poll=0.05)
        for sig, seen in plan:
            wait_until(lambda: signals_seen(out) >= seen, timeout=60, poll=0.05)
            os.kill(os.getpid(), sig)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def all_gone(out: Path) -> bool:
    """The command and its child (which ignores SIGTERM) have both exited."""
    return not any(_running(pid) for pid in json.loads((out / "ready.json").read_text()).values())


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_signal_is_passed_on_and_the_command_gets_time_to_finish(tmp_path):
    said = []
    # What was installed before (SIG_DFL, or e.g. the SIGTERM handler a verifiers 0.3 Environment built earlier in this
    # process installs) must be what is installed after.
    before = signal.getsignal(signal.SIGTERM)
    thread = send_to_self(tmp_path, [(signal.SIGTERM, 0)])
    code = run_preemptible(CMD + [str(tmp_path), "--delay", "1.5", "--exit", "0"], stop_grace_s=60, say=said.append)
    thread.join(5)
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    assert code == 0 and stopped["signal"] == signal.SIGTERM and stopped["slept_s"] >= 1.5
    assert "SIGTERM: passed on to the command" in said[0]
    # The command's child ignores SIGTERM: it was killed once the command had exited.
    assert all_gone(tmp_path)
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are given back


def test_a_second_signal_stops_the_command_at_once(tmp_path):
    said = []
    # The command takes SIGINT but keeps running (a checkpoint that hangs); the second Ctrl-C must not wait.
    thread = send_to_self(tmp_path, [(signal.SIGINT, 0), (signal.SIGINT, 1)])
    started = time.monotonic()
    code = run_preemptible(CMD + [str(tmp_path), "--ignore-term"], stop_grace_s=600, say=said.append)
    thread.join(5)
    assert code == 128 + signal.SIGKILL and time.monotonic() - started < 30
    assert signals_seen(tmp_path) == 1 and not (tmp_path / "stopped.json").exists()
    assert "a second signal" in said[-1] and all_gone(tmp_path)


def test_the_command_is_killed_when_its_grace_runs_out(tmp_path):
    said = []
    thread = send_to_self(tmp_path, [(signal.SIGTERM, 0)])
    started = time.monotonic()
    code = run_preemptible(CMD + [str(tmp_path), "--ignore-term"], stop_grace_s=1.5, say=said.append)
    elapsed = time.monotonic() - started
    thread.join(5)
    assert code == 128 + signal.SIGKILL and 1.5 <= elapsed < 30
    assert "did not exit within 1.5 s" in said[-1] and all_gone(tmp_path)


def test_the_exit_status_is_the_commands_and_nothing_is_left_behind(tmp_path):
    code = run_preemptible(CMD + [str(tmp_path), "--exit-now", "--exit", "3"], stop_grace_s=60, leftover_grace_s=0.5)
    assert code == 3 and all_gone(tmp_path)
