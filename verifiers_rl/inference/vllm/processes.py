"""Process trees for the vLLM launcher: stop a server with everything it spawned, and run a command that can be
preempted (a job scheduler's SIGTERM reaches it, it gets time to checkpoint, nothing is left behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable

import psutil


class ProcessFamily:
    """A process started in its own session, its descendants as seen so far, and whatever else is in its process
    group (children the root's death orphaned: vLLM's engine core and workers outlive a killed API server)."""

    def __init__(self, pid: int):
        self.pgid = pid
        self._seen: dict[int, psutil.Process] = {}
        try:
            self._seen[pid] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            pass
        self.refresh()

    def refresh(self) -> None:
        """Remember the descendants alive now (a process that leaves the group is still found through them)."""
        for process in list(self._seen.values()):
            try:
                for child in process.children(recursive=True):
                    self._seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass

    def alive(self) -> list[psutil.Process]:
        self.refresh()
        members = {pid: p for pid, p in self._seen.items() if _running(p)}
        for process in psutil.process_iter():
            try:
                if process.pid not in members and os.getpgid(process.pid) == self.pgid and _running(process):
                    members[process.pid] = process
            except ProcessLookupError:
                pass
        return list(members.values())

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every live member."""
        for process in self.alive():
            try:
                process.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every member, SIGKILL those still running after ``grace_s``, and wait until all are gone."""
        self.signal(signal.SIGTERM)
        _, running = psutil.wait_procs(self.alive(), timeout=grace_s)
        while running:
            for process in running:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            _, running = psutil.wait_procs(self.alive(), timeout=5.0)


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie (an exited child its parent has not reaped yet holds nothing)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Signals:
    """Records SIGTERM / SIGINT instead of acting on them, for the length of a ``with`` block."""

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_preemptible(command: list[str], stop_grace_s: float, say: Callable[[str], None] = print,
                    leftover_grace_s: float = 5.0, poll_s: float = 0.1) -> int:
    """Run ``command`` in its own session until it exits and return its exit status (128 + N if signal N ended
    it). Must be called from the main thread (it takes SIGTERM and SIGINT over while the command runs).

    The first SIGTERM / SIGINT is forwarded to the command's process tree, which then gets ``stop_grace_s`` to
    exit (a trainer finishes its step and writes a checkpoint); a second signal, or the end of the grace, kills
    the tree at once. When the command has exited, whatever it left running is stopped too (SIGTERM, then SIGKILL
    after ``leftover_grace_s``).
    """
    with _Signals() as signals:
        process = subprocess.Popen(command, start_new_session=True)
        family = ProcessFamily(process.pid)
        handled, deadline = 0, None
        try:
            while process.poll() is None:
                family.refresh()
                if len(signals.received) > handled:
                    if handled == 0:
                        name = signal.Signals(signals.received[0]).name
                        say(f"{name}: passed on to the command; waiting up to {stop_grace_s:g} s for it to exit "
                            "(a second signal stops it at once)")
                        family.signal(signals.received[0])
                        deadline = time.monotonic() + stop_grace_s
                    else:
                        say("a second signal: stopping the command now")
                        family.signal(signal.SIGKILL)
                    handled = len(signals.received)
                elif deadline is not None and time.monotonic() > deadline:
                    say(f"the command did not exit within {stop_grace_s:g} s of the signal: stopping it now")
                    family.signal(signal.SIGKILL)
                    deadline = None
                time.sleep(poll_s)
        finally:
            if process.poll() is None:
                family.signal(signal.SIGKILL)
                process.wait()
            family.stop(grace_s=leftover_grace_s)
    code = process.returncode
    return 128 - code if code < 0 else code
