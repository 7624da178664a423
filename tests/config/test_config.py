"""RLConfig is a value: building one starts no process group and leaves the environment alone; the process set-up
(launch.prepare_process) runs at the first use of the device, world size or process index."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torch.distributed as dist

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.launch import prepare_process

LAUNCHED = dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29577",
                ACCELERATE_USE_CPU="1", ACCELERATE_USE_DEEPSPEED="true")


def test_building_a_config_in_a_launched_process_has_no_side_effect():
    # A fresh interpreter: the environment of a launched rank 0 of 2. Before, building the config started the gloo
    # group (and waited for rank 1 forever) and popped ACCELERATE_USE_CPU.
    code = textwrap.dedent("""
        import os
        import torch.distributed as dist
        from verifiers_rl.config.rl_config import RLConfig
        before = dict(os.environ)
        config = RLConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", per_device_train_batch_size=8)
        print(dist.is_initialized(), dict(os.environ) == before, config.rollouts_per_step)
    """)
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, **LAUNCHED}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    # The default batch still counts the launch's processes (8 x 2), read from WORLD_SIZE, not from a process group.
    assert result.stdout.split() == ["False", "True", "16"]


def test_prepare_process_does_what_a_deepspeed_cpu_launch_needs(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    config = RLConfig(output_dir="/tmp/unused", report_to="none")
    assert os.environ["ACCELERATE_USE_CPU"] == "1" and not config.use_cpu  # built: nothing happened yet
    prepare_process(config)
    assert "ACCELERATE_USE_CPU" not in os.environ and config.use_cpu
    import deepspeed.comm.torch  # noqa: F401

    assert sys.modules["deepspeed.comm.torch"].build_shm_op() is None  # the 50-85 s CPU op build is skipped
    prepare_process(config)  # idempotent
    assert not dist.is_initialized()  # one process: no group to start


def test_the_first_use_of_the_device_sets_the_process_up(monkeypatch):
    import verifiers_rl.core.launch as launch  # compat.DeviceSetupHooks looks it up there at the first use

    prepared = []
    monkeypatch.setattr(launch, "prepare_process", lambda args: prepared.append(args))
    config = RLConfig(output_dir="/tmp/unused", report_to="none")
    assert prepared == []  # built: nothing happened yet
    assert config.world_size == 1 and config.process_index == 0
    assert prepared == [config]  # the first use ran the set-up, once
    assert str(config.device) == "cpu" and prepared == [config]


# --- the vLLM fields (no server needed) ---------------------------------------------------------------------------


def vllm_config(**kwargs) -> RLConfig:
    return RLConfig(**{"output_dir": "/tmp/unused", "report_to": "none", **kwargs})


def test_trl_vllm_switches_point_to_vllm_server_url():
    for kwargs in ({"use_vllm": True}, {"vllm_server_base_url": "http://127.0.0.1:8000"}):
        with pytest.raises(ValueError, match="--vllm_server_url http://HOST:PORT"):
            vllm_config(**kwargs)


def test_gradient_accumulation_that_disagrees_with_rollouts_per_step_is_refused_naming_both():
    # It sizes only the default batch (micro-batches are accumulated whatever it says): beside another it did nothing.
    with pytest.raises(ValueError, match=r"^--gradient_accumulation_steps 4 sizes the batch: per_device_train_batch_size "
                                         r"8 x gradient_accumulation_steps x 1 process = 32 rollouts, but "
                                         r"--rollouts_per_step is 16"):
        RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, rollouts_per_step=16,
                 gradient_accumulation_steps=4)
    agreeing = RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, rollouts_per_step=32,
                        gradient_accumulation_steps=4)
    assert (agreeing.rollouts_per_step, agreeing.gradient_accumulation_steps) == (32, 4)


@pytest.mark.parametrize("weights", [[1.0, "a"], [float("nan")], "12", [True]])
def test_reward_weights_must_be_finite_numbers(weights):
    # TRL's form counted a string's letters as reward functions and failed later on float("a").
    with pytest.raises(ValueError, match=r"^reward_weights must be a list of finite numbers, one per reward function"):
        RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, reward_weights=weights)
    assert RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, reward_weights=[1, 0.5]).reward_weights


@pytest.mark.parametrize("knob, value, message", [
    ("ref_model_sync_steps", 0, "must be >= 1, got 0"),  # TRL's callback divided by it at the first step
    ("ref_model_sync_steps", -1, "must be >= 1, got -1"),  # global_step % -1 == 0: a mix at every step
    ("ref_model_mixup_alpha", 1.5, "must be <= 1, got 1.5"),  # reference = 1.5 policy - 0.5 reference
    ("ref_model_mixup_alpha", -0.5, "must be >= 0, got -0.5"),
])
def test_sync_ref_models_mix_knobs_are_checked_by_name(knob, value, message):
    mixing = dict(output_dir="/tmp/unused", report_to="none", use_cpu=True, beta=0.1, sync_ref_model=True)
    with pytest.raises(ValueError, match=rf"^{knob} {message}"):
        RLConfig(**mixing, **{knob: value})
    assert getattr(RLConfig(**mixing, ref_model_sync_steps=1, ref_model_mixup_alpha=1.0), knob) == 1


def test_an_unknown_multi_objective_aggregation_is_refused_by_name():
    # TRL's field is a str: a misspelt value was taken and trained as sum_then_normalize.
    with pytest.raises(ValueError, match=r"^Unknown multi_objective_aggregation 'normalise_then_sum'; expected one of "
                                         r"sum_then_normalize, normalize_then_sum"):
        RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True,
                 multi_objective_aggregation="normalise_then_sum")
    from verifiers_rl.cli.train import build_parser  # the command lists the choices

    action = next(a for a in build_parser()._actions if a.dest == "multi_objective_aggregation")
    assert list(action.choices) == ["sum_then_normalize", "normalize_then_sum"]


def test_a_batch_that_does_not_divide_into_groups_says_where_its_size_came_from():
    # A TRL script sets per_device_train_batch_size, never rollouts_per_step: the message named only the latter.
    base = dict(output_dir="/tmp/unused", report_to="none", use_cpu=True, num_generations=3)
    with pytest.raises(ValueError, match=r"^rollouts_per_step \(8 = per_device_train_batch_size 8 x "
                                         r"gradient_accumulation_steps 1 x 1 process\) must be a multiple of "
                                         r"num_generations \(3\).*set --rollouts_per_step \(or per_device_train"):
        RLConfig(**base)
    with pytest.raises(ValueError, match=r"^rollouts_per_step \(16\) must be a multiple of num_generations \(3\)"):
        RLConfig(**base, rollouts_per_step=16)


@pytest.mark.parametrize("delta", [0.5, 1.0])
def test_a_two_sided_clip_at_or_below_one_is_refused(delta):
    # The bound min(r, delta) A is flat around r = 1 then: at k = 0 step 1 logged loss 0.17 (not 0), and tokens with a
    # positive advantage got no gradient.
    with pytest.raises(ValueError, match=rf"^delta must be > 1, got {delta}"):
        RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, delta=delta)
    assert RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, delta=1.2).delta == 1.2


@pytest.mark.parametrize("count", [0, -1])
def test_num_completions_to_print_below_one_is_refused(count):
    # Taken, 0 printed the default 3 samples and -1 every group's: neither what was asked.
    with pytest.raises(ValueError, match=rf"^num_completions_to_print must be >= 1, got {count}"):
        RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, num_completions_to_print=count)


def test_vllm_fields_are_validated():
    assert vllm_config(vllm_server_url="http://127.0.0.1:8000").vllm_server_url == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="vllm_server_url must start with http"):
        vllm_config(vllm_server_url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="vllm_max_concurrency must be >= 1"):
        vllm_config(vllm_max_concurrency=0)
    with pytest.raises(ValueError, match="vllm_request_timeout_s must be > 0"):
        vllm_config(vllm_request_timeout_s=0)
    with pytest.raises(ValueError, match="vllm_max_retries must be >= 0"):
        vllm_config(vllm_max_retries=-1)
    with pytest.raises(ValueError, match="vllm_reconnect_timeout_s must be >= 0"):
        vllm_config(vllm_reconnect_timeout_s=-1)
    with pytest.raises(ValueError, match="vllm_server_timeout must be >= 0"):
        vllm_config(vllm_server_timeout=-1)
    # The wait for a restarted server happens inside a batch's generation, which generation_timeout_s bounds.
    url = "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match=r"vllm_reconnect_timeout_s \(300 s\) must be below generation_timeout_s"):
        vllm_config(vllm_server_url=url, generation_timeout_s=300)
    assert vllm_config(vllm_server_url=url, generation_timeout_s=300, vllm_reconnect_timeout_s=0).vllm_reconnect_timeout_s == 0
    with pytest.raises(ValueError, match="Unknown vllm_weight_transfer .tcp.; expected one of files, nccl, gloo"):
        vllm_config(vllm_weight_transfer="tcp")


_ENABLER_OFF = {
    "save_steps": {"save_strategy": "no"},  # HF's default is steps
    "eval_steps": {"eval_strategy": "epoch"},  # alone it turns evaluation on by steps
    "save_total_limit": {"save_strategy": "no"},
    "weight_sync_probe_every": {"weight_sync_probe_tokens": 0},
    "weight_sync_probe_tolerance": {"weight_sync_probe_tokens": 0},
    "importance_cap": {"importance_correction": "none"},
    "importance_cap_min": {"importance_correction": "none"},
    "num_completions_to_print": {"print_samples_every": 0},
    "max_tokens_per_microbatch": {"micro_batching": "padded", "share_prompt_training": "off"},
    # HF's own check comes first where checkpoints are saved by steps but never evaluated (its message names both).
    "load_best_model_at_end": {"save_strategy": "no"},
    **{knob: {"rollouts_path": "r.jsonl"} for knob in ("shuffle_dataset", "max_rollout_retries",
                                                       "curriculum_pass_reward", "max_off_policy_steps")},
}


@pytest.mark.parametrize("knob, value, enabler, enabled", [
    ("vllm_server_timeout", 5.0, "--vllm_server_url", {"vllm_server_url": "http://127.0.0.1:8000"}),
    ("vllm_max_concurrency", 8, "--vllm_server_url", {"vllm_server_url": "http://127.0.0.1:8000"}),
    ("vllm_weight_transfer", "gloo", "--vllm_server_url", {"vllm_server_url": "http://127.0.0.1:8000"}),
    ("max_refill_batches", 5, "--filter_groups zero_variance", {"filter_groups": "zero_variance"}),
    ("weight_sync_probe_every", 2, "the weight-sync probe", {}),
    ("weight_sync_probe_tolerance", 0.1, "the weight-sync probe", {}),
    ("eval_num_examples", 5, "evaluation", {"eval_steps": 2}),
    ("eval_temperature", 0.5, "evaluation", {"eval_strategy": "steps", "eval_steps": 2}),
    ("dr_grpo_horizon", 64, "--loss_type dr_grpo", {"loss_type": "dr_grpo"}),
    ("use_bias_correction_kl", False, "the KL term", {"beta": 0.1}),
    ("shuffle_dataset", False, "live generation", {}),
    ("max_rollout_retries", 5, "live generation", {}),
    ("max_off_policy_steps", 0, "live generation", {}),  # a replay trains the file's batches as they come
    ("curriculum_pass_reward", 0.5, "live generation", {"curriculum_easy_above": 0.9}),
    ("ref_model_sync_steps", 64, "--sync_ref_model", {"beta": 0.1, "sync_ref_model": True}),
    ("importance_cap", 3.0, "an importance correction", {"importance_correction": "token_mask"}),
    ("importance_cap_min", 0.5, "an importance correction", {"importance_correction": "sequence_truncate"}),
    ("importance_sequence_log_ratio", "sum", "a sequence-level correction", {"importance_correction": "sequence_mask"}),
    ("num_completions_to_print", 2, "sample printing", {"print_samples_every": 5}),
    ("max_tokens_per_microbatch", 2048, "packed rows", {"micro_batching": "padded", "share_prompt_training": "on"}),
    ("load_best_model_at_end", True, "evaluation", {"eval_steps": 2}),
    ("metric_for_best_model", "pass@1", "evaluation", {"eval_steps": 2}),
    ("greater_is_better", False, "a best-checkpoint metric", {"eval_steps": 2, "metric_for_best_model": "pass@1"}),
    ("optim_target_modules", "all-linear", "a low-rank optimizer", {"optim": "galore_adamw"}),
    ("save_steps", 20, "--save_strategy steps", {"save_strategy": "steps"}),
    ("eval_steps", 5, r"--eval_strategy steps \(given alone", {}),
    ("save_total_limit", 3, r"checkpoints \(--save_strategy steps, epoch or best\)", {"save_strategy": "epoch"}),
    ("project", "mine", "--report_to trackio", {"report_to": "trackio"}),  # wandb's is WANDB_PROJECT
    ("trackio_space_id", "me/space", "--report_to trackio", {"report_to": "trackio"}),
])
def test_a_knob_given_without_the_setting_it_tunes_is_refused_naming_both(knob, value, enabler, enabled):
    off = _ENABLER_OFF.get(knob, {})  # the others' enablers are off by default
    with pytest.raises(ValueError, match=rf"^--{knob} {value} acts only with {enabler}.*it would change nothing"):
        vllm_config(**{knob: value}, **off)
    assert getattr(vllm_config(**{knob: value}, **enabled), knob) == value  # with it, the knob is taken


def test_a_report_to_backend_not_installed_names_the_extra_that_installs_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    # wandb is not among the test set-up's extras ([logging] is): hide it either way, so the refusal is what we test.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"^--report_to wandb needs the wandb package, which is not installed: pip "
                                         r"install 'verifiers_rl\[wandb\]'"):
        RLConfig(output_dir="/tmp/unused", report_to="wandb")
    # tensorboard is installed by [logging], which the test set-up has.
    assert RLConfig(output_dir="/tmp/unused", report_to="tensorboard").report_to == ["tensorboard"]


def test_a_report_to_value_that_is_no_installed_backend_is_one_line_naming_ours():
    from transformers.integrations.integration_utils import (INTEGRATION_TO_CALLBACK,
                                                             get_available_reporting_integrations)

    # transformers refused these at the trainer, listing its ~14 integrations (an uninstalled one: a traceback).
    ours = "this project's: tensorboard and trackio (tested), wandb, all (every one installed) or none"
    with pytest.raises(ValueError, match=rf"^--report_to nonsense is not a logging backend; {re.escape(ours)}\. "):
        RLConfig(output_dir="/tmp/unused", report_to="nonsense")
    with pytest.raises(ValueError, match=r"^--report_to none,tensorboard: none stands alone"):
        RLConfig(output_dir="/tmp/unused", report_to="none,tensorboard")
    # A trailing comma was a backend "" (refused: "--report_to  is not a logging backend"); it names none.
    assert RLConfig(output_dir="/tmp/unused", report_to="tensorboard,").report_to == ["tensorboard"]
    missing = next(name for name in INTEGRATION_TO_CALLBACK if name not in get_available_reporting_integrations()
                   and name not in ("tensorboard", "trackio", "wandb"))
    with pytest.raises(ValueError, match=rf"^--report_to {missing} needs its package, which is not installed .*"
                                         rf"untested here; {re.escape(ours)}"):
        RLConfig(output_dir="/tmp/unused", report_to=missing)


def test_best_checkpoint_settings_name_what_our_evaluation_logs():
    with pytest.raises(ValueError, match=r"^--save_strategy best saves a checkpoint when an evaluation finds a new "
                                         r"best --metric_for_best_model; this run does not evaluate"):
        vllm_config(save_strategy="best")
    # Unset, the metric is the evaluation's mean reward (HF's default, the eval loss, is never computed here), and
    # tensorboard's name for a metric (eval/...) is the metric's.
    assert vllm_config(save_strategy="best", eval_steps=2).metric_for_best_model == "reward"
    best = vllm_config(load_best_model_at_end=True, eval_steps=2)
    assert (best.metric_for_best_model, best.greater_is_better) == ("reward", True)
    assert vllm_config(metric_for_best_model="eval/pass@1", eval_steps=2).metric_for_best_model == "pass@1"
    assert vllm_config(eval_steps=2).metric_for_best_model is None  # nothing asked for a best checkpoint


def test_bf16_stays_off_with_use_cpu_where_a_gpu_is(monkeypatch):
    # A GPU machine's use_cpu run (the CPU reference of tests/gpu) must train in fp32 like any CPU run.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU here: the default reads only this answer
    assert RLConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none").bf16 is False


def test_fp16_on_the_cpu_is_refused_by_name():
    # Accelerate ignores fp16 on the CPU (the run trained in float32, bitwise as without it) and DeepSpeed raises.
    with pytest.raises(ValueError, match=r"^--fp16 needs a GPU: .* Use --bf16"):
        RLConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", fp16=True)
    assert RLConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", bf16=True).bf16  # bf16 acts on the CPU


def test_the_launchs_mixed_precision_sets_bf16_left_unset_and_one_the_flags_contradict_is_refused(monkeypatch):
    # accelerate launch passes its config's mixed_precision as ACCELERATE_MIXED_PRECISION, which transformers trains
    # in whenever --bf16 and --fp16 are off: --bf16 false trained in bf16 all the same, the engine in float32.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    followed = RLConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none")
    assert followed.bf16 and followed.mixed_precision == "bf16"
    with pytest.raises(ValueError, match=r"^accelerate launch asks for mixed_precision bf16 .* this run's flags for no "
                                         r"\(--bf16 False, --fp16 False\).* or pass --bf16 true\.$"):
        RLConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", bf16=False)


@pytest.mark.parametrize("fields, env", [({"fsdp": "full_shard"}, {}), ({"fsdp_config": {"min_num_params": 5}}, {}),
                                         ({}, {"ACCELERATE_USE_FSDP": "true"})])
def test_fsdp_is_refused_by_name_pointing_to_zero3(monkeypatch, fields, env):
    # FSDP wrapped the model under a 2-process launch and trained, untested: the weight sync, checkpoints and the
    # exactness checks cover DDP and ZeRO-3 only. accelerate launch passes a config's FSDP as ACCELERATE_USE_FSDP.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"FSDP is not supported .* accelerate_configs/zero3.yaml"):
        RLConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", **fields)


@pytest.mark.parametrize("flag, path, message", [
    ("output_dir", "afile", "--output_dir {tmp}/afile is a file; pass a folder (it is created if missing)."),
    ("output_dir", "afile/run", "--output_dir {tmp}/afile/run: {tmp}/afile is a file, so nothing can be created"),
    ("save_rollouts_path", "adir", "--save_rollouts_path {tmp}/adir is a folder; pass a file's path."),
    ("save_rollouts_path", "afile/seen.jsonl", "--save_rollouts_path {tmp}/afile/seen.jsonl: {tmp}/afile is a file"),
])
def test_a_path_the_run_could_not_create_is_refused_naming_its_flag(flag, path, message, tmp_path):
    # Accepted before, they failed at the trainer's makedirs or the first step's append with an OSError traceback.
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    paths = {"output_dir": str(tmp_path / "out"), flag: str(tmp_path / path)}
    with pytest.raises(ValueError, match="^" + re.escape(message.format(tmp=tmp_path))):
        RLConfig(report_to="none", **paths)
    RLConfig(report_to="none", output_dir=str(tmp_path / "new" / "out"),
             save_rollouts_path=str(tmp_path / "new" / "seen.jsonl"))  # paths still to be created are fine


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where nothing can be created")
@pytest.mark.parametrize("field, path, what", [("output_dir", "/proc/x/run", "the folder"),
                                               ("save_rollouts_path", "/proc/x/seen.jsonl", "the file")])
def test_rltrainer_refuses_a_path_it_could_not_create_before_loading_anything(field, path, what, tiny_model_dir,
                                                                             tmp_path):
    # As the command does: from Python save_rollouts_path failed after the first step, output_dir at the first save.
    from verifiers_rl.training.trainer import RLTrainer

    paths = {"output_dir": str(tmp_path / "out"), field: path}
    args = RLConfig(report_to="none", use_cpu=True, rollouts_path=str(tmp_path / "r.jsonl"), **paths)
    with pytest.raises(ValueError, match=f"^{re.escape(f'{field} {path}: cannot create or write {what} (')}"):
        RLTrainer(tiny_model_dir, args)


def test_rltrainer_refuses_a_revision_beside_a_local_folder_which_transformers_ignores(tiny_model_dir, tmp_path):
    from verifiers_rl.training.trainer import RLTrainer

    args = RLConfig(report_to="none", use_cpu=True, output_dir=str(tmp_path / "out"),
                    model_init_kwargs={"revision": "v2"}, rollouts_path=str(tmp_path / "r.jsonl"))
    with pytest.raises(ValueError, match=rf"^model_init_kwargs revision 'v2' acts only on a Hub id, and "
                                         rf"{re.escape(repr(tiny_model_dir))} is a local folder"):
        RLTrainer(tiny_model_dir, args)


def test_a_launchs_deepspeed_config_named_from_the_repository_is_found_from_another_folder(monkeypatch, tmp_path):
    # accelerate_configs/zero3*.yaml name their JSON relative to the repository; Accelerate opened it from the working
    # directory, and every rank of a launch from elsewhere stopped ("Expected a string path to an existing ...").
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "accelerate_configs/ds_zero3_cpu.json")
    config = RLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert config.deepspeed_plugin.hf_ds_config.config["zero_optimization"]["stage3_prefetch_bucket_size"] == 0
    assert os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "accelerate_configs/ds_zero3_cpu.json"  # left as it was
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "configs/ds.json")
    with pytest.raises(ValueError) as refused:
        RLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert str(refused.value) == (
        f"The accelerate config's deepspeed_config_file configs/ds.json does not exist (Accelerate opens it from the "
        f"working directory, {tmp_path}): launch from the folder it is relative to, or give its absolute path in the "
        "accelerate config.")

