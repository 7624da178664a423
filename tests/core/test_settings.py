"""core.settings.settings_from: every part's settings are filled from the config by one builder, each field from the
config field its metadata names (or of its own name); a field with no source is refused by name."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.curriculum import CurriculumSettings
from verifiers_rl.core.settings import settings_from, source_of
from verifiers_rl.inference.factory import sampling_settings, vllm_settings
from verifiers_rl.rollouts.evaluation import EvalSettings
from verifiers_rl.training.step_batches import batching_config
from verifiers_rl.training.step_loss import loss_settings

# Every config field a settings field is filled from, at a value other than the config's default: a mapping that is
# dropped or bypassed shows.
KNOBS = dict(
    # LossSettings
    importance_sampling_level="sequence", epsilon=0.3, epsilon_high=0.4, delta=1.5, importance_correction="sequence_mask",
    importance_cap=3.0, importance_cap_min=0.1, importance_sequence_log_ratio="sum", beta=0.05,
    use_bias_correction_kl=False, off_policy_mask_threshold=0.7,
    # BatchingConfig
    micro_batching="padded", per_device_train_batch_size=3, max_tokens_per_microbatch=3000, max_seq_len=700,
    dr_grpo_horizon=800, overlong="truncate", mask_truncated_completions=True, scale_rewards="batch",
    share_prompt_training="on",
    # SamplingConfig
    temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1, max_completion_length=99,
    # VLLMSettings
    vllm_max_concurrency=7, vllm_request_timeout_s=77.0, vllm_max_retries=5, vllm_reconnect_timeout_s=30.0,
    vllm_server_timeout=45.0,
    vllm_weights_dir="/tmp/weights", vllm_weight_transfer="gloo", vllm_weight_transfer_address="10.0.0.1",
    weight_sync_bucket_mb=64.0, chat_template_kwargs={"enable_thinking": False},
    # EvalSettings
    eval_num_examples=4, eval_samples_per_prompt=3, eval_temperature=0.5, eval_pass_threshold=0.5, seed=7,
    generation_timeout_s=120.0,
    # CurriculumSettings
    curriculum_window=3, curriculum_pass_reward=0.8, curriculum_easy_above=0.9, curriculum_hard_below=0.1,
    curriculum_set_aside_epochs=2,
)
# Given by the run, not the config: checked on their own below.
RUN_GIVEN = {"world_size", "reward_functions", "pad_token_id", "attention_cost", "run_attention", "token_versions"}


def config() -> RLConfig:
    # eval_steps, loss_type: the eval_* knobs and dr_grpo_horizon act only with them (RLConfig refuses them without).
    return RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, rollouts_per_step=8,
                    vllm_server_url="http://127.0.0.1:8000", eval_steps=1, loss_type="dr_grpo", **KNOBS)


def test_every_settings_field_carries_its_config_fields_value(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    built = config()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batching = batching_config(built, model, world_size=2, pad_token_id=5, reward_functions=(("r", 1.0),))
    defaults = {f.name: f.default for f in fields(RLConfig)}
    read = set()
    for settings in (loss_settings(built), batching, sampling_settings(built), vllm_settings(built),
                     EvalSettings.from_config(built), settings_from(built, CurriculumSettings)):
        for f in fields(settings):
            if f.name in RUN_GIVEN:
                continue
            source = source_of(f)
            read.add(source)
            assert source in KNOBS, f"{type(settings).__name__}.{f.name}: set {source} in KNOBS"
            assert KNOBS[source] != defaults[source], f"{source}: a value the config would not have by default"
            assert getattr(settings, f.name) == KNOBS[source], f"{type(settings).__name__}.{f.name} from {source}"
    assert read == set(KNOBS)  # no knob here that no settings field reads
    assert (batching.world_size, batching.pad_token_id, batching.reward_functions) == (2, 5, (("r", 1.0),))
    # A vLLM client records each token's version (TokenVersions) when groups stream through weight loads, only then.
    assert vllm_settings(built).token_versions is False
    continuous = RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, rollouts_per_step=8,
                          vllm_server_url="http://127.0.0.1:8000", groups_in_flight=2)
    assert vllm_settings(continuous).token_versions is True


def test_a_settings_field_without_a_source_is_refused_by_name():
    @dataclass
    class Orphan:
        knob: int = 0

    @dataclass
    class FromProperty:
        world_size: int = 1  # RLConfig.world_size is a property, not a field: no source

    built = RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True)
    with pytest.raises(TypeError, match=r"Orphan.knob has no source: RLConfig has no field 'knob'"):
        settings_from(built, Orphan)
    with pytest.raises(TypeError, match=r"FromProperty.world_size has no source"):
        settings_from(built, FromProperty)
    assert settings_from(built, FromProperty, world_size=3).world_size == 3  # what the run gives
    with pytest.raises(TypeError, match=r"Orphan has no field unknown"):
        settings_from(built, Orphan, knob=1, unknown=2)
