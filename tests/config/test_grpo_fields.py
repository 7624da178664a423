"""Every GRPOConfig field acts or is refused by name (verifiers_rl/config/grpo_fields.py), and the table is complete."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
from transformers import TrainingArguments
from trl import GRPOConfig

from verifiers_rl.config import grpo_fields
from verifiers_rl.config.rl_config import RLConfig

# A value other than the default for each refused field whose default gives no obvious one (None, strings, dicts).
SAMPLE_VALUES = {
    "router_aux_loss_coef": 0.01, "num_generations_eval": 4, "pad_to_multiple_of": 8, "generation_batch_size": 32,
    "steps_per_generation": 4, "fsdp": "full_shard", "fsdp_config": {"min_num_params": 5},
    "cache_implementation": "static", "vllm_mode": "server",
    "vllm_model_impl": "transformers", "vllm_structured_outputs_regex": "a+",
    "vllm_server_base_url": "http://127.0.0.1:8000", "vllm_server_host": "127.0.0.1", "vllm_max_model_length": 512,
    "delta": 4.0, "reward_weights": [1.0, 0.5], "multi_objective_aggregation": "normalize_then_sum",
    "max_tool_calling_iterations": 3, "vllm_importance_sampling_mode": "token_truncate",
    "vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_cap": 2.0, "off_policy_mask_threshold": 0.5,
    "log_completions_hub_repo": "me/completions", "transformers_continuous_batching_config": {"max_batch": 8},
    "liger_kernel_config": {"rope": True}, "per_device_eval_batch_size": 3, "eval_accumulation_steps": 2,
    "include_for_metrics": ["inputs"], "label_names": ["labels"], "length_column_name": "size",
    "train_sampling_strategy": "sequential", "dataloader_num_workers": 2, "dataloader_prefetch_factor": 4,
    "dataloader_multiprocessing_context": "spawn", "data_seed": 7, "include_num_input_tokens_seen": "all",
    "neftune_noise_alpha": 5.0, "torch_empty_cache_steps": 4,
    "hub_model_id": "me/run", "hub_private_repo": True, "hub_revision": "dev", "hub_strategy": "checkpoint",
    "hub_token": "hf_x",
}


def _other_value(field: dataclasses.Field):
    if field.name in SAMPLE_VALUES:
        return SAMPLE_VALUES[field.name]
    default = grpo_fields._default(field)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default * 2 + 1
    raise AssertionError(f"add a sample value for refused field {field.name} (default {default!r})")


def test_every_grpo_config_field_is_classified():
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    added = [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in inherited]
    missing = [name for name in added if name not in grpo_fields.GRPO_FIELDS]
    assert not missing, f"GRPOConfig fields not classified in verifiers_rl/config/grpo_fields.py: {missing}"
    stale = [name for name in grpo_fields.GRPO_FIELDS if name not in added]
    assert not stale, f"grpo_fields.py names fields GRPOConfig no longer has: {stale}"
    unknown = [name for name in grpo_fields.TRAINING_ARGUMENTS_REFUSED if name not in inherited]
    assert not unknown, f"TRAINING_ARGUMENTS_REFUSED names fields TrainingArguments does not have: {unknown}"


@pytest.mark.parametrize("name", sorted(grpo_fields.refused_fields()))
def test_a_refused_field_set_by_the_user_stops_with_its_name_and_reason(name):
    field = {f.name: f for f in dataclasses.fields(RLConfig)}[name]
    value = _other_value(field)
    with pytest.raises(ValueError, match=rf"^{name}=.* has no effect in verifiers_rl: "):
        RLConfig(output_dir="/tmp/unused", report_to="none", **{name: value})


@pytest.mark.parametrize("name, value, why", [
    # HF's train() hooks noise into the training forward only: at k = 0 is_ratio read 1.016, not 1.
    ("neftune_noise_alpha", 5.0, "the trained log-probs would differ from the sampled policy's"),
    # HF's SIGTERM handler never ran (ours replaced it in train()) and was restored after it: SIGTERM then ignored.
    ("enable_jit_checkpoint", True, "SIGTERM and Ctrl-C already finish the step and write a checkpoint"),
    # Read only by HF's own training_step and DataLoader, neither of which runs here.
    ("torch_empty_cache_steps", 4, "RLTrainer's training_step .* replaces HF's"),
    ("dataloader_in_order", False, "batches come from the rollout source"),
    # HF pushed from inside its save (huggingface_hub's upload_folder, mocked, saw it): last-checkpoint from the partial
    # folder, without verifiers_rl_state.json and renamed away during the background upload, and the run folder's
    # upload with the .partial-checkpoint-N folder in it.
    ("push_to_hub", True, "uploads a checkpoint while it is still being written"),
    ("hub_strategy", "all_checkpoints", "it acts only with push_to_hub, which is refused"),
])
def test_training_arguments_that_would_act_wrongly_or_not_at_all_are_refused(name, value, why):
    with pytest.raises(ValueError, match=rf"^{name}={value!r} has no effect in verifiers_rl: .*{why}"):
        RLConfig(output_dir="/tmp/unused", report_to="none", **{name: value})


def test_defaults_and_acting_fields_are_accepted():
    config = RLConfig(output_dir="/tmp/unused", report_to="none", beta=0.04, epsilon_high=0.28, top_p=0.9, top_k=20,
                      mask_truncated_completions=True, disable_dropout=True, num_completions_to_print=2, min_p=0.1,
                      repetition_penalty=1.2, generation_kwargs={"top_p": 0.95})
    assert (config.beta, config.top_k, config.num_completions_to_print) == (0.04, 20, 2)
    assert (config.min_p, config.repetition_penalty, config.top_p) == (0.1, 1.2, 0.95)


def test_the_documented_table_is_the_codes_table():
    documented = (Path(__file__).parents[2] / grpo_fields.TABLE_FILE).read_text()
    assert grpo_fields.markdown_table() in documented, (
        f"regenerate it: python -m verifiers_rl.config.grpo_fields --write {grpo_fields.TABLE_FILE}")


def test_the_package_exports_its_public_names():
    import verifiers_rl

    for name in verifiers_rl.__all__:
        assert getattr(verifiers_rl, name) is not None, name
    from verifiers_rl import RLConfig as Exported, RLTrainer

    assert Exported is RLConfig and RLTrainer.__module__ == "verifiers_rl.training.trainer"
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        verifiers_rl.Nothing  # noqa: B018


def test_the_command_line_parser_defaults_pass():
    # HfArgumentParser turns some fields' defaults into other types (include_num_input_tokens_seen: "no" -> False).
    from verifiers_rl.cli.train import build_parser  # the command examples/train.py runs

    _, config = build_parser().parse_args_and_config(args=["--output_dir", "/tmp/unused"])
    assert config.include_num_input_tokens_seen == "no"


def test_trls_names_map_onto_ours_and_a_conflict_is_refused():
    def config(**values):
        return RLConfig(output_dir="/tmp/unused", report_to="none", **values)

    assert config(loss_type="dapo").loss_type == config(loss_type="bnpo").loss_type == "token_mean"
    with pytest.raises(ValueError, match="loss_type='cispo' is one of TRL's losses"):
        config(loss_type="cispo")
    mapped = config(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_min=0.2)
    assert (mapped.importance_correction, mapped.importance_cap, mapped.importance_cap_min,
            mapped.importance_sequence_log_ratio) == ("sequence_mask", 3.0, 0.2, "sum")  # TRL's clip_max default
    unbounded = config(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=None)
    assert unbounded.importance_cap == float("inf")
    assert config(vllm_importance_sampling_correction=False).importance_correction == "none"
    ours = config()  # TRL's fields at their defaults: ours apply
    assert (ours.importance_correction, ours.importance_cap, ours.importance_sequence_log_ratio) == (
        "token_truncate", 2.0, "mean")
    assert config(vllm_importance_sampling_mode="token_mask", importance_correction="token_mask").importance_cap == 3.0
    # (One of ours at its default cannot be told from one left unset: TRL's fields then decide.)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode .*importance_correction='sequence_truncate'"):
        config(vllm_importance_sampling_mode="token_mask", importance_correction="sequence_truncate")
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_max .*importance_cap=1.5"):
        config(vllm_importance_sampling_clip_max=5.0, importance_cap=1.5)


def test_trls_importance_knobs_without_its_correction_are_refused_and_a_token_mode_keeps_our_log_ratio():
    # vllm_importance_sampling_correction=False turns TRL's correction off: its mode and bounds would tune nothing.
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min acts only with "
                                         "vllm_importance_sampling_correction=True"):
        RLConfig(output_dir="/tmp/unused", report_to="none", vllm_importance_sampling_correction=False,
                 vllm_importance_sampling_clip_min=0.5)
    # A token mode has no sequence log-ratio: TRL's "sum" is not carried over (ours would then be refused as unused).
    token = RLConfig(output_dir="/tmp/unused", report_to="none", vllm_importance_sampling_mode="token_mask")
    assert (token.importance_correction, token.importance_sequence_log_ratio) == ("token_mask", "mean")
