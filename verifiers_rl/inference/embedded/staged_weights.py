"""Atomic weight loads into a model: every tensor checked and staged as it arrives, then all swapped in at once."""

from __future__ import annotations

import threading
from typing import Iterable

import torch

from verifiers_rl.core.modeling import strip_wrappers


class StagedWeights:
    """The loadable tensors of ``model`` (parameters and buffers, tied names included) by name.

    ``stage`` checks each ``(name, tensor)`` (the trainer's names; wrapper prefixes removed) and copies it aside as it
    arrives (a producer may reuse a tensor's memory once the next item is asked for); ``apply`` copies the staged
    tensors into the model in one step. So a load that fails part-way (unknown name, wrong shape, a failing producer)
    changes nothing. The price is one extra copy of the weights sent, kept from one load to the next: a fresh copy at
    every load spends most of its time in page faults. Hold ``staging`` from ``stage`` to ``apply``: the copies are
    reused, so two loads must not interleave.
    """

    def __init__(self, model: torch.nn.Module):
        tie_output_to_input(model)
        self.model_name = type(model).__name__
        self.targets = dict(model.named_parameters(remove_duplicate=False))
        self.targets.update(model.named_buffers(remove_duplicate=False))
        self.staging = threading.Lock()
        self._copies: dict[str, torch.Tensor] = {}  # by name: the staging memory, reused by later loads

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        staged = []
        for name, tensor in named_tensors:
            key = strip_wrappers(name, keep=self.targets.__contains__)
            target = self.targets.get(key)
            if target is None:
                raise KeyError(f"Unknown weight {name!r}: the engine's {self.model_name} has no such parameter.")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"Weight {name!r} has shape {tuple(tensor.shape)}, the engine expects {tuple(target.shape)}."
                )
            copy = self._copies.get(key)
            if copy is None or copy.shape != target.shape or copy.dtype != target.dtype or copy.device != target.device:
                copy = self._copies[key] = torch.empty_like(target, requires_grad=False)
            staged.append((target, copy.copy_(tensor.detach())))
        return staged

    @staticmethod
    @torch.no_grad()
    def apply(staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for target, tensor in staged:
            target.copy_(tensor)


def tie_output_to_input(model: torch.nn.Module) -> None:
    """With tied embeddings the output layer must BE the input embedding, so loading the (deduplicated)
    ``embed_tokens`` name updates the head too (the stale-head bug vLLM on CPU has)."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(text_config, "tie_word_embeddings", False) and head is not None and head.weight is not embed.weight:
        head.weight = embed.weight
