"""``sync_ref_model`` under LoRA: the reference model is the base model with a reference copy of the adapters.

TRL's ``SyncRefModelCallback`` mixes a separate reference model towards the policy, parameter by parameter:
``ref = alpha * policy + (1 - alpha) * ref`` every ``ref_model_sync_steps`` optimizer steps. Under PEFT TRL keeps no
reference model (the base model, adapters disabled, is the reference) and refuses the option. Here the same mix is
applied to the only parameters that differ between the two: the trainable ones (LoRA's A and B, ``modules_to_save``).
The frozen base is shared, and mixing it with itself leaves it as it is, so this is TRL's mix of the two whole models.
At the start the copies equal the initial adapters, whose B is zero: the reference is the base model, as without
``sync_ref_model``.

The reference forward swaps the copies into the adapters' parameters and back (no gradient flows there). Each rank
holds whole parameters (one process or DDP), and every rank mixes the same values, so the ranks stay equal. ZeRO-3
partitions the parameters across ranks; there the swap is not implemented and the option is refused.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import TrainerCallback


def _buffer_name(parameter_name: str) -> str:
    return parameter_name.replace(".", "__")  # buffer names cannot hold dots


class AdapterReference(torch.nn.Module):
    """Copies of ``model``'s trainable parameters (its adapters), as buffers: what a checkpoint saves.

    ``mix(alpha)``: ``copy = alpha * parameter + (1 - alpha) * copy``. ``swapped()``: inside the block the adapters
    hold the copies, so a forward of ``model`` is the reference model's.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self._parameters_of = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self._parameters_of:
            raise ValueError("sync_ref_model under PEFT needs trainable adapter parameters; the model has none.")
        for name, parameter in self._parameters_of.items():
            self.register_buffer(_buffer_name(name), parameter.detach().clone())

    def _pairs(self):
        for name, parameter in self._parameters_of.items():
            yield parameter, getattr(self, _buffer_name(name))

    @torch.no_grad()
    def mix(self, alpha: float) -> None:
        """TRL's ``_sync_target_model`` on the adapters: ``copy.mul_(1 - alpha).add_(parameter, alpha=alpha)``."""
        for parameter, copy in self._pairs():
            copy.mul_(1.0 - alpha).add_(parameter.detach(), alpha=alpha)

    @contextlib.contextmanager
    def swapped(self):
        """The adapters hold the reference copies inside the block (their own values come back after it)."""
        saved = [(parameter, parameter.data) for parameter, _ in self._pairs()]
        try:
            for parameter, copy in self._pairs():
                parameter.data = copy
            yield
        finally:
            for parameter, data in saved:
                parameter.data = data


class AdapterReferenceCallback(TrainerCallback):
    """TRL's schedule: after every ``ref_model_sync_steps``-th optimizer step, ``reference.mix(alpha)``."""

    def __init__(self, reference: AdapterReference):
        self.reference = reference

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.reference.mix(args.ref_model_mixup_alpha)
