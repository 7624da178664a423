"""What every rank must agree on: results only the main process can compute, lost peers, the stop signal.

A rank that waits in a collective for a peer that failed would wait until ``--ddp_timeout``; these helpers hand the
main process's error to every rank instead, and name a lost peer when a collective fails.
"""

from __future__ import annotations

import os
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


def collective_failure_note(num_processes: int, process_index: int, timeout_s: int, output_dir: str | None = None) -> str:
    """The note added to a failed collective's error: which process saw it, what to look at, how to go on."""
    from transformers.trainer_utils import get_last_checkpoint

    newest = get_last_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
    resume = (f"resume with --resume_from_checkpoint latest (or auto): the newest complete checkpoint is {newest}"
              if newest else f"no checkpoint in --output_dir {output_dir} yet: a new launch starts from the beginning")
    return (
        f"verifiers_rl: a collective between the {num_processes} processes failed on process {process_index}: "
        f"another process died (the launcher names it; its own log has the cause) or stopped answering (given up "
        f"after --ddp_timeout, now {timeout_s} s); {resume}."
    )


def leave_process_group() -> None:
    """Once every rank is done, leave the process group explicitly: a gloo group left to interpreter exit has
    aborted finished ranks ("terminate called without an active exception", exit -6), DDP and ZeRO-3 alike."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
