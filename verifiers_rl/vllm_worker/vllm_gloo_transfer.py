"""vLLM's NCCL weight-transfer engine, carried over a torch gloo group: the same protocol for CPU servers.

Registered with vLLM as the weight-transfer backend ``verifiers_rl_gloo`` when the worker extension is imported
(``vllm_weight_sync.py``); a server started with ``--weight-transfer-config '{"backend": "verifiers_rl_gloo"}'``
then takes weights from the trainer through vLLM's own routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``), with tensors broadcast from the trainer
(rank 0) instead of written to disk. Only the communicator differs from ``nccl``: the trainer's client code is the
same for both, so this backend is also how the NCCL path's control flow is tested on machines without a GPU.

Runs in the vLLM venv: standard library, torch and vllm only (no verifiers_rl imports).
"""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo
from vllm_weight_sync import GLOO_BACKEND, gloo_broadcast, gloo_group, refresh_tied_lm_head


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """Receives a round's tensors by gloo broadcasts from rank 0, then loads them (vLLM's layerwise reload)."""

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        if init_info.packed:
            raise ValueError(f"The {GLOO_BACKEND} weight transfer sends tensors one by one; packed=True is not supported.")
        if init_info.master_address is None or init_info.master_port is None:
            raise ValueError(f"The {GLOO_BACKEND} weight transfer needs master_address and master_port.")
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.packed = False
        # A broadcast waits while the trainer gathers the next ZeRO-3 bucket; a dead trainer is noticed sooner
        # (its connection drops), so the bound only matters for a stuck one.
        self.model_update_group = gloo_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, timeout_s=600.0
        )

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError(f"The {GLOO_BACKEND} weight transfer is not initialized: call init_weight_transfer_engine.")
        weights = [
            torch.empty(shape, dtype=getattr(torch, dtype_name), device="cpu")
            for dtype_name, shape in zip(update_info.dtype_names, update_info.shapes)
        ]
        # All of the round's broadcasts in flight at once, then one load_weights call: the round's size (the
        # client's weight_transfer_bucket_mb) bounds the memory this holds.
        for work in [gloo_broadcast(self.model_update_group, weight) for weight in weights]:
            work.wait()
        self.model.load_weights(list(zip(update_info.names, weights)))

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has no CPU device to wait for.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        refresh_tied_lm_head(self.model, self.model_config)

    def shutdown(self) -> None:
        self.model_update_group = None  # a ProcessGroupGloo closes its connections when collected
