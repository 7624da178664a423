"""The trainer's end of a vLLM weight-transfer group: rank 0 broadcasts each tensor to the server's workers.

``VLLMEngine(weight_transfer=...)`` picks how new weights reach a vLLM server:

- ``"files"``: a safetensors snapshot on a filesystem both sides see, reloaded by our worker extension.
- ``"nccl"``: GPUs. vLLM's own weight-transfer engine (server: ``--weight-transfer-config '{"backend": "nccl"}'``)
  and, on this side, vLLM's ``PyNcclCommunicator``, so ``vllm`` must be importable in the trainer's environment.
- ``"gloo"``: CPUs. The same protocol and the same vLLM engine code with a torch gloo group as communicator
  (server backend ``verifiers_rl_gloo``, registered by ``verifiers_rl/vllm_worker``); no disk.

Both collective backends follow vLLM's routes: ``/init_weight_transfer_engine`` once (the workers join a group in
which the trainer is rank 0), then per sync ``/start_weight_update``, one ``/update_weights`` per bucket (names,
dtypes, shapes) answered by broadcasts of that bucket's tensors, and ``/finish_weight_update``.
"""

from __future__ import annotations

import importlib
import socket
import time
from typing import Callable, Literal, get_args

import torch

from verifiers_rl.vllm_worker.vllm_weight_sync import GLOO_BACKEND, gloo_broadcast, gloo_group
from verifiers_rl.core.engine import is_loopback

WeightTransfer = Literal["files", "nccl", "gloo"]
TRANSFERS: tuple[str, ...] = get_args(WeightTransfer)
# What the server's --weight-transfer-config backend must be for each client-side transfer.
SERVER_BACKENDS = {"nccl": "nccl", "gloo": GLOO_BACKEND}


def address_towards(host: str) -> str:
    """This machine's address as seen from ``host``: loopback for a local server, else the interface that routes
    to it (a UDP "connect" sends nothing)."""
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def require(transfer: str) -> None:
    """Raise a clear error now if this process cannot take part in ``transfer`` (before any server waits on it)."""
    if transfer != "nccl":
        return
    if not torch.cuda.is_available():
        raise RuntimeError("weight_transfer='nccl' needs a CUDA device on the trainer; on CPU use 'gloo' or 'files'.")
    try:
        importlib.import_module("vllm.distributed.weight_transfer.nccl_common")
    except ImportError as error:
        raise RuntimeError(
            "weight_transfer='nccl' uses vLLM's NCCL communicator, so vllm must be importable in the trainer's "
            "environment (pip install the server's vllm version there), or use 'files'."
        ) from error


class TransferGroup:
    """Rank 0 of the trainer + server-workers group: ``broadcast`` enqueues, ``wait`` blocks until sent."""

    def __init__(self, backend: str, group):
        self.backend = backend
        self.group = group

    @classmethod
    def open(cls, backend: str, address: str, port: int, world_size: int, timeout_s: float,
             cuda_device: int | None = None) -> "TransferGroup":
        """Serve the rendezvous at ``address:port`` and wait for the other ``world_size - 1`` ranks to join.

        ``cuda_device`` (nccl): the caller's device; the current CUDA device is per thread, and this may run on
        another thread than the broadcasts."""
        if backend == "gloo":
            return cls(backend, gloo_group(address, port, 0, world_size, timeout_s))
        if backend == "nccl":
            require(backend)
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            group = trainer_init({"master_address": address, "master_port": port, "world_size": world_size})
            return cls(backend, group)
        raise ValueError(f"Unknown collective weight transfer {backend!r}; expected 'nccl' or 'gloo'.")

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """A private contiguous copy on the device this backend sends from (the stream's tensors are transient)."""
        device = "cpu" if self.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        return tensor.detach().to(device, copy=True).contiguous()

    def broadcast(self, tensor: torch.Tensor):
        if self.backend == "gloo":
            return gloo_broadcast(self.group, tensor)
        self.group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
        return None

    def wait(self, handles: list, failed: Callable[[], BaseException | None]) -> None:
        """Block until every broadcast is done; if ``failed()`` reports the server's side gave up first, raise it
        (a receiver that never comes would otherwise hold the sender until the group's timeout)."""
        if self.backend == "gloo":
            pending = [work for work in handles if work is not None]
            done = lambda: all(work.is_completed() for work in pending)  # noqa: E731
        else:
            event = torch.cuda.Event()
            event.record()
            done = event.query
        while not done():
            error = failed()
            if error is not None:
                raise error
            time.sleep(0.002)
        for work in handles:
            if work is not None:
                work.wait()  # raises a broadcast's own error (a peer that dropped its connection)

    def close(self) -> None:
        if self.backend == "nccl" and self.group is not None:
            self.group.destroy()
        self.group = None
