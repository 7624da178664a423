"""Every place verifiers_rl reaches into a private part of TRL, transformers, Accelerate or DeepSpeed.

Each function below exists because the library has no public API for what we need; its comment names the version
it was written against. ``tests/test_compat.py`` checks each assumption against the installed versions, so an
upgrade that changes one fails there, by name, rather than somewhere in a training run.
Imports stay inside the functions: the vLLM worker (another venv, without TRL) imports this module too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from typing import Any

_MISSING = object()


def step_metrics(trainer, mode: str = "train") -> dict[str, list[float]]:
    """The lists GRPOTrainer averages into each log entry (and then clears).

    trl 1.16: ``GRPOTrainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}``; ``GRPOTrainer.log``
    logs the mean of each list under its key and clears them.
    """
    return trainer._metrics[mode]


def log_outside_training(trainer, metrics: dict[str, float]) -> None:
    """Log ``metrics`` as the plain HF Trainer does, without the training metrics gathered since the last log.

    trl 1.16: ``GRPOTrainer.log`` merges (and clears) ``_metrics["train"]`` into every log call, so an evaluation
    logged through it would flush half a logging window; transformers 5.23's ``Trainer.log`` does not.
    """
    from transformers import Trainer

    Trainer.log(trainer, metrics)


def set_sync_gradients(accelerator, value: bool) -> None:
    """Tell Accelerate whether the coming backward is the last of the step (DDP all-reduces, DeepSpeed steps).

    accelerate 1.15: ``GradientState._set_sync_gradients`` (its public ``accumulate`` context sets it from a step
    counter that our one-call-per-step loop does not advance).
    """
    accelerator.gradient_state._set_sync_gradients(value)


@contextlib.contextmanager
def replaced_forward(module, forward):
    """Run ``module`` with ``forward`` in place of its forward, then put back exactly what was there.

    torch 2.13: an instance attribute ``forward`` shadows the class's. trl 1.16's ``cast_lm_head_to_fp32`` installs
    one on the output layer, so deleting ours afterwards would also delete TRL's: restore the previous attribute.
    """
    previous = module.__dict__.get("forward", _MISSING)
    module.forward = forward
    try:
        yield module
    finally:
        if previous is _MISSING:
            del module.forward
        else:
            module.forward = previous


TRL_REFERENCE_ADAPTER = "ref"


def peft_reference(model):
    """A context in which the PEFT ``model`` computes what TRL takes as its KL reference.

    trl 1.16: ``GRPOTrainer.__init__`` gives a ``PeftModel`` passed with trained adapters (beta != 0) a frozen copy
    of them, the adapter ``"ref"``, and its reference forward runs under ``use_adapter(model, "ref")``; a
    ``peft_config``'s new adapters have none, and the reference is the model with its adapters disabled.
    """
    from trl.trainer.utils import use_adapter

    copied = TRL_REFERENCE_ADAPTER in getattr(model, "peft_config", {})
    return use_adapter(model, adapter_name=TRL_REFERENCE_ADAPTER if copied else None)


def reporting_backend(callback) -> Any | None:
    """The live module object (``trackio`` / ``wandb``) behind a transformers reporting callback, or None when it has
    not started a run (tensorboard has a public ``tb_writer`` and needs no help).

    transformers 5.23: ``TrackioCallback._initialized`` / ``._trackio``; ``WandbCallback._wandb`` (``.run`` None before
    ``wandb.init``).
    """
    from transformers.integrations import TrackioCallback, WandbCallback

    if isinstance(callback, TrackioCallback):
        return callback._trackio if callback._initialized else None
    if isinstance(callback, WandbCallback):
        backend = callback._wandb
        return backend if backend is not None and backend.run is not None else None
    return None


@contextlib.contextmanager
def without_zero3_init():
    """Build models on this process alone: under a ZeRO-3 launch transformers would otherwise build them with
    ``deepspeed.zero.Init``, a collective the other ranks never join.

    transformers 5.23: ``integrations.deepspeed._hf_deepspeed_config_weak_ref`` is what ``is_deepspeed_zero3_enabled``
    reads; there is no public switch.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


# Not here, by necessity: ``vllm_worker/vllm_weight_sync.gloo_group`` builds ``ProcessGroupGloo._Options`` (torch
# 2.13; the only way to give a gloo group made outside torch.distributed its timeout and device). It runs inside the
# vLLM server's venv, which cannot import this package; tests/test_compat.py checks it against our torch.


_DEFERRED = "_verifiers_rl_device_deferred"


@contextlib.contextmanager
def deferred_device_setup(args):
    """Run ``TrainingArguments.__post_init__`` without setting up the device and the process group.

    transformers 5.23: ``TrainingArguments.__post_init__`` reads ``self.device``, whose ``_setup_devices`` (a
    ``cached_property``) starts a launched process's process group; trl 1.16's ``GRPOConfig.__post_init__`` reads
    ``self.device.type`` (a "neuron" check) and ``self.world_size`` (its own generation batch, which RLConfig
    replaces). A placeholder device stands in for the duration (``RLConfig.distributed_state`` answers None), and the
    real set-up happens at the first use after.
    """
    import torch

    args.__dict__["_setup_devices"] = torch.device("cpu")
    args.__dict__[_DEFERRED] = True
    try:
        yield
    finally:
        del args.__dict__["_setup_devices"]
        del args.__dict__[_DEFERRED]


def device_setup_deferred(args) -> bool:
    return bool(args.__dict__.get(_DEFERRED))


def deepspeed_config_mismatches(accelerator) -> list[str]:
    """The DeepSpeed config's fixed values that disagree with the training arguments, as transformers 5.23 lists
    them when the trainer is built (``HfTrainerDeepSpeedConfig.mismatches``, e.g. ``ds bf16.enabled=False vs hf
    bf16|bf16_full_eval=True``); it raises on them only in ``train()``'s ``deepspeed_init``."""
    hf_config = getattr(accelerator.state.deepspeed_plugin, "hf_ds_config", None)
    return [line.removeprefix("- ") for line in getattr(hf_config, "mismatches", [])]


def loop_is_idle(loop) -> bool | None:
    """Whether ``loop`` has no callbacks ready to run (None when it does not say).

    CPython 3.10-3.13's ``BaseEventLoop`` keeps them in the deque ``_ready``; other loops (uvloop) do not expose it,
    and the request batcher then takes a round without a new request as settled.
    """
    ready = getattr(loop, "_ready", None)
    return None if ready is None else not ready


def _deepspeed_checkpoint_globals() -> list:
    """What DeepSpeed's own checkpoint files hold besides tensors and plain values: its config enums and loss scalers
    (deepspeed 0.19: ``optim_states.pt`` keeps ``zero_stage`` as a ``ZeroStageEnum`` and the fp16 ``loss_scaler``
    object). Classes only, no functions: unpickling one sets fields, it runs nothing else."""
    try:
        from deepspeed.runtime.config import DtypeEnum
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler, LossScaleProfile
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    except ImportError:  # no DeepSpeed: HF's files need none of these
        return []
    return [ZeroStageEnum, OffloadDeviceEnum, DtypeEnum, LossScaleProfile, LossScaler, DynamicLossScaler]


def load_as_data(file, checkpoint: str, map_location=None, load=None, **kwargs) -> Any:
    """``torch.load`` of one file of ``checkpoint`` as data: ``weights_only=True``, allowing DeepSpeed's config enums
    and HF's numpy types of its RNG states (transformers 5.23: ``trainer_pt_utils.safe_globals``). A file holding
    anything else (a crafted pickle runs code when it is loaded) is refused unread; any file that does not load raises
    ``CheckpointError`` naming it and the checkpoint. ``load``: the ``torch.load`` to call (default torch's);
    ``kwargs``: torch.load's others (``mmap=True`` reads only the pickle of a zip-format file)."""
    import torch
    from transformers.trainer_pt_utils import safe_globals as hf_numpy_globals

    from verifiers_rl.core.errors import CheckpointError

    load = load or torch.load
    kwargs.pop("weights_only", None)
    kwargs.pop("pickle_module", None)  # weights_only brings its own restricted unpickler
    name = os.path.relpath(file, checkpoint) if isinstance(file, (str, os.PathLike)) else repr(file)
    with hf_numpy_globals(), torch.serialization.safe_globals(_deepspeed_checkpoint_globals()):
        try:
            return load(file, map_location=map_location, weights_only=True, **kwargs)
        except Exception as error:  # noqa: BLE001 - torch's refusal and a damaged file alike: named, then raised
            found = re.search(r"WeightsUnpickler error: (.*?)(?:\. Please|$)", str(error), re.MULTILINE)
            if found:
                raise CheckpointError(
                    f"{name} of checkpoint {checkpoint} was refused: it holds more than tensors and plain values "
                    f"({found.group(1)}), so it was not loaded and nothing of it ran. A crafted or foreign file: "
                    "resume from a checkpoint your own run wrote (--resume_from_checkpoint)."
                ) from None
            raise CheckpointError(f"Cannot read {name} of checkpoint {checkpoint} ({type(error).__name__}: {error}): "
                                  "resume from another checkpoint (--resume_from_checkpoint).") from error


@contextlib.contextmanager
def checkpoint_loads_as_data(checkpoint: str | None):
    """While HF's Trainer resumes from ``checkpoint``, every ``torch.load`` goes through ``load_as_data``: HF's files
    (``optimizer.pt``, ``scheduler.pt``, ``rng_state_*.pth``) and DeepSpeed's (``global_step*/*.pt``). No-op for None.

    transformers 5.23 calls ``torch.load`` in ``Trainer._prepare_for_training`` (DeepSpeed's checkpoint, the
    optimizer, scheduler and scaler), ``_load_rng_state`` and ``_load_from_checkpoint``; deepspeed 0.19's
    ``TorchCheckpointEngine.load`` calls ``torch.load(..., weights_only=False)``. Both look ``torch.load`` up at each
    call, and neither has a switch for it: the module attribute is replaced for the duration.
    """
    if checkpoint is None:
        yield
        return
    import torch

    original = torch.load

    def guarded(file, map_location=None, *_, **kwargs):  # a positional pickle_module is dropped, as in load_as_data
        return load_as_data(file, str(checkpoint), map_location, load=original, **kwargs)

    torch.load = guarded
    try:
        yield
    finally:
        torch.load = original


def onednn_available() -> bool:
    """Whether this torch has oneDNN's packed fp32 linear (its x86 CPU builds do).

    torch 2.13: ``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise`` are private ops (the ones
    torch's inductor packs CPU linears with); ``cpu_matmul`` falls back to ``weight_major`` without them. Remove
    these three when torch offers a public packed linear.
    """
    import torch

    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_pack(weight, rows_hint: int):
    """``weight`` reordered into oneDNN's blocked layout for about ``rows_hint`` rows (a private op, see above)."""
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def onednn_linear(x, weight, bias):
    """oneDNN's fp32 ``x W^T + b``: ``x`` [rows, in] contiguous, ``weight`` plain or packed; no activation."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def tensor_version(tensor) -> int:
    """torch's in-place version counter of ``tensor`` (``Tensor._version``; no public name): a ``copy_`` counts."""
    return tensor._version


class DeviceSetupHooks:
    """transformers' private device set-up, deferred (a mixin before ``GRPOConfig`` in ``RLConfig``).

    transformers 5.23: ``TrainingArguments._setup_devices`` (a private ``cached_property``) sets up the device and the
    process group and stores ``self.distributed_state``. Ours runs ``launch.prepare_process`` first and only the
    first time anything asks for the device, the world size or the process index, not when the config is built
    (``tests/test_compat.py`` checks both assumptions). Remove when transformers lets a config be built without
    setting up its process.
    """

    @functools.cached_property
    def _setup_devices(self):
        from transformers import TrainingArguments

        from verifiers_rl.core.launch import prepare_process

        prepare_process(self)
        return TrainingArguments._setup_devices.func(self)

    @property
    def distributed_state(self):
        """transformers' ``PartialState``, set up on first use (``_setup_devices``)."""
        if "_distributed_state" not in self.__dict__:
            if device_setup_deferred(self):
                return None  # inside __post_init__: TRL reads the world size; the launch's is used instead
            _ = self._setup_devices
        return self.__dict__["_distributed_state"]

    @distributed_state.setter
    def distributed_state(self, value) -> None:
        self.__dict__["_distributed_state"] = value


def point_at_published_best(trainer, run_dir: str, root: str) -> None:
    """HF looks for the best checkpoint (``best_global_step``'s) under the folder it wrote to, our partial root
    (``TrainerHooks._save_checkpoint``): point ``best_model_checkpoint`` at its published place instead (this step's
    once renamed), in the state and in the trainer_state.json just written, so that rotation keeps it and
    ``load_best_model_at_end`` finds it."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    state = trainer.state
    if not state.best_global_step:
        return
    best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
    if state.best_model_checkpoint == best:
        return  # pointed there at an earlier save (HF changes it only when this step is the best)
    if state.best_global_step != state.global_step and not os.path.isdir(best):
        return  # an earlier step that was never saved (a save_steps between): nothing to point at
    state.best_model_checkpoint = best
    if trainer.args.should_save:
        state.save_to_json(os.path.join(root, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", TRAINER_STATE_NAME))


def check_best_metric(name: str | None, metrics: dict[str, float]) -> None:
    """Raise ``BestMetricError`` when ``metrics`` (an evaluation's, ``eval_``-prefixed) lack the metric ``name``."""
    if name is not None and f"eval_{name.removeprefix('eval_')}" not in metrics:
        from verifiers_rl.core.errors import BestMetricError

        logged = ", ".join(sorted(key.removeprefix("eval_") for key in metrics))
        raise BestMetricError(f"--metric_for_best_model {name}: the evaluation logs no metric of that name; it "
                              f"logs {logged}.")


class TrainerHooks:
    """The HF ``Trainer`` private methods ``RLTrainer`` overrides (a mixin before ``GRPOTrainer``), in one place.

    Written against transformers 5.23 (``tests/test_compat.py`` checks that each still exists on ``Trainer`` with the
    same parameters, and that the loads still call ``torch.load``). Remove an override when transformers offers a
    public hook for it: a checkpoint root to write under (``_get_output_dir``, ``_save_checkpoint``), loading
    checkpoint files as data (the three loads), and the tied-weights aliases in load warnings.
    The class using it provides ``checkpoints`` (``RunCheckpoints``), ``state`` and ``model``.
    """

    OVERRIDDEN = ("_get_output_dir", "_save_checkpoint", "_prepare_for_training", "_load_rng_state",
                  "_load_from_checkpoint", "_issue_warnings_after_load", "_determine_best_metric")
    _checkpoint_root: str | None = None  # set while HF writes a checkpoint (under its partial name)

    def _get_output_dir(self, trial) -> str:
        return self._checkpoint_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """HF's checkpoint, written atomically with this run's state beside it (``RunCheckpoints.save``)."""

        def write_hf(root: str) -> None:
            self._checkpoint_root = root
            try:
                super(TrainerHooks, self)._save_checkpoint(model, trial)
            finally:
                self._checkpoint_root = None
            point_at_published_best(self, run_dir, root)

        run_dir = super()._get_output_dir(trial)
        self.checkpoints.save(run_dir, self.state.global_step, write_hf, lambda: self.state.best_model_checkpoint)

    def _determine_best_metric(self, metrics: dict[str, float], trial) -> bool:
        """HF's, with a --metric_for_best_model that the evaluation does not log refused by name (HF raises a
        KeyError). The names depend on the environment's reward functions, so the first evaluation is where it shows."""
        check_best_metric(self.args.metric_for_best_model, metrics)
        return super()._determine_best_metric(metrics, trial)

    # HF reads its files and DeepSpeed's in these three: each as data, a crafted one refused by name.
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        with checkpoint_loads_as_data(resume_from_checkpoint):
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def _load_rng_state(self, checkpoint) -> None:
        with checkpoint_loads_as_data(checkpoint):
            super()._load_rng_state(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        with checkpoint_loads_as_data(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _issue_warnings_after_load(self, load_result) -> None:
        # A tied output layer is saved once, under the input embedding's name: its absence is not a missing weight.
        from verifiers_rl.core.modeling import unwrap

        model = unwrap(self.model)
        aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        aliases -= {name for name, _ in model.named_parameters()}
        load_result.missing_keys[:] = [key for key in load_result.missing_keys if key not in aliases]
        super()._issue_warnings_after_load(load_result)
