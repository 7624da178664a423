"""A decode step for Llama-architecture models on CPU with fewer, larger ops than transformers' forward.

A decode step computes one new position per row. With a handful of rows its matmuls are small, and transformers'
forward (masks, cache objects, dozens of tensor ops per layer) costs about as much again as the matmuls (profiled:
benchmarks/embedded_decode.py). This step runs the same mathematics with the model's own modules, per layer:

    a = rms(h) * w_in;  q, k, v = a Wq^T, a Wk^T, a Wv^T;  q, k = rope(q), rope(k)
    h = h + softmax(q K^T / sqrt(d) + pad mask) V Wo^T            (query heads grouped on their key/value head)
    m = rms(h) * w_post;  h = h + (act(m Wg^T) * (m Wu^T)) Wd^T
    logits = (rms(h) * w_norm) W_out^T

with keys and values written into preallocated buffers (no per-step concatenation) and the engine's matmuls
(``cpu_matmul``: oneDNN-packed weights or weight-major). It equals transformers' forward to float rounding (another
summation order), and reads the model's own parameters at each call, so weight loads apply without a rebuild (packed
weights: once the engine has re-packed them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from verifiers_rl.inference.kernels.cpu_matmul import applies
from verifiers_rl.inference.kernels.cpu_matmul import Linear


def of_architecture(model: torch.nn.Module, architectures: dict[str, str]) -> bool:
    """``model``'s class is a key of ``architectures`` (class name -> ``model_type``) with its own model type, its
    matmuls unsplit (``pretraining_tp`` 1): the layers ``LlamaDecoder`` reads."""
    config = getattr(model, "config", None)
    expected = architectures.get(type(model).__name__)
    return (expected is not None and getattr(config, "model_type", None) == expected
            and getattr(config, "pretraining_tp", 1) == 1)


def supports(model: torch.nn.Module) -> bool:
    """Plain Llama models (``LlamaForCausalLM``: Llama, SmolLM2, ...) whose linear layers are fp32 on CPU; anything
    else decodes through transformers' forward."""
    return (of_architecture(model, {"LlamaForCausalLM": "llama"})
            and all(applies(layer) for layer in model.modules() if isinstance(layer, torch.nn.Linear)))


class LlamaDecoder:
    """Decodes from a transformers ``DynamicCache`` (a prefill's) onward, one position per row per ``step``.

    Args:
        model: a model ``supports`` admits.
        cache: the prefill's cache; its keys/values are copied into buffers of ``capacity`` positions.
        capacity: the most positions any row will hold (prompt width + most new tokens).
        linear: the linear layers' product (``cpu_matmul``: ``weight_major``, a ``PackedWeights``' ``linear``);
            None: ``F.linear``.
        max_rows: rows the buffers hold (default: the cache's); a step computes the first ``rows`` of them, so
            rows can join (``RunningBatch`` writes their keys/values into the free ones) without new buffers.
    """

    def __init__(self, model: torch.nn.Module, cache, capacity: int, linear: Linear | None = None,
                 max_rows: int | None = None):
        self.model = model
        self.linear = linear or (lambda x, layer: F.linear(x, layer.weight, layer.bias))
        self.layers = model.model.layers
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        first = cache.layers[0].keys
        self.rows, self.length = first.shape[0], first.shape[2]
        shape = (max(self.rows, max_rows or 0), self.kv_heads, capacity, self.head_dim)
        self.keys = [first.new_empty(shape) for _ in self.layers]
        self.values = [first.new_empty(shape) for _ in self.layers]
        for keys, values, layer in zip(self.keys, self.values, cache.layers):
            keys[: self.rows, :, : self.length] = layer.keys
            values[: self.rows, :, : self.length] = layer.values

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the batch rows ``index`` (finished rows leave)."""
        self.keys = [keys.index_select(0, index) for keys in self.keys]
        self.values = [values.index_select(0, index) for values in self.values]
        self.rows = len(index)

    def fill_holes(self, holes: torch.Tensor, movers: torch.Tensor, rows: int) -> None:
        """Keep the first ``rows`` rows, row ``movers[i]`` (at or past ``rows``) copied into the leaving row
        ``holes[i]``: the leaving rows' buffers are reused in place, only the moved rows' positions so far copied
        (a step writes a position before any step reads it)."""
        if len(holes):
            for keys, values in zip(self.keys, self.values):
                keys[holes, :, : self.length] = keys[movers, :, : self.length]
                values[holes, :, : self.length] = values[movers, :, : self.length]
        self.rows = rows

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the next token after ``token_ids`` ``[rows]``, at ``positions`` ``[rows]``;
        ``mask`` ``[rows, length + 1]``: 1 where a cached position (and this one) is a real token."""
        # Additive, [rows, 1, 1, length] (over key/value heads and query groups): made once for every layer.
        dtype = self.keys[0].dtype
        attend = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, float("-inf"))
        logits = self._forward(token_ids, positions, attend[:, None, None, :])
        self.length += 1
        return logits

    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """The step's mathematics (above) for ``token_ids`` at ``positions`` under the pad mask ``attend``; each
        layer's keys/values are written and attended through ``_attend``."""
        rows = token_ids.shape[0]
        h = self.model.model.embed_tokens(token_ids)
        cos, sin = self.model.model.rotary_emb(h, positions)  # [rows, head_dim]: broadcast over heads below
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            if keys.shape[0] != rows:  # buffers with free rows (``max_rows``): the running ones only
                keys, values = keys[:rows], values[:rows]
            attention, mlp = layer.self_attn, layer.mlp
            a = layer.input_layernorm(h)
            q, k = apply_rotary_pos_emb(self.linear(a, attention.q_proj).view(rows, self.heads, self.head_dim),
                                        self.linear(a, attention.k_proj).view(rows, self.kv_heads, self.head_dim),
                                        cos, sin, unsqueeze_dim=1)
            v = self.linear(a, attention.v_proj).view(rows, self.kv_heads, self.head_dim)
            # Query head j reads key/value head j // (heads / kv_heads) (transformers' repeat_kv): one query
            # position, so a head's group stands where the query positions would.
            o = self._attend(q.view(rows, self.kv_heads, -1, self.head_dim), k, v, keys, values, attend,
                             attention.scaling)
            h = h + self.linear(o.reshape(rows, -1), attention.o_proj)
            m = layer.post_attention_layernorm(h)
            h = h + self.linear(mlp.act_fn(self.linear(m, mlp.gate_proj)) * self.linear(m, mlp.up_proj), mlp.down_proj)
        return self.linear(self.model.model.norm(h), self.model.lm_head)

    def _attend(self, q, k, v, keys, values, attend, scale: float) -> torch.Tensor:
        """This position's ``k``/``v`` written into the buffers at ``length``, then ``q`` attends to the positions so
        far: softmax(q K^T * scale + attend) V as two batched matmuls (one query position: CPU sdpa's kernel costs
        more a call at these small head counts)."""
        at = self.length
        keys[:, :, at] = k
        values[:, :, at] = v
        scores = torch.matmul(q, keys[:, :, : at + 1].transpose(-1, -2)).mul_(scale).add_(attend)
        return torch.matmul(torch.softmax(scores, dim=-1), values[:, :, : at + 1])
