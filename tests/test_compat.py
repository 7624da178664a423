"""Each reach into an upstream private part (verifiers_rl/compat.py) checked against the installed versions: an
upgrade that changes one fails here, by name."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoTokenizer

from verifiers_rl import compat
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts
from verifiers_rl.training.trainer import RLTrainer


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("compat")
    write_rollouts(work / "r.jsonl", random_rollouts(2, 4, vocab_size=390, seed=3))
    args = RLConfig(output_dir=str(work / "out"), use_cpu=True, report_to="none", save_strategy="no",
                    rollouts_path=str(work / "r.jsonl"), rollouts_per_step=8, max_steps=1, disable_tqdm=True,
                    gradient_checkpointing=False)
    return RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))


def test_trl_averages_and_clears_the_step_metric_lists_when_it_logs(trainer):
    trainer.model.train()  # trl 1.16 logs the "train" lists while the model is in training mode
    compat.step_metrics(trainer)["probe_metric"].extend([1.0, 3.0])
    trainer.log({})
    assert trainer.state.log_history[-1]["probe_metric"] == 2.0
    assert "probe_metric" not in compat.step_metrics(trainer)


def test_logging_outside_training_leaves_the_step_metrics_alone(trainer):
    compat.step_metrics(trainer)["kept_metric"].append(5.0)
    compat.log_outside_training(trainer, {"eval_thing": 1.0})
    assert trainer.state.log_history[-1]["eval_thing"] == 1.0 and "kept_metric" not in trainer.state.log_history[-1]
    assert compat.step_metrics(trainer)["kept_metric"] == [5.0]
    compat.step_metrics(trainer).clear()


def test_accelerate_gradient_state_takes_the_sync_flag(trainer):
    state = trainer.accelerator.gradient_state
    for value in (False, True):
        compat.set_sync_gradients(trainer.accelerator, value)
        assert state.sync_gradients is value


def test_replaced_forward_restores_an_instance_forward_or_removes_its_own():
    layer = torch.nn.Linear(2, 2)
    with compat.replaced_forward(layer, lambda x: "ours"):
        assert layer(torch.zeros(2)) == "ours"
    assert "forward" not in layer.__dict__
    theirs = lambda x: "theirs"  # noqa: E731 - what TRL's cast_lm_head_to_fp32 installs
    layer.forward = theirs
    with compat.replaced_forward(layer, lambda x: "ours"):
        assert layer(torch.zeros(2)) == "ours"
    assert layer.forward is theirs


def test_trls_fp32_head_patch_is_an_instance_forward():
    # replaced_forward exists because of this: if TRL stops patching the instance, the restore is moot but harmless.
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer.__init__)
    assert "lm_head.forward = cast_forward_to_fp32" in source


def test_reporting_callbacks_keep_their_backends_where_we_read_them():
    from transformers.integrations import TrackioCallback, WandbCallback

    trackio = TrackioCallback()
    assert trackio._initialized is False and compat.reporting_backend(trackio) is None
    assert "self._wandb" in inspect.getsource(WandbCallback.__init__)


def test_transformers_zero3_switch_is_the_weak_ref_we_clear():
    from transformers.integrations import deepspeed as hf_deepspeed

    sentinel = object()
    hf_deepspeed._hf_deepspeed_config_weak_ref, saved = sentinel, hf_deepspeed._hf_deepspeed_config_weak_ref
    try:
        with compat.without_zero3_init():
            assert hf_deepspeed._hf_deepspeed_config_weak_ref is None
            assert not hf_deepspeed.is_deepspeed_zero3_enabled()
        assert hf_deepspeed._hf_deepspeed_config_weak_ref is sentinel
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def test_transformers_lists_deepspeed_config_mismatches_when_the_trainer_is_built():
    # HF's own propagate_args_to_deepspeed (run by Trainer.__init__) on a config fixing bf16 off beside bf16=True;
    # the accelerator is a stand-in holding only the plugin (a DeepSpeed accelerator needs a launch).
    from types import SimpleNamespace

    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import propagate_args_to_deepspeed

    config = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": False}, "zero_optimization": {"stage": 3}}
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config)))
    propagate_args_to_deepspeed(accelerator, RLConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none",
                                                      bf16=True))
    assert compat.deepspeed_config_mismatches(accelerator) == ["ds bf16.enabled=False vs hf "
                                                                        "bf16|bf16_full_eval=True"]


def test_torch_gloo_options_take_a_timeout_and_a_device():
    # vllm_worker/vllm_weight_sync.gloo_group (the trainer side of the gloo weight transfer) builds these.
    import datetime

    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=5)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    assert options._timeout == datetime.timedelta(seconds=5)


def test_transformers_sets_up_the_device_in_a_cached_property_that_post_init_reads():
    # RLConfig defers it (compat.deferred_device_setup) and runs launch.prepare_process first
    # (compat.DeviceSetupHooks._setup_devices, which RLConfig takes before GRPOConfig's).
    from functools import cached_property

    from transformers import TrainingArguments

    assert isinstance(TrainingArguments.__dict__["_setup_devices"], cached_property)
    assert "self.device" in inspect.getsource(TrainingArguments.__post_init__)
    assert "self.distributed_state = PartialState(" in inspect.getsource(TrainingArguments._setup_devices.func)
    assert RLConfig._setup_devices is compat.DeviceSetupHooks.__dict__["_setup_devices"]


def test_deepspeeds_checkpoint_engine_would_run_a_pickle_and_the_guard_refuses_it_naming_file_and_checkpoint(tmp_path):
    # DeepSpeed's own load, as a ZeRO-3 resume calls it (a real 2-process one: tests/training/test_checkpoint_files.py).
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from tests.helpers.checkpoints import PlantedCode
    from verifiers_rl.training.run_state import CheckpointError

    checkpoint, marker = tmp_path / "checkpoint-1", tmp_path / "planted-code-ran"
    (checkpoint / "global_step1").mkdir(parents=True)
    file = checkpoint / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"planted": PlantedCode(marker)}, file)
    engine = TorchCheckpointEngine()
    with compat.checkpoint_loads_as_data(str(checkpoint)):
        with pytest.raises(CheckpointError, match=rf"global_step1/{file.name} of checkpoint {checkpoint} was refused"):
            engine.load(str(file), map_location="cpu")
    assert not marker.exists()
    engine.load(str(file), map_location="cpu")  # unguarded, it runs the file's code: why the guard exists
    assert marker.exists()


def test_transformers_reads_a_checkpoints_torch_files_in_the_methods_the_trainer_guards():
    # RLTrainer wraps these three in compat.checkpoint_loads_as_data; a load elsewhere would go unguarded.
    from transformers import Trainer

    prepare = inspect.getsource(Trainer._prepare_for_training)
    assert "deepspeed_load_checkpoint(" in prepare and "self._load_optimizer_and_scheduler(" in prepare
    assert "torch.load(" in inspect.getsource(Trainer._load_rng_state)
    assert "torch.load(" in inspect.getsource(Trainer._load_optimizer_and_scheduler)
    guarded = {"_prepare_for_training", "_load_rng_state", "_load_from_checkpoint"}
    assert all(getattr(RLTrainer, name) is getattr(compat.TrainerHooks, name) for name in guarded)


def test_every_private_trainer_method_we_override_still_exists_with_its_parameters():
    """compat.TrainerHooks overrides private methods of transformers' Trainer: a rename or a new parameter upstream
    would silently stop an override from running (or break its super() call)."""
    from transformers import Trainer

    for name in compat.TrainerHooks.OVERRIDDEN:
        assert hasattr(Trainer, name), f"transformers' Trainer has no {name} any more"
        ours = list(inspect.signature(getattr(compat.TrainerHooks, name)).parameters)
        theirs = list(inspect.signature(getattr(Trainer, name)).parameters)
        assert ours == theirs, f"Trainer.{name}{theirs} changed; compat.TrainerHooks.{name} takes {ours}"
        assert getattr(RLTrainer, name) is getattr(compat.TrainerHooks, name), f"RLTrainer overrides {name} again"
    assert {name for name in vars(compat.TrainerHooks) if name.startswith("_") and callable(
        getattr(compat.TrainerHooks, name)) and not name.startswith("__")} == set(compat.TrainerHooks.OVERRIDDEN)


def test_onednn_private_ops_compute_a_linear_and_the_version_counter_counts_in_place_writes():
    """cpu_matmul's packed linears rest on torch's private oneDNN ops and on Tensor._version (compat)."""
    if not compat.onednn_available():
        pytest.skip("this torch has no oneDNN packed linear (cpu_matmul falls back to weight_major)")
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(shape, generator=generator) for shape in ((5, 16), (24, 16), (24,)))
    expected = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(compat.onednn_linear(x, weight, bias), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compat.onednn_linear(x, compat.onednn_pack(weight, 64), bias), expected,
                               rtol=1e-5, atol=1e-5)
    before = compat.tensor_version(weight)
    weight.copy_(weight * 2)
    assert compat.tensor_version(weight) > before


def test_trl_gives_a_peft_model_with_adapters_a_ref_copy_that_peft_reference_activates(tmp_path, tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    write_rollouts(tmp_path / "r.jsonl", random_rollouts(2, 4, vocab_size=390, seed=3))
    args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no", beta=0.1,
                    rollouts_path=str(tmp_path / "r.jsonl"), rollouts_per_step=8, max_steps=1, disable_tqdm=True,
                    gradient_checkpointing=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2, lora_dropout=0.0))
    RLTrainer(model, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    assert compat.TRL_REFERENCE_ADAPTER in model.peft_config
    with compat.peft_reference(model):
        assert model.active_adapter == compat.TRL_REFERENCE_ADAPTER
    assert model.active_adapter == "default"
