"""Decode steps on a GPU replayed from one captured CUDA graph per batch.

A GPU decode step of a small model is bound by kernel launches, not by the GPU: through transformers' forward a
step launches hundreds of kernels and the CPU time to launch them exceeds the GPU's (profiled on an H200:
benchmarks/RESULTS.md). Replaying a captured graph launches a step's kernels at once. A graph needs fixed shapes and addresses, so this step (the
mathematics of ``llama_decode``, which it extends) keeps them:

- every row of the batch stays to the end: a finished row's logits are still computed, and not returned;
- keys and values live in zeroed buffers of the batch's capacity, and each step attends over the whole buffer under
  a mask that is 1 only at the row's real positions so far (a position not yet written is masked out);
- the step's inputs (token ids, positions, mask) and the write position are device tensors, copied into before the
  replay; the write position advances inside the graph.

The first step runs eagerly on a side stream (it sets up cuBLAS and picks the attention kernel), the second is
captured and replayed, and the rest are replayed. Without a GPU (``capture=False``) the same static step runs
eagerly: the tests compare it with transformers' forward on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verifiers_rl.inference.kernels.cpu_matmul import plain
from verifiers_rl.inference.kernels.llama_decode import LlamaDecoder, of_architecture

# Llama and Qwen2 decoder layers: the same modules and mathematics (Qwen2's q/k/v projections have biases).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def supports(model: torch.nn.Module) -> bool:
    """Llama and Qwen2 models on a GPU (any dtype) whose linear layers are plain ``nn.Linear`` (no adapters, no
    replaced forward), with full attention in every layer; anything else decodes through transformers' forward."""
    if not of_architecture(model, ARCHITECTURES):
        return False
    config = model.config
    full = all(kind == "full_attention" for kind in (getattr(config, "layer_types", None) or ["full_attention"]))
    return (full and not getattr(config, "use_sliding_window", False)
            and all(plain(layer) for layer in model.modules() if isinstance(layer, torch.nn.Linear))
            and model.get_input_embeddings().weight.device.type == "cuda")


class GraphDecoder(LlamaDecoder):
    """``LlamaDecoder``'s step with fixed shapes, captured as a CUDA graph (``capture``) on the batch's first steps.

    Args:
        model: a model ``supports`` admits (or, with ``capture=False``, any Llama/Qwen2 model on any device).
        cache: the prefill's cache; its keys/values are copied into zeroed buffers of ``capacity`` positions.
        capacity: the most positions any row will hold (prompt width + most new tokens).
        capture: capture and replay the step (a GPU); False: run the same static step eagerly.
    """

    def __init__(self, model: torch.nn.Module, cache, capacity: int, capture: bool = True):
        super().__init__(model, cache, capacity)
        for keys, values in zip(self.keys, self.values):  # a masked position must hold no NaN: 0 x NaN is NaN
            keys[:, :, self.length :].zero_()
            values[:, :, self.length :].zero_()
        rows, device = self.keys[0].shape[0], self.keys[0].device
        self.live = torch.arange(rows, device=device)  # the batch rows still decoding, in the caller's order
        self.token_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.attend = torch.zeros(rows, 1, 1, capacity, dtype=torch.bool, device=device)
        self.at = torch.tensor([self.length], device=device)  # the write position, advanced by the step itself
        self.capture = capture
        self.warm = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the captured step's output

    def keep(self, index: torch.Tensor) -> None:
        """Keep returning only the rows ``index`` of those still decoding (the buffers keep every row)."""
        self.live = self.live[index.to(self.live.device)]

    def _attend(self, q, k, v, keys, values, attend, scale: float) -> torch.Tensor:
        """Written at the device position ``at``; attention over the whole buffer under the mask."""
        keys.index_copy_(2, self.at, k[:, :, None])
        values.index_copy_(2, self.at, v[:, :, None])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=scale)

    def _static_step(self) -> torch.Tensor:
        """Logits ``[all rows, vocab]`` from the static inputs; writes this position's keys/values, advances it."""
        logits = self._forward(self.token_ids, self.positions, self.attend)
        self.at += 1
        return logits

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """As ``LlamaDecoder.step``, for the rows still decoding (``keep``)."""
        live = self.live
        self.token_ids.index_copy_(0, live, token_ids)
        self.positions.index_copy_(0, live, positions)
        self.attend[:, 0, 0, : mask.shape[1]].index_copy_(0, live, mask.bool())
        self.length += 1
        if not self.capture:
            return self._static_step()[live]
        if self.graph is None and not self.warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._static_step()
            torch.cuda.current_stream().wait_stream(side)
            self.warm = True
            return logits[live]
        if self.graph is None:  # captured, not run: the replay below runs this step
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the process's other threads (environments, a user's) may go on launching kernels
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.logits = self._static_step()
        self.graph.replay()
        return self.logits[live]
