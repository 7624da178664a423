"""What every rank must agree on: results only the main process can compute, lost peers, the stop signal.

A rank that waits in a collective for a peer that failed would wait until ``--ddp_timeout``; these helpers hand the
main process's error to every rank instead, and name a lost peer when a collective fails.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


class MainProcessError(RuntimeError):
    """Raised on every rank when the main process failed to produce what all ranks wait for."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def main_process_outcome(compute: Callable[[], Any], scatter: bool = False) -> Any:
    """Run ``compute`` on rank 0 and hand its result (or its error) to every rank, so no rank waits forever.

    With ``scatter``, ``compute`` returns one object per rank and each rank receives its own.
    """
    rank, world = _world()
    if world == 1:
        result = compute()
        return result[0] if scatter else result
    outcome: list[Any]
    error = None
    if rank == 0:
        try:
            result = compute()
            outcome = [("ok", item) for item in result] if scatter else [("ok", result)]
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
            outcome = [("error", f"{type(exc).__name__}: {exc}")] * (world if scatter else 1)
    else:
        outcome = [None] * (world if scatter else 1)
    if scatter:
        received: list[Any] = [None]
        dist.scatter_object_list(received, outcome if rank == 0 else None, src=0)
        status, payload = received[0]
    else:
        dist.broadcast_object_list(outcome, src=0)
        status, payload = outcome[0]
    if status == "error":
        if error is not None:
            raise error
        raise MainProcessError(f"The main process failed: {payload}")
    return payload


def agreed_max(local: int, device) -> int:
    """The largest of every rank's ``local`` (one all-reduce; ``local`` itself in a single process)."""
    if _world()[1] == 1:
        return local
    flag = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


# gloo reports a lost peer as a plain RuntimeError; these are the messages seen for a killed or a stopped peer (in a
# collective, or in DDP's all-reduce during backward).
_GLOO_PEER_LOST = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "caused pair closure",
                   "Timed out waiting")


def is_collective_failure(exc: BaseException) -> bool:
    """A collective that lost its peers: torch's distributed errors (NCCL's), or gloo's plain RuntimeErrors."""
    return isinstance(exc, dist.DistError) or any(marker in str(exc) for marker in _GLOO_PEER_LOST)


# Every rank's (host, pid), gathered once at start-up (``record_peers``): a rank that finds a peer gone can name it.
_peers: list[tuple[str, int]] | None = None


def record_peers() -> None:
    """Gather every rank's host name and pid (one all-gather; nothing in a single process)."""
    global _peers
    rank, world = _world()
    if world == 1:
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (socket.gethostname(), os.getpid()))
    _peers = [tuple(peer) for peer in gathered]


def dead_peers(wait_s: float = 0.0) -> list[tuple[int, int]]:
    """(rank, pid) of every other process of this launch on this machine that no longer runs (gone or a zombie);
    a process on another machine cannot be seen from here. ``wait_s``: look again for up to that long while none is
    found (a killed process closes its sockets, failing our collective, a moment before it is a zombie)."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = _dead_peers_now()
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def _dead_peers_now() -> list[tuple[int, int]]:
    import psutil

    if _peers is None:
        return []
    here, me = socket.gethostname(), os.getpid()
    dead = []
    for rank, (host, pid) in enumerate(_peers):
        if host != here or pid == me:
            continue
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            dead.append((rank, pid))
    return dead


def _died(dead: list[tuple[int, int]]) -> str:
    names = ", ".join(f"process {rank} (pid {pid})" for rank, pid in dead)
    return f"{names} died (killed: SIGKILL, the out-of-memory killer, or a crash in its own log)"


def resume_advice(output_dir: str | None) -> str:
    """How to go on after a run ended early: the newest intact checkpoint to resume from, or that there is none."""
    from verifiers_rl.training.run_state import newest_complete_checkpoint

    try:
        newest = newest_complete_checkpoint(output_dir) if output_dir else None
    except OSError:
        newest = None
    if newest is None:
        return f"no checkpoint in --output_dir {output_dir} yet: a new launch starts from the beginning"
    return f"resume with --resume_from_checkpoint latest (or auto): the newest complete checkpoint is {newest}"


def collective_failure_note(num_processes: int, process_index: int, timeout_s: int, output_dir: str | None = None) -> str:
    """The note added to a failed collective's error: which process saw it, which peer died (when it ran on this
    machine), what to look at, how to go on."""
    dead = dead_peers(wait_s=2.0)
    cause = (_died(dead) if dead else
             f"another process died (the launcher names it; its own log has the cause) or stopped answering (given up "
             f"after --ddp_timeout, now {timeout_s} s)")
    return (f"verifiers_rl: a collective between the {num_processes} processes failed on process {process_index}: "
            f"{cause}; {resume_advice(output_dir)}.")


def lost_peer_note(process_index: int, output_dir: str | None) -> str | None:
    """When a process of this launch on this machine has died: the line a survivor prints before it exits (the
    launcher is ending the launch; no step can finish without the dead one). None while every peer runs."""
    dead = dead_peers()
    if not dead:
        return None
    return f"verifiers_rl: [rank {process_index}] {_died(dead)}; {resume_advice(output_dir)}."


GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def _thread_states(name: str) -> list[str] | None:
    """The scheduler states (``R``, ``S``, ...) of this process's threads called ``name``; None without ``/proc``."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    states = []
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() == name:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:  # the thread ended meanwhile
            continue
    return states


def wait_for_idle_gloo_workers(timeout_s: float = 10.0, poll_s: float = 0.01, quiet_polls: int = 3) -> int | None:
    """Wait (up to ``timeout_s``) until every gloo worker thread has slept through ``quiet_polls`` polls in a row;
    the number of such threads, or None where threads cannot be seen (no ``/proc``) or the wait timed out.

    Why: a worker destroys a finished collective, and with it the last reference to its tensors, just after the
    caller's ``wait`` returned. If the interpreter is shutting down by then, the worker cannot take the GIL to
    release a Python-owned tensor and the process aborts ("terminate called without an active exception", exit -6;
    seen after every rank finished, torch 2.13, pytorch/pytorch#190489). ``destroy_process_group`` does not join the
    workers while DDP or DeepSpeed still hold the group. Sleeping here releases the GIL, so a worker waiting for it
    runs; a worker seen asleep (not merely runnable) on consecutive polls is idle.
    """
    deadline, quiet = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        states = _thread_states(GLOO_WORKER_THREAD)
        if states is None:
            return None
        quiet = quiet + 1 if all(state == "S" for state in states) else 0
        if quiet >= quiet_polls:
            return len(states)
        time.sleep(poll_s)
    return None


def leave_process_group() -> int | None:
    """Once every rank is done, leave the process group explicitly and let gloo's workers finish
    (``wait_for_idle_gloo_workers``, whose result it returns): a gloo group left to interpreter exit has aborted
    finished ranks ("terminate called without an active exception", exit -6), DDP and ZeRO-3 alike."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    dist.barrier()
    dist.destroy_process_group()
    return wait_for_idle_gloo_workers()
