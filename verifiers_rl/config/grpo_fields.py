"""What each of TRL's ``GRPOConfig`` fields does here: it acts, or a value other than its default is refused.

``RLConfig`` inherits every ``GRPOConfig`` (and ``TrainingArguments``) field, so each is a flag a user can set. A
setting that is accepted and does nothing is the worst outcome (the user believes it), so ``GRPO_FIELDS`` classifies
every field TRL adds to ``TrainingArguments``, and ``TRAINING_ARGUMENTS_REFUSED`` the ``TrainingArguments`` fields
that have no effect on a trainer whose batches come from a rollout source (the others act as transformers documents).
``check_fields`` refuses a non-default value of a refused field at start-up, naming it, why, and what to use.
``tests/config/test_grpo_fields.py`` compares the table with ``dataclasses.fields(GRPOConfig)``: a TRL upgrade that adds
a field fails there until it is classified. ``python -m verifiers_rl.config.grpo_fields`` (or ``verifiers-rl fields``)
prints the table of docs/trl.md; ``--write`` rewrites it there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

from verifiers_rl.core.choices import LOSS_TYPES

Status = Literal["acts", "refused"]


class Field(NamedTuple):
    status: Status
    note: str  # acts: how; refused: why, and what to use instead


def _acts(note: str) -> Field:
    return Field("acts", note)


def _refused(note: str) -> Field:
    return Field("refused", note)


_TRL_VLLM = _refused("TRL's own vLLM client; start ours (`verifiers-rl vllm-serve --model "
                     "MODEL --port PORT`) and pass --vllm_server_url http://HOST:PORT")
_ADAPTIVE = _refused("the adaptive entropy controller is not implemented; a fixed --entropy_coef acts")
_IS = _acts("when any vllm_importance_sampling_* field is set, TRL's correction (its defaults fill the rest) "
            "replaces ours: --importance_correction = the mode (none when correction=False, which refuses the "
            "others), --importance_cap [_min] = clip_max [_min], a sequence mode's log-ratio summed "
            "(--importance_sequence_log_ratio sum); "
            "left at TRL's defaults, --importance_correction applies (token_truncate, cap 2, both engines)")
_SEQUENCE_LOSSES = _refused("the SAPO / VESPO losses are not implemented (--loss_type lists ours)")
_CONTINUOUS = _refused("the embedded engine batches concurrent requests itself (per event loop)")

GRPO_FIELDS: dict[str, Field] = {
    "model_init_kwargs": _acts("TRL loads a model given by id with them; the embedded engine's copy with those that "
                               "choose the weights (revision, subfolder, ...: inference.factory.WHICH_WEIGHTS)"),
    "trust_remote_code": _acts("TRL loads a model given by id with it, and so does the embedded engine its copy"),
    "router_aux_loss_coef": _refused("a MoE router's auxiliary loss is not added to our loss; a custom loss_fn can"),
    "disable_dropout": _acts("TRL's constructor disables dropout in the model"),
    "cast_lm_head_to_fp32": _acts("TRL keeps the output layer in fp32 (its forward patch is restored after each "
                                  "of our log-prob forwards); our log-probs are computed in fp32 either way"),
    "num_generations": _acts("rollouts per prompt (a group) when generating from an environment"),
    "num_generations_eval": _refused("evaluation samples --eval_samples_per_prompt per prompt"),
    "max_completion_length": _acts("the engine's new-token limit (the length contract, README Environments)"),
    "ds3_gather_for_generation": _refused("generation runs in its own engine; the ZeRO-3 gather for the weight "
                                          "sync is bounded by --weight_sync_bucket_mb"),
    "shuffle_dataset": _acts("live generation draws prompts by a shuffle seeded by --seed, each epoch anew; False: "
                             "in the dataset's order (dynamic sampling's refills stay seeded draws); replay trains "
                             "the file in order either way"),
    "pad_to_multiple_of": _refused("micro-batches are padded to their longest row or packed (--micro_batching)"),
    "generation_batch_size": _refused("a batch is --rollouts_per_step rollouts, one optimizer step"),
    "steps_per_generation": _refused("generation runs --max_off_policy_steps batches ahead"),
    "temperature": _acts("sampling temperature of the engines, and of the trainer's log-probs"),
    "top_p": _acts("nucleus sampling in both engines (the sampler's log-probs are of the renormalised distribution)"),
    "top_k": _acts("top-k sampling in both engines (0 = off)"),
    "min_p": _acts("min-p sampling in both engines, after the temperature and before top-k / top-p (vLLM's order; "
                   "the sampler's log-probs are of the renormalised distribution)"),
    "generation_kwargs": _acts("only temperature, top_p, top_k, min_p, repetition_penalty: each overrides its field "
                               "(the trainer's log-prob temperature too); any other key is refused by name"),
    "chat_template_kwargs": _acts("variables of every chat template the run applies: environments' prompts, tool "
                                  "turns and the tokens between turns (Environment.use_chat_template_kwargs, called "
                                  "from the config by the trainer, examples/train.py and `verifiers-rl eval "
                                  "--chat_template_kwargs`; the rows are length-filtered again), classic verifiers "
                                  "environments, TRL-form reward models' templates (as TRL) and the vLLM engine's "
                                  "chat(); keys the rendering sets itself (tools, add_generation_prompt, ...) and "
                                  "environments with a render() of their own refuse them"),
    "repetition_penalty": _acts("in both engines, on the raw logits of tokens in the prompt or generated so far "
                                "(HF / vLLM semantics; the sampler's log-probs are of the penalised distribution)"),
    "cache_implementation": _refused("the embedded engine keeps its own KV cache (a group's prompt prefilled once)"),
    "use_vllm": _TRL_VLLM,
    "vllm_mode": _TRL_VLLM,
    "vllm_model_impl": _TRL_VLLM,
    "vllm_enable_sleep_mode": _TRL_VLLM,
    "vllm_structured_outputs_regex": _TRL_VLLM,
    "vllm_server_base_url": _TRL_VLLM,
    "vllm_server_host": _TRL_VLLM,
    "vllm_server_port": _TRL_VLLM,
    "vllm_server_timeout": _acts("with --vllm_server_url: how long the run's first check waits for a server that is "
                                 "still starting (polling its /health, saying so) before it stops naming the URL"),
    "vllm_group_port": _TRL_VLLM,
    "vllm_gpu_memory_utilization": _TRL_VLLM,
    "vllm_max_model_length": _TRL_VLLM,
    "vllm_tensor_parallel_size": _TRL_VLLM,
    "beta": _acts("KL coefficient against the reference model (under LoRA the base model, or the initial adapters "
                   "of a PeftModel given with trained ones, as TRL)"),
    "num_iterations": _acts("updates per batch (proximal log-probs computed once per batch)"),
    "epsilon": _acts("lower clip of the PPO ratio"),
    "delta": _acts("the two-sided (INTELLECT-2) clip: the unclipped ratio is bounded by delta too"),
    "epsilon_high": _acts("upper clip of the PPO ratio (default: epsilon)"),
    "sapo_temperature_neg": _SEQUENCE_LOSSES,
    "sapo_temperature_pos": _SEQUENCE_LOSSES,
    "vespo_k_pos": _SEQUENCE_LOSSES,
    "vespo_lambda_pos": _SEQUENCE_LOSSES,
    "vespo_k_neg": _SEQUENCE_LOSSES,
    "vespo_lambda_neg": _SEQUENCE_LOSSES,
    "importance_sampling_level": _acts("token or sequence (GSPO) ratio"),
    "reward_weights": _acts("weights of TRL-style reward_funcs (RLTrainer(reward_funcs=..., train_dataset=...)); "
                            "with an environment its rubric weights its own functions, and a value is refused"),
    "multi_objective_aggregation": _acts("sum_then_normalize: the weighted sum of the rewards, normalised by "
                                         "--scale_rewards; normalize_then_sum (TRL-style reward_funcs only): each "
                                         "function standardised in its group, weighted, summed, then standardised "
                                         "over the step batch (TRL's formula; --scale_rewards does not apply)"),
    "scale_rewards": _acts("advantage scaling: group, batch or none"),
    "loss_type": _acts(f"aggregation over the global batch ({', '.join(LOSS_TYPES)}; TRL's "
                       "dapo = token_mean, bnpo = token_mean over the global batch, not the local one). Our default "
                       "is grpo, TRL 1.16's dapo"),
    "mask_truncated_completions": _acts("truncated completions get no loss"),
    "sync_ref_model": _acts("TRL's SyncRefModelCallback: every ref_model_sync_steps optimizer steps, reference = "
                            "alpha * policy + (1 - alpha) * reference (ZeRO-3: gathered); checkpoints keep the "
                            "reference (reference_model.safetensors) so a resume continues exactly; under PEFT (which "
                            "TRL refuses) the reference is the base model with a copy of the adapters, mixed the "
                            "same way (not with ZeRO-3); refused with beta = 0 (TRL's check)"),
    "ref_model_mixup_alpha": _acts("alpha of sync_ref_model's mix; refused without sync_ref_model"),
    "ref_model_sync_steps": _acts("optimizer steps between sync_ref_model's mixes; refused without sync_ref_model"),
    "top_entropy_quantile": _acts("the policy loss trains only tokens whose entropy is in the top quantile of the "
                                  "whole step batch (TRL: of each micro-batch); one extra gradient-free forward "
                                  "per step"),
    "entropy_coef": _acts("entropy bonus: loss - entropy_coef * mean entropy of the trained tokens of the whole batch"),
    "use_adaptive_entropy": _ADAPTIVE,
    "entropy_coef_min": _ADAPTIVE,
    "entropy_coef_max": _ADAPTIVE,
    "entropy_coef_delta": _ADAPTIVE,
    "entropy_target": _ADAPTIVE,
    "max_tool_calling_iterations": _refused("tool turns belong to the environment (a ToolEnv's max_turns)"),
    "vllm_importance_sampling_correction": _IS,
    "vllm_importance_sampling_mode": _IS,
    "vllm_importance_sampling_clip_max": _IS,
    "vllm_importance_sampling_clip_min": _IS,
    "vllm_importance_sampling_cap": _IS,
    "off_policy_mask_threshold": _acts("DeepSeek-V3.2's off-policy sequence mask: a negative-advantage sequence "
                                       "whose mean KL(sampler || policy) exceeds it gets no policy loss"),
    "use_bias_correction_kl": _acts("the KL term is r * k3 (r the PPO ratio: importance-weighted to the policy "
                                    "that sampled), TRL's default; False: plain k3; refused with beta = 0"),
    "log_completions": _acts("means --log_completions_steps = --logging_steps (tables of the trained batch); refused "
                             "without a --report_to backend that shows tables"),
    "log_multimodal": _refused("text only: there are no images to log"),
    "num_completions_to_print": _acts("sample completions printed every --print_samples_every steps; refused with "
                                      "--print_samples_every 0"),
    "log_unique_prompts": _refused("completion tables show the trained batch as it is"),
    "log_completions_hub_repo": _refused("completion tables go to the --report_to backends only"),
    "use_transformers_continuous_batching": _CONTINUOUS,
    "transformers_continuous_batching_config": _CONTINUOUS,
    "use_transformers_paged": _CONTINUOUS,
}

_NO_DATALOADER = "batches come from the rollout source, not a DataLoader over a dataset"
# FSDP's sharded parameters, checkpoints and weight gathering are untested here: the exactness checks cover these two.
_NO_FSDP = ("FSDP is not supported (the weight sync, checkpoints and the exactness checks are built and tested for "
            "DDP and DeepSpeed ZeRO-3): shard the model with ZeRO-3, accelerate launch --config_file "
            "accelerate_configs/zero3.yaml (zero3_cpu.yaml on CPU)")
_NO_HF_EVAL = "evaluation rolls out the held-out split through the engine (--eval_steps, --eval_num_examples)"
# HF pushes a checkpoint from inside its save, in a background upload: ours is then still a partial folder (without
# this run's state), renamed away once complete; the run folder's upload took the partial folders too.
_NO_PUSH = ("HF's push uploads a checkpoint while it is still being written (a partial folder, without this run's "
            "state, renamed once complete: docs/durability.md), so the Hub got half a checkpoint that cannot be "
            "resumed; upload --output_dir (or a checkpoint-N in it) after training: `hf upload REPO_ID OUTPUT_DIR`")
_PUSH_ONLY = "it acts only with push_to_hub, which is refused: " + _NO_PUSH
TRAINING_ARGUMENTS_REFUSED: dict[str, str] = {
    "label_smoothing_factor": "the loss is the policy-gradient surrogate, not cross-entropy",
    "average_tokens_across_devices": "the loss is normalised by the global batch's counts already (exact over ranks)",
    "use_liger_kernel": "the chunked log-prob kernel already keeps full logits from existing (--logprob_chunk_size)",
    "liger_kernel_config": "see use_liger_kernel",
    "include_num_input_tokens_seen": "tokens_forwarded / tokens_unique / loss_tokens are logged every step",
    "auto_find_batch_size": "micro-batches are sized by --max_tokens_per_microbatch / --per_device_train_batch_size",
    "bf16_full_eval": _NO_HF_EVAL,
    "fp16_full_eval": _NO_HF_EVAL,
    "per_device_eval_batch_size": _NO_HF_EVAL,
    "prediction_loss_only": _NO_HF_EVAL,
    "eval_do_concat_batches": _NO_HF_EVAL,
    "eval_use_gather_object": _NO_HF_EVAL,
    "eval_accumulation_steps": _NO_HF_EVAL,
    "include_for_metrics": _NO_HF_EVAL,
    "batch_eval_metrics": _NO_HF_EVAL,
    "label_names": _NO_DATALOADER,
    "length_column_name": _NO_DATALOADER,
    "train_sampling_strategy": _NO_DATALOADER,
    "remove_unused_columns": _NO_DATALOADER,
    "dataloader_drop_last": _NO_DATALOADER,
    "dataloader_num_workers": _NO_DATALOADER,
    "dataloader_pin_memory": _NO_DATALOADER,
    "dataloader_persistent_workers": _NO_DATALOADER,
    "dataloader_prefetch_factor": _NO_DATALOADER,
    "dataloader_multiprocessing_context": _NO_DATALOADER,
    "dataloader_in_order": _NO_DATALOADER,
    "data_seed": "prompts are drawn by a shuffle seeded by --seed",
    "torch_empty_cache_steps": "RLTrainer's training_step (every micro-batch of one optimizer step) replaces HF's, "
                               "which emptied the device cache; it is not implemented",
    "enable_jit_checkpoint": "SIGTERM and Ctrl-C already finish the step and write a checkpoint on every rank "
                             "(docs/durability.md); HF's handler, replaced by ours during training, was put back "
                             "after it and left SIGTERM ignored",
    "neftune_noise_alpha": "noise on the training forward's embeddings, not the sampler's: the trained log-probs "
                           "would differ from the sampled policy's, and the importance ratio and PPO clip measure "
                           "the noise (NEFTune is for supervised fine-tuning)",
    "ignore_data_skip": "a resumed run continues the rollout source exactly where the checkpoint stood",
    "fsdp": _NO_FSDP,
    "fsdp_config": _NO_FSDP,
    "push_to_hub": _NO_PUSH,
    "hub_model_id": _PUSH_ONLY,
    "hub_strategy": _PUSH_ONLY,
    "hub_token": _PUSH_ONLY,
    "hub_private_repo": _PUSH_ONLY,
    "hub_always_push": _PUSH_ONLY,
    "hub_revision": _PUSH_ONLY,
}


def _default(dataclass_field: dataclasses.Field):
    if dataclass_field.default is not dataclasses.MISSING:
        return dataclass_field.default
    if dataclass_field.default_factory is not dataclasses.MISSING:
        return dataclass_field.default_factory()
    return dataclasses.MISSING


# Fields whose parsed form differs from their default's: HfArgumentParser reads ``str | bool`` as a bool, which
# TrainingArguments then maps to its strings (transformers 5.23).
_AS_PARSED = {"include_num_input_tokens_seen": lambda v: {False: "no", True: "all"}.get(v, v) if isinstance(v, bool) else v}


def refused_fields() -> dict[str, str]:
    """Every refused field and its reason."""
    refused = {name: field.note for name, field in GRPO_FIELDS.items() if field.status == "refused"}
    refused.update(TRAINING_ARGUMENTS_REFUSED)
    return refused


def check_fields(config) -> None:
    """Raise ValueError naming the first refused field whose value differs from its default on ``type(config)``
    (call it before ``__post_init__`` derives anything)."""
    refused = refused_fields()
    for dataclass_field in dataclasses.fields(config):
        if dataclass_field.name not in refused:
            continue
        value, default = getattr(config, dataclass_field.name), _default(dataclass_field)
        normal = _AS_PARSED.get(dataclass_field.name, lambda v: v)
        if normal(value) != normal(default):
            raise ValueError(
                f"{dataclass_field.name}={value!r} has no effect in verifiers_rl: {refused[dataclass_field.name]}. "
                f"Leave it at its default ({default!r})."
            )


# TRL's loss types that are ours under another name. TRL's bnpo divides by the tokens of the local batch, an
# approximation of the global token mean (equal with one process and one micro-batch); dapo is the global mean.
TRL_LOSS_TYPES = {"dapo": "token_mean", "bnpo": "token_mean"}
_TRL_ONLY_LOSSES = ("cispo", "sapo", "vespo", "luspo")
_TRL_IS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
           "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap")
_TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _is_set(config, name: str) -> bool:
    (dataclass_field,) = [f for f in dataclasses.fields(config) if f.name == name]
    return getattr(config, name) != _default(dataclass_field)


def trl_importance_correction(config) -> dict | None:
    """Our importance-correction fields for the ``vllm_importance_sampling_*`` fields a user set, TRL's meaning
    (TRL's defaults fill the unset ones): ratio exp(p - q) per token, or exp(sum_t (p - q)) per sequence; truncate
    clamps to [clip_min, clip_max], mask zeroes outside it (no bound where None); correction=False turns it off
    (and refuses the others: nothing left to tune).
    None when none is set (ours apply as given)."""
    if not any(_is_set(config, name) for name in _TRL_IS):
        return None
    if not config.vllm_importance_sampling_correction:
        tuned = [name for name in _TRL_IS if name != "vllm_importance_sampling_correction" and _is_set(config, name)]
        if tuned:
            raise ValueError(f"{tuned[0]} acts only with vllm_importance_sampling_correction=True, which this run "
                             "turns off: it would change nothing. Leave it out, or turn the correction on.")
        return {"importance_correction": "none"}
    mode = config.vllm_importance_sampling_mode
    if mode not in _TRL_IS_MODES:
        raise ValueError(f"Unknown vllm_importance_sampling_mode {mode!r}; expected one of {', '.join(_TRL_IS_MODES)}.")
    clip_max = config.vllm_importance_sampling_cap or config.vllm_importance_sampling_clip_max  # cap: deprecated
    ours = {
        "importance_correction": mode,
        "importance_cap": math.inf if clip_max is None else clip_max,
        "importance_cap_min": config.vllm_importance_sampling_clip_min,
    }
    if mode.startswith("sequence"):  # a token mode has no sequence log-ratio to sum
        ours["importance_sequence_log_ratio"] = "sum"
    return ours


def apply_trl_names(config) -> None:
    """Carry TRL's names for what our fields do over to ours (call before validation): ``loss_type`` dapo / bnpo,
    and the ``vllm_importance_sampling_*`` fields (``trl_importance_correction``). One of ours set to another
    value than the TRL fields say is an error naming both."""
    if config.loss_type in _TRL_ONLY_LOSSES:
        raise ValueError(f"loss_type={config.loss_type!r} is one of TRL's losses that verifiers_rl does not implement; "
                         f"ours: {', '.join(LOSS_TYPES)} (TRL's dapo and bnpo are token_mean).")
    config.loss_type = TRL_LOSS_TYPES.get(config.loss_type, config.loss_type)
    ours = trl_importance_correction(config)
    for name, value in (ours or {}).items():
        if _is_set(config, name) and getattr(config, name) != value:
            trl = next(n for n in _TRL_IS if _is_set(config, n))
            raise ValueError(
                f"{trl} (TRL's importance correction, which sets {name}={value!r}) and {name}="
                f"{getattr(config, name)!r} (ours) disagree: set one of them."
            )
        setattr(config, name, value)


def markdown_table() -> str:
    """The table of GRPOConfig fields in docs/trl.md (what ``python -m verifiers_rl.config.grpo_fields`` prints)."""
    lines = ["| GRPOConfig field | here | how / why |", "| --- | --- | --- |"]
    for name, field in GRPO_FIELDS.items():
        lines.append(f"| `{name}` | {field.status} | {field.note} |")
    lines += ["", "| TrainingArguments field | here | why |", "| --- | --- | --- |"]
    for name, note in TRAINING_ARGUMENTS_REFUSED.items():
        lines.append(f"| `{name}` | refused | {note} |")
    return "\n".join(lines)


# The markdown file that holds the table (``python -m verifiers_rl.config.grpo_fields --write`` rewrites it there).
TABLE_FILE = "docs/trl.md"


def write_into(path: str = TABLE_FILE) -> None:
    """Replace the table in the markdown file ``path`` (from its header row to the last row of the second table)."""
    with open(path) as handle:
        text = handle.read()
    start = text.index("| GRPOConfig field | here | how / why |")
    lines = text[start:].split("\n")
    n = 0
    while n < len(lines) and (lines[n].startswith("|") or (not lines[n] and n + 1 < len(lines) and lines[n + 1].startswith("|"))):
        n += 1
    with open(path, "w") as handle:
        handle.write(text[:start] + markdown_table() + "\n" + "\n".join(lines[n:]))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write"]:  # python -m verifiers_rl.config.grpo_fields --write [docs/trl.md]
        write_into(*sys.argv[2:3])
    else:
        print(markdown_table())
