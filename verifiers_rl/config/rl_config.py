"""RLConfig: every knob of the trainer, validated once in ``__post_init__``."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Literal, get_args, get_origin, get_type_hints

import torch
from trl import GRPOConfig

from verifiers_rl import compat
from verifiers_rl.config.grpo_fields import TRL_LOSS_TYPES, apply_trl_names, check_fields, refused_fields
from verifiers_rl.core.choices import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    CorrectionMode,
    ImportanceSamplingLevel,
    LossType,
    MicroBatchingMode,
    OverlongPolicy,
    RewardAggregation,
    ScaleRewards,
    SEQUENCE_CORRECTIONS,
    SequenceLogRatio,
    Range,
    SharePromptTraining,
    check_chat_template_kwargs,
    check_choice,
    check_packed_row_fits,
    field_ranges,
)
from verifiers_rl.core.curriculum import EASY_RANGE, HARD_RANGE, CurriculumSettings
from verifiers_rl.core.paths import unwritable
from verifiers_rl.core.launch import (deepspeed_config_found, launched_fsdp, launched_mixed_precision,
                                      launched_world_size)
from verifiers_rl.inference.vllm.http import SERVER_WAIT_S, check_server_url
from verifiers_rl.inference.vllm.weight_transfer import WeightTransfer


# TRL's loss_type names for ours (grpo_fields.TRL_LOSS_TYPES), accepted by the parser and mapped in __post_init__.
LossTypeOrTRL = Literal[(*get_args(LossType), *TRL_LOSS_TYPES)]

# GRPOConfig's fields the trainer relies on, with their ranges (ours declare theirs in their type, Annotated[int, R];
# validate checks both, --help and docs/config.md list them).
INHERITED_RANGES: dict[str, Range] = {
    "max_completion_length": AT_LEAST_ONE,
    "per_device_train_batch_size": AT_LEAST_ONE,
    "temperature": POSITIVE,
    "num_iterations": AT_LEAST_ONE,
    "beta": NON_NEGATIVE,  # TRL takes a negative one: a loss that rewards moving away from the reference
    "epsilon": NON_NEGATIVE,
    "epsilon_high": NON_NEGATIVE,
    # min(r, delta) A at delta <= 1 is constant near r = 1: a positive advantage's token got no gradient.
    "delta": Range(1, strict=True),
    "off_policy_mask_threshold": NON_NEGATIVE,
    "top_entropy_quantile": Range(0, strict=True, high=1),
    "ref_model_mixup_alpha": Range(0, high=1),  # a weight of a mix: above 1 extrapolates past the policy
    "num_completions_to_print": AT_LEAST_ONE,  # 0 printed the default 3, a negative one every group
    "ref_model_sync_steps": AT_LEAST_ONE,  # TRL's callback mixes when global_step % it == 0 (0: a ZeroDivisionError)
    "logging_steps": POSITIVE,  # a float below 1: that fraction of the run's steps (as eval_steps, save_steps)
    "eval_steps": POSITIVE,
    "save_steps": POSITIVE,
    "save_total_limit": AT_LEAST_ONE,  # unset: keep every checkpoint
    "seed": NON_NEGATIVE,
    "learning_rate": NON_NEGATIVE,  # a negative one ascends the loss; NaN (refused too) makes every weight NaN
    "max_grad_norm": NON_NEGATIVE,  # HF clips above 0 only: a negative norm turned clipping off without a word
    "weight_decay": NON_NEGATIVE,  # a negative one grows the weights
}


# generation_kwargs keys both engines honour exactly; as in TRL they override the field of the same name (here by
# setting it, so the engines and the trainer's log-prob temperature read one value).
GENERATION_KWARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_LENGTH_KWARG = ("the completion length is --max_completion_length (checked against the environment's limits); "
                 "set it instead")
_GENERATION_KWARGS_REFUSED = {
    "max_tokens": _LENGTH_KWARG,
    "max_new_tokens": _LENGTH_KWARG,
    "presence_penalty": "not implemented in the embedded engine",
    "frequency_penalty": "not implemented in the embedded engine",
    "seed": "each rollout's seed derives from --seed",
    "n": "--num_generations sets the samples per prompt",
    "num_return_sequences": "--num_generations sets the samples per prompt",
    "do_sample": "the engines sample at --temperature > 0; greedy decoding (temperature 0) is for evaluation only",
}


def apply_generation_kwargs(config) -> None:
    """Write ``config.generation_kwargs`` into the sampling fields it names; raise ValueError naming a key that
    both engines cannot honour exactly (a sampler that differs from what the log-probs say biases training)."""
    kwargs = config.generation_kwargs
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise ValueError(f"generation_kwargs must be a dict (a JSON object on the command line), got {kwargs!r}.")
    for key, value in kwargs.items():
        if key not in GENERATION_KWARGS:
            why = _GENERATION_KWARGS_REFUSED.get(key, "not implemented in both engines (embedded and vLLM)")
            raise ValueError(f"generation_kwargs[{key!r}] is refused: {why}. Accepted keys: "
                             f"{', '.join(map(repr, GENERATION_KWARGS))}.")
        if isinstance(value, bool) or not isinstance(value, int if key == "top_k" else (int, float)):
            raise ValueError(f"generation_kwargs[{key!r}] must be {'an int' if key == 'top_k' else 'a number'}, "
                             f"got {value!r}.")
        setattr(config, key, value)


@dataclass
class RLConfig(compat.DeviceSetupHooks, GRPOConfig):
    """GRPOConfig plus the fields of the exact, asynchronous trainer.

    One optimizer step consumes ``rollouts_per_step`` rollouts, spread over ranks and micro-batches however
    ``micro_batching`` says; the update equals the single-device full-batch update. ``gradient_accumulation_steps``
    only sizes the default batch: the trainer runs every micro-batch of a step inside one ``training_step``, and
    shows TRL 1 (``trl_view``; the config keeps what the user gave, as it keeps every field).

    Over 300 lines: its body is the field declarations (each one a flag with its help); the checks are ``validate``
    and the module's functions.
    """

    loss_type: LossTypeOrTRL = field(
        default="grpo",
        metadata={
            "help": "Aggregation over the global batch: grpo (sequence mean of token means), dr_grpo (token sum / "
            "(valid sequences * horizon)), token_mean (DAPO; TRL's names dapo and bnpo mean it too), "
            "seq_mean_token_sum.",
        },
    )
    importance_sampling_level: ImportanceSamplingLevel = field(
        default="token", metadata={"help": "PPO ratio per token, or per sequence (GSPO, length-normalised)."}
    )
    importance_correction: CorrectionMode = field(
        default="token_truncate",
        metadata={
            "help": "Correction between the proximal and the sampler policy, when rollouts carry sampler log-probs: "
            "token_truncate (w = min(exp(p - q), cap)), token_mask, sequence_truncate, sequence_mask, none.",
        },
    )
    importance_cap: Annotated[float, POSITIVE] = field(
        default=2.0, metadata={"help": "Upper bound C of the importance weight."}
    )
    importance_sequence_log_ratio: SequenceLogRatio = field(
        default="mean",
        metadata={"help": "The sequence modes' log-ratio: mean over the sequence's tokens (length-normalised) or "
                  "sum (TRL's vllm_importance_sampling sequence modes)."},
    )
    importance_cap_min: Annotated[float | None, NON_NEGATIVE] = field(
        default=None, metadata={"help": "Lower bound of the importance weight (mask modes: the lower edge)."}
    )
    max_seq_len: Annotated[int, AT_LEAST_ONE] = field(
        default=1024, metadata={"help": "Longest prompt + completion trained on, in tokens."}
    )
    overlong: OverlongPolicy = field(
        default="error",
        metadata={
            "help": "A rollout longer than max_seq_len: 'error' refuses the batch (a replay's file: at start), "
            "'truncate' cuts the completion's tail and marks it truncated (before any count is taken).",
        },
    )
    dr_grpo_horizon: Annotated[int | None, AT_LEAST_ONE] = field(
        default=None, metadata={"help": "Horizon H of dr_grpo; defaults to max_seq_len."}
    )
    micro_batching: Literal[MicroBatchingMode, "auto"] = field(
        default="auto",
        metadata={
            "help": "padded: per_device_train_batch_size rows per micro-batch (length-sorted); packed: padding-free "
            "rows of at most max_tokens_per_microbatch tokens; auto: packed with a flash-attention (varlen) kernel; "
            "otherwise whichever of the two the cost model (tokens + the attention cells computed: run by run in a "
            "packed row with sdpa, over the whole row with eager; + a fixed cost per micro-batch) finds cheaper for "
            "each batch. All three are exact.",
        },
    )
    max_tokens_per_microbatch: Annotated[int | None, AT_LEAST_ONE] = field(
        default=None, metadata={"help": "Token budget of a packed micro-batch; defaults to 4 * max_seq_len."}
    )
    rollouts_per_step: Annotated[int | None, AT_LEAST_ONE] = field(
        default=None,
        metadata={
            "help": "Rollouts per optimizer step over all ranks (B), an episode of several branches (a verifiers v1 "
            "sub-agent's) counting once. Defaults to per_device_train_batch_size * "
            "gradient_accumulation_steps * world size."
        },
    )
    logprob_chunk_size: Annotated[int, NON_NEGATIVE] = field(
        default=1024, metadata={"help": "Tokens per chunk of the log-prob computation; 0 computes all logits at once."}
    )
    rollouts_path: str | None = field(
        default=None, metadata={"help": "A JSON Lines file of rollouts to train on (replay)."}
    )
    scale_rewards: ScaleRewards = field(
        default="group", metadata={"help": "Advantage scaling: group std, batch std, or none."}
    )
    multi_objective_aggregation: RewardAggregation = field(
        default="sum_then_normalize",  # TRL's str took any value, and every other one meant sum_then_normalize
        metadata={"help": "How TRL-style reward_funcs combine: sum_then_normalize (their weighted sum, scaled by "
                  "--scale_rewards) or normalize_then_sum (each standardised in its group, weighted, summed, then "
                  "standardised over the step batch; GDPO)."},
    )
    max_off_policy_steps: Annotated[int, NON_NEGATIVE] = field(
        default=1,
        metadata={"help": "k: generation runs up to k optimizer steps ahead of training (0 = synchronous). A replay of "
                          "--rollouts_path generates nothing: refused there."},
    )
    groups_in_flight: Annotated[int, NON_NEGATIVE] = field(
        default=0,
        metadata={"help": "Continuous generation: keep up to N groups (a prompt x num_generations) in flight, a batch "
                          "made of finished whole groups (the earliest due first), weights loaded while groups are in "
                          "flight; a group started at version v (after v optimizer steps) is due by batch "
                          "v / num_iterations + max_off_policy_steps, a long one slides to a later batch up to then, "
                          "and the batch it is due by waits for it. 0 = "
                          "batch at a time (exactly reproducible). Needs max_off_policy_steps >= 1; at most "
                          "(max_off_policy_steps + 1) x rollouts_per_step / num_generations (no more groups can be "
                          "in flight)."},
    )
    generation_timeout_s: Annotated[float, POSITIVE] = field(
        default=600.0, metadata={"help": "Longest wait for a batch of rollouts before failing with a clear error (and "
                                         "for an evaluation's next prompt to finish)."}
    )
    save_rollouts_path: str | None = field(
        default=None, metadata={"help": "Append every trained rollout to this JSON Lines file (the replay format)."}
    )
    num_generations: int | None = field(
        default=8, metadata={"help": "Rollouts per prompt when generating (a group), an episode of several branches "
                                     "counting once."}
    )
    print_samples_every: Annotated[int, NON_NEGATIVE] = field(
        default=10,
        metadata={"help": "Print num_completions_to_print sample completions (with rewards) every N steps; 0 = never."},
    )
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision (and the embedded engine's weights in bf16); defaults "
                                         "to the accelerate launch's mixed_precision, else True on a GPU, False on "
                                         "CPU (and with use_cpu). A launch's mixed_precision the flags contradict is "
                                         "refused."}
    )
    weight_sync_bucket_mb: Annotated[float, NON_NEGATIVE] = field(
        default=256.0,
        metadata={
            "help": "Weight sync to the engine gathers ZeRO-3 shards in buckets of about this many MiB (one collective "
            "per bucket; also the extra memory each rank holds while a bucket is out). 0 = one parameter at a time."
        },
    )
    weight_sync_probe_tokens: Annotated[int, Range(2, also=(0,))] = field(
        default=32,
        metadata={
            "help": "After each weight sync, compare the engine's and the trainer's log-probs of this many fixed "
            "tokens and warn if they differ (stale layers, e.g. a tied output layer). 0 turns the probe off."
        },
    )
    weight_sync_probe_every: Annotated[int, AT_LEAST_ONE] = field(
        default=10,
        metadata={
            "help": "Probe after the first weight sync and then after every N-th (1: after every sync). The probe is "
            "two forwards that generation waits for; a broken sync shows at the first."
        },
    )
    weight_sync_probe_tolerance: Annotated[float | None, POSITIVE] = field(
        default=None,
        metadata={
            "help": "Largest |engine - trainer| log-prob gap on the probe before the warning. Default: 1e-3 when "
            "the trainer and the engine both compute in float32, 0.5 when either uses bf16/fp16 (above what bf16 "
            "rounding alone moves a log-prob by, below what a tensor left unloaded does)."
        },
    )

    continuous_batching_rows: Annotated[int, NON_NEGATIVE] = field(
        default=0,
        metadata={
            "help": "Embedded engine: serve every model call from one running decode batch of up to N rows on a "
            "thread of its own; a request joins between two decode steps as rows finish, and a weight load lands "
            "between two steps without draining the rows in flight (each token records the policy version that "
            "sampled it). An episode's next turn, whose prompt extends a finished row's tokens, goes first and "
            "forwards only its new tokens (the last N finished rows' keys/values are kept; after a load, as for rows "
            "in flight, the earlier weights'). 0 = batch by batch. A vLLM server (--vllm_server_url) batches "
            "continuously itself. On the CPU, start the run with OMP_WAIT_POLICY=PASSIVE (decoding and training then "
            "share the cores)."
        },
    )
    vllm_server_url: str | None = field(
        default=None,
        metadata={
            "help": "Generate through this vLLM server (e.g. http://127.0.0.1:8000) instead of the embedded engine; "
            "start one with `verifiers-rl vllm-serve --model MODEL --port 8000`. Several "
            "servers of the same model: a comma-separated list (a list in YAML); requests go to the least busy one, "
            "a group's samples to one server (its prefix cache), every weight sync and probe reaches each, and a "
            "server that stops answering is left out until it answers again at the same address (it then gets the "
            "current weights); with all of them down the run waits vllm_reconnect_timeout_s."
        },
    )
    vllm_server_timeout: Annotated[float, NON_NEGATIVE] = field(
        default=SERVER_WAIT_S,
        metadata={"help": "Seconds the run's first check waits for a --vllm_server_url server that is still starting "
                          "(polling its /health, saying so) before it stops naming the URL (TRL's field and default)."},
    )
    vllm_max_concurrency: Annotated[int, AT_LEAST_ONE] = field(
        default=64, metadata={"help": "Most requests in flight to the vLLM server (it batches them)."}
    )
    vllm_request_timeout_s: Annotated[float, POSITIVE] = field(
        default=600.0, metadata={"help": "Longest wait for one request to the vLLM server."}
    )
    vllm_max_retries: Annotated[int, NON_NEGATIVE] = field(
        default=3,
        metadata={
            "help": "Further attempts after a connection error or HTTP 5xx from the vLLM server (backoff 0.5 s, "
            "doubled each time)."
        },
    )
    vllm_reconnect_timeout_s: Annotated[float, NON_NEGATIVE] = field(
        default=300.0,
        metadata={
            "help": "When the vLLM server stops answering (killed, restarted), wait this long for it to come back at "
            "the same address, then reload the current weights into it and re-send what was in flight; not back in "
            "time: the run stops with the error. 0 = stop at once. Must be below generation_timeout_s. Keeps the "
            "last weights (files: the last snapshot on disk; nccl/gloo: a copy in host memory)."
        },
    )
    vllm_weights_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where weight syncs write their snapshot for the vLLM server to read (the same path on both "
            "machines). Default: a temporary folder (a server on this machine)."
        },
    )
    vllm_weight_transfer: WeightTransfer = field(
        default="files",
        metadata={
            "help": "How weights reach the vLLM server: files (safetensors snapshots in vllm_weights_dir), nccl "
            "(GPUs; vllm must be importable here) or gloo (CPUs): broadcast through vLLM's weight-transfer engine, in "
            "rounds of weight_sync_bucket_mb. Start the server with the same --weight-transfer."
        },
    )
    vllm_weight_transfer_address: str | None = field(
        default=None,
        metadata={
            "help": "Address the vLLM server's workers reach this trainer at for nccl/gloo (default: the interface "
            "that routes to the server)."
        },
    )

    filter_groups: Literal["none", "zero_variance"] = field(
        default="none",
        metadata={
            "help": "Dynamic sampling (DAPO): 'zero_variance' drops every group whose rewards are all equal (no "
            "advantage, only cost) before batching; live generation then generates more groups until the batch is "
            "full (at most max_refill_batches more rounds), replay only filters. 'none' keeps every group.",
        },
    )
    max_refill_batches: Annotated[int, NON_NEGATIVE] = field(
        default=3,
        metadata={
            "help": "With filter_groups: at most this many extra rounds of generation (each as many prompts as a "
            "batch) to fill a batch with informative groups; then the batch is trained as it is, with a warning."
        },
    )
    max_rollout_retries: Annotated[int, NON_NEGATIVE] = field(
        default=2,
        metadata={
            "help": "Live generation: a group whose environment raised is generated again (same seeds) up to this many "
            "times, then dropped and counted (rollouts_failed, groups_dropped_on_error). An error of the environment's "
            "code (TypeError, AttributeError, NameError, NotImplementedError, ImportError) is not retried: the same "
            "seeds would raise it again."
        },
    )
    max_failed_rollouts_fraction: Annotated[float, Range(0, high=1)] = field(
        default=0.0,
        metadata={
            "help": "Largest fraction of a batch's groups that may be dropped after max_rollout_retries before the run "
            "stops with the error (0: any group that keeps failing stops it; a batch with no group left always does)."
        },
    )
    curriculum_easy_above: Annotated[float | None, EASY_RANGE] = field(
        default=None,
        metadata={
            "help": "Difficulty curriculum (live generation): a prompt whose pass rate is at or above this (1.0: every "
            "rollout of its last curriculum_window groups passed) is set aside as easy for "
            "curriculum_set_aside_epochs epochs. Unset: off. A mixture entry may override it (its curriculum:)."
        },
    )
    curriculum_hard_below: Annotated[float | None, HARD_RANGE] = field(
        default=None,
        metadata={
            "help": "Difficulty curriculum: a prompt whose pass rate is at or below this (0.0: no rollout of its last "
            "curriculum_window groups passed) is set aside as hard. Below curriculum_easy_above. Unset: off."
        },
    )
    curriculum_window: Annotated[int, AT_LEAST_ONE] = field(
        default=1,
        metadata={"help": "A prompt's pass rate is the mean over its last N groups of the fraction of the group's "
                  "rollouts that passed; it is judged once it has N groups (and again from scratch after a set-aside)."},
    )
    curriculum_pass_reward: float = field(
        default=1.0, metadata={"help": "A rollout passes (for the curriculum's pass rate) when its reward is >= this."}
    )
    curriculum_set_aside_epochs: Annotated[int, NON_NEGATIVE] = field(
        default=1,
        metadata={"help": "A prompt set aside skips the next N epochs of its environment's rows (a mixture entry's "
                  "own epochs), then is drawn again; 0 sets it aside for good."},
    )
    eval_num_examples: int | None = field(
        default=None,
        metadata={"help": "Prompts of the held-out split each evaluation rolls out (the split's first N rows, the same "
                  "every time); default: the whole split."},
    )
    eval_samples_per_prompt: int = field(
        default=1, metadata={"help": "Samples per evaluation prompt (k of pass@k)."}
    )
    eval_temperature: float | None = field(
        default=None, metadata={"help": "Sampling temperature of evaluation (0 = greedy); default: --temperature."}
    )
    eval_pass_threshold: float = field(
        default=1.0, metadata={"help": "An evaluation sample passes (pass@k) when its reward is >= this."}
    )
    eval_holdout: Annotated[int, NON_NEGATIVE] = field(
        default=0,
        metadata={
            "help": "Move N rows of the training environment's dataset (a shuffle seeded by --seed) into its held-out "
            "split, whether or not evaluation runs: for environments without an eval split. 0 = off."
        },
    )
    log_completions_steps: Annotated[int, NON_NEGATIVE] = field(
        default=0,
        metadata={
            "help": "Every N steps, send a table of the batch's prompts, completions and rewards to every --report_to "
            "backend (tensorboard: text; wandb, trackio: a table). 0 = never; --log_completions means every "
            "--logging_steps."
        },
    )
    share_prompt_training: SharePromptTraining = field(
        default="auto",
        metadata={
            "help": "Training forward (not generation; see share_prompt_prefill for the engine): forward each group's "
            "common token prefix (its prompt) once per micro-batch row, shared by its completions (exact: same "
            "log-probs and update); a packed row also holds its groups' common first tokens (a system prompt) once. "
            "on: whole groups per row as far as per_device_train_batch_size (padded) and "
            "max_tokens_per_microbatch allow; auto: rows sized by a cost model (with sdpa a shared row attends run by "
            "run and whole groups share; with eager its attention is dense and long completions share less), off "
            "with a flash/varlen attention kernel (it cannot take the tree "
            "mask); off: one row per sequence, the prompt forwarded with every completion."
        },
    )

    def __post_init__(self):
        if isinstance(self.vllm_server_url, (list, tuple)):  # a YAML list of servers: the flag's comma-joined form
            self.vllm_server_url = ",".join(str(url).strip() for url in self.vllm_server_url)
        check_fields(self)  # before anything below derives a field from another
        apply_trl_names(self)
        launched = launched_mixed_precision()
        if self.bf16 is None:  # use_cpu trains on the CPU even where a GPU is (a GPU machine's CPU reference run)
            self.bf16 = launched == "bf16" or (launched == "no" and torch.cuda.is_available() and not self.use_cpu
                                               and not self.fp16)
        self._check_launched_precision(launched)
        for deprecated, current in (("gradient_checkpointing", "activation_checkpointing"),
                                    ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            # TRL defaults the old name (gradient_checkpointing=True), which transformers 5 then reports as a
            # deprecated setting on every run; carry it over to the new name, as transformers itself would.
            if getattr(self, current, "absent") is None and getattr(self, deprecated, None) is not None:
                setattr(self, current, getattr(self, deprecated))
        if isinstance(self.report_to, str) and "," in self.report_to:
            # The command line's one string; an empty name (a trailing comma) is none.
            self.report_to = [name.strip() for name in self.report_to.split(",") if name.strip()]
        if self.eval_steps and self.eval_strategy == "no":
            self.eval_strategy = "steps"  # --eval_steps N alone asks for evaluation every N steps
        if self.log_completions:
            # TRL's completion logging reads buffers only its own generation fills; ours logs the batch instead.
            self.log_completions_steps = self.log_completions_steps or max(int(self.logging_steps), 1)
            self.log_completions = False
            self._completions_flag = "log_completions"  # what a refusal of log_completions_steps names
        self._best_checkpoint_metric()
        given = {name: getattr(self, name) for name in _SHOWN_TO_GRPO_CONFIG}
        # GRPOConfig sizes its own generation batch from GA and checks it against num_generations; that batch is
        # not ours (nor is its evaluation batch: evaluation.py samples per prompt itself), so give its checks values
        # that pass, then restore what the user gave (the trainer shows TRL its own: trl_view).
        self.gradient_accumulation_steps = 1  # also what TrainingArguments writes into a DeepSpeed config
        self.steps_per_generation, self.generation_batch_size = 2, None
        self.num_generations, self.num_generations_eval = 2, 1
        check_json_text(self)  # before TrainingArguments loads it: its JSONDecodeError named no field
        # A config is a value: no process group, no device yet; a launch's DeepSpeed config is found from any folder.
        with compat.deferred_device_setup(self), deepspeed_config_found():
            super().__post_init__()
        for name, value in given.items():
            setattr(self, name, value)
        for name in _KWARGS_FIELDS:  # other text (not "{...}") was kept as it is, and failed where it was unpacked
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict of keyword arguments (a JSON object on the command line), "
                                 f"got {getattr(self, name)!r}.")
        apply_generation_kwargs(self)  # after TrainingArguments parsed a JSON string into a dict
        if self.chat_template_kwargs is not None:  # likewise parsed: every environment and engine renders with them
            self.chat_template_kwargs = check_chat_template_kwargs(self.chat_template_kwargs, "--chat_template_kwargs")
        world = launched_world_size()
        implied = self.per_device_train_batch_size * self.gradient_accumulation_steps * world
        if self.rollouts_per_step is None:
            self.rollouts_per_step = implied
            # What a refusal of the batch size names: a TRL script sets only these.
            self._batch_from = (f"per_device_train_batch_size {self.per_device_train_batch_size} x "
                                f"gradient_accumulation_steps {self.gradient_accumulation_steps} x {world} process"
                                f"{'es' if world != 1 else ''}")
        elif self.gradient_accumulation_steps != 1 and self.rollouts_per_step != implied:
            # gradient_accumulation_steps sizes only the default batch: beside another one it would do nothing.
            raise ValueError(
                f"--gradient_accumulation_steps {self.gradient_accumulation_steps} sizes the batch: "
                f"per_device_train_batch_size {self.per_device_train_batch_size} x gradient_accumulation_steps x "
                f"{world} process{'es' if world != 1 else ''} = {implied} rollouts, but --rollouts_per_step is "
                f"{self.rollouts_per_step}, so it would change nothing (a step's micro-batches are always accumulated). "
                "Set --rollouts_per_step alone, or values that agree."
            )
        if self.max_tokens_per_microbatch is None:
            self.max_tokens_per_microbatch = 4 * self.max_seq_len
        self.validate()

    def _check_launched_precision(self, launched: str) -> None:
        """Refuse an ``accelerate launch`` mixed precision other than the flags': HF would train in the launch's
        when --bf16 and --fp16 are off (transformers' TrainingArguments reads it then), while the engine's dtype and
        the probe's tolerance follow the flags."""
        mine = "bf16" if self.bf16 else "fp16" if self.fp16 else "no"
        if launched != "no" and launched != mine:
            flag = f", or pass --{launched} true" if launched in ("bf16", "fp16") else ""
            raise ValueError(f"accelerate launch asks for mixed_precision {launched} (its config file's "
                             f"mixed_precision, or --mixed_precision), this run's flags for {mine} (--bf16 "
                             f"{self.bf16}, --fp16 {self.fp16}): HF would train in {launched} while the engine "
                             f"follows the flags. Launch with mixed_precision {mine}{flag}.")

    def _best_checkpoint_metric(self) -> None:
        """The metric HF's best-checkpoint tracking reads (``metric_for_best_model``) named as our evaluation logs it:
        ``eval/reward`` (tensorboard's name) is ``reward``; unset beside ``load_best_model_at_end`` or ``save_strategy
        best`` in a run that evaluates, the evaluation's mean reward (HF's default, the eval loss, is not computed)."""
        metric = self.metric_for_best_model
        if isinstance(metric, str) and metric.startswith("eval/"):
            self.metric_for_best_model = metric[len("eval/"):]
        evaluating = self.eval_strategy != "no"
        if self.save_strategy == "best" and not evaluating:  # before HF asks for a metric no evaluation computes
            raise ValueError("--save_strategy best saves a checkpoint when an evaluation finds a new best "
                             "--metric_for_best_model; this run does not evaluate, so it would save none. Evaluate "
                             "(--eval_steps N), or save by --save_strategy steps.")
        if metric is None and evaluating and (self.load_best_model_at_end or self.save_strategy == "best"):
            self.metric_for_best_model = "reward"

    def trl_view(self, **derived) -> "RLConfig":
        """A shallow copy for TRL's and HF's constructors (the trainer's ``args``): one optimizer step is one HF
        step of one ``training_step`` (gradient_accumulation_steps 1) over one generated batch of rollouts_per_step,
        plus what the trainer derives (``derived``, e.g. max_steps). This config keeps the values the user gave."""
        shown = copy.copy(self)
        shown.gradient_accumulation_steps, shown.steps_per_generation = 1, 1
        shown.generation_batch_size = self.rollouts_per_step
        for name, value in derived.items():
            setattr(shown, name, value)
        return shown

    def validate(self) -> None:
        """Raise ValueError naming the first bad knob: a choice outside its ``Literal`` type, a number outside
        its range (``config_ranges``), then the rules that tie fields together."""
        for name, choices in _choices(type(self)).items():
            check_choice(name, getattr(self, name), choices)
        for name, allowed in config_ranges().items():
            allowed.check(name, getattr(self, name))
        if launched_fsdp():  # the fields' own refusal (grpo_fields) covers --fsdp; this, an accelerate config's
            raise ValueError(f"accelerate launch asks for FSDP (distributed_type: FSDP, or --use_fsdp): "
                             f"{refused_fields()['fsdp']}.")
        if self.fp16 and (self.use_cpu or not torch.cuda.is_available()):
            # Accelerate runs fp16 autocast on GPUs only (on the CPU it silently trains in float32); DeepSpeed raises.
            raise ValueError("--fp16 needs a GPU: on the CPU (--use_cpu, or no GPU visible) Accelerate ignores it and "
                             "trains in float32, and DeepSpeed refuses it. Use --bf16 (bf16 autocast on the CPU), "
                             "or leave --fp16 out.")
        if self.micro_batching != "padded":
            check_packed_row_fits(self.max_tokens_per_microbatch, self.max_seq_len)
        if self.importance_cap_min is not None and not self.importance_cap_min < self.importance_cap:
            raise ValueError("importance_cap_min must satisfy 0 <= importance_cap_min < importance_cap.")
        if self.ddp_timeout <= self.generation_timeout_s:
            # The other ranks wait for the main process's batch inside a collective, which gives up at ddp_timeout.
            raise ValueError(
                f"ddp_timeout ({self.ddp_timeout} s) must exceed generation_timeout_s ({self.generation_timeout_s:g} s): "
                "the other processes wait for each batch in a collective that fails after ddp_timeout."
            )
        if self.use_vllm or self.vllm_server_base_url:
            # TRL's own vLLM path would start its client and an NCCL weight-transfer group (CUDA only) beside ours.
            raise ValueError(
                "use_vllm / vllm_server_base_url select TRL's vLLM client, which verifiers_rl does not use. Pass "
                "--vllm_server_url http://HOST:PORT instead (start the server with "
                "`verifiers-rl vllm-serve --model MODEL --port PORT`)."
            )
        check_report_to(self.report_to)
        check_server_url(self.vllm_server_url, "vllm_server_url")
        check_reward_weights(self.reward_weights)
        check_path_kind("output_dir", self.output_dir, folder=True)
        check_resume_spec(self.resume_from_checkpoint)
        if self.save_rollouts_path:
            check_path_kind("save_rollouts_path", self.save_rollouts_path, folder=False)
        if self.vllm_server_url and self.continuous_batching_rows:
            raise ValueError(f"--continuous_batching_rows {self.continuous_batching_rows} sets the embedded engine's "
                             "running batch; a vLLM server (--vllm_server_url) already batches continuously. Leave "
                             "--continuous_batching_rows 0.")
        if self.rollouts_path and self.continuous_batching_rows and self.eval_strategy == "no":
            raise ValueError(f"--continuous_batching_rows {self.continuous_batching_rows} sets how the embedded engine "
                             "decodes; a replay of --rollouts_path without evaluation (--eval_strategy no) builds no "
                             "engine. Leave --continuous_batching_rows 0, or evaluate (--eval_strategy steps).")
        if self.vllm_server_url and self.vllm_reconnect_timeout_s >= self.generation_timeout_s:
            # The trainer waits for a batch at most generation_timeout_s: a wait for the server must fit in it.
            raise ValueError(
                f"vllm_reconnect_timeout_s ({self.vllm_reconnect_timeout_s:g} s) must be below generation_timeout_s "
                f"({self.generation_timeout_s:g} s): the wait for a restarted vLLM server happens inside a batch's "
                "generation."
            )
        from verifiers_rl.inference.factory import sampling_settings

        sampling_settings(self)  # the sampling knobs' ranges (raises naming the knob)
        if not self.rollouts_path and (self.num_generations is None or self.num_generations < 2):
            # TRL refuses it too: without it a live run trains on zero advantages and learns nothing from rewards.
            raise ValueError(f"num_generations must be >= 2 when generating from an environment (--env), got "
                             f"{self.num_generations}: a rollout's advantage is its reward minus its group's mean, so "
                             "a group of one rollout always has advantage 0.")
        if not self.rollouts_path and self.rollouts_per_step % self.num_generations:
            # Live generation samples whole groups (replay takes its groups from the file, of any size).
            source = getattr(self, "_batch_from", None)
            raise ValueError(f"rollouts_per_step ({self.rollouts_per_step}{f' = {source}' if source else ''}) must be "
                             f"a multiple of num_generations ({self.num_generations}) when generating from an "
                             "environment (--env): set --rollouts_per_step (or per_device_train_batch_size) to a "
                             "multiple of it, or another --num_generations.")
        from verifiers_rl.core.settings import settings_from

        curriculum = settings_from(self, CurriculumSettings)
        curriculum.check()  # hard_below < easy_above, and a finite pass reward
        if self.rollouts_path and curriculum.active:
            raise ValueError("--curriculum_easy_above / --curriculum_hard_below steer which prompts live generation "
                             "draws; a replay of --rollouts_path generates nothing to steer. Leave them unset.")
        if self.groups_in_flight:
            self._check_continuous_generation(curriculum.active)
        from verifiers_rl.rollouts.evaluation import EvalSettings

        EvalSettings.from_config(self)  # the eval_* knobs are checked where they are used (raises naming the knob)
        self._check_enablers()

    def _check_enablers(self) -> None:
        """A knob that acts only beside another (its enabler), given without it, is refused naming both: accepted,
        it would change nothing while the user believes it does."""
        evaluating = ("evaluation (--eval_strategy steps or epoch, or --eval_steps N)", self.eval_strategy != "no")
        probing = ("the weight-sync probe (--weight_sync_probe_tokens N >= 2)", self.weight_sync_probe_tokens > 0)
        correcting = ("an importance correction (--importance_correction other than none)",
                      self.importance_correction != "none")
        live = ("live generation from an environment (a replay of --rollouts_path generates nothing)",
                not self.rollouts_path)
        enablers = {
            **{name: live for name in _LIVE_KNOBS},
            "dr_grpo_horizon": ("--loss_type dr_grpo", self.loss_type == "dr_grpo"),
            "use_bias_correction_kl": ("the KL term (--beta > 0)", self.beta > 0),
            "ref_model_mixup_alpha": ("--sync_ref_model", self.sync_ref_model),
            "ref_model_sync_steps": ("--sync_ref_model", self.sync_ref_model),
            "importance_cap": correcting,
            "importance_cap_min": correcting,
            "importance_sequence_log_ratio": ("a sequence-level correction (--importance_correction sequence_truncate "
                                              "or sequence_mask)", self.importance_correction in SEQUENCE_CORRECTIONS),
            "log_completions_steps": ("a --report_to backend that shows tables (tensorboard, trackio, wandb)",
                                      any(name in TABLE_BACKENDS for name in self.report_to or [])),
            # transformers reads them in its Trackio callback only (wandb takes WANDB_PROJECT).
            **{name: ("--report_to trackio", "trackio" in (self.report_to or [])) for name in _TRACKIO_KNOBS},
            "num_completions_to_print": ("sample printing (--print_samples_every N >= 1)",
                                         self.print_samples_every > 0),
            "max_tokens_per_microbatch": ("packed rows (--micro_batching packed or auto) or shared prompts "
                                          "(--share_prompt_training on or auto)",
                                          self.micro_batching != "padded" or self.share_prompt_training != "off"),
            **{name: ("--vllm_server_url", bool(self.vllm_server_url)) for name in _SERVER_KNOBS},
            "max_refill_batches": ("--filter_groups zero_variance in live generation (a replay refills nothing)",
                                   self.filter_groups != "none" and not self.rollouts_path),
            "weight_sync_probe_every": probing,
            "weight_sync_probe_tolerance": probing,
            **{name: evaluating for name in _EVAL_KNOBS},
            "optim_target_modules": ("a low-rank optimizer that projects them (--optim galore_* or apollo_*)",
                                     str(getattr(self.optim, "value", self.optim)).startswith(("galore", "apollo"))),
            "save_steps": ("--save_strategy steps", self.save_strategy == "steps"),
            "eval_steps": ("--eval_strategy steps (given alone, --eval_steps sets it)", self.eval_strategy == "steps"),
            "save_total_limit": ("checkpoints (--save_strategy steps, epoch or best)", self.save_strategy != "no"),
            "greater_is_better": ("a best-checkpoint metric (--metric_for_best_model, or --load_best_model_at_end / "
                                  "--save_strategy best, which track the evaluation's reward)",
                                  self.metric_for_best_model is not None),
        }
        defaults = {f.name: f.default for f in fields(self)}
        defaults["max_tokens_per_microbatch"] = 4 * self.max_seq_len  # what __post_init__ fills in when not given
        for name, (enabler, enabled) in enablers.items():
            if not enabled and getattr(self, name) != defaults[name]:
                given = getattr(self, "_completions_flag", None) if name == "log_completions_steps" else None
                flag = f"--{given}" if given else f"--{name} {getattr(self, name)}"
                raise ValueError(f"{flag} acts only with {enabler}, which this run does not set: it would change "
                                 f"nothing. Set it too, or leave --{given or name} out.")

    def check_logging_steps(self, given: bool | None = None) -> None:
        """--logging_steps acts only with --logging_strategy steps (HF reads it nowhere else): ``given`` (default:
        other than the field's default) beside epoch or no, refused by name. Checked by the trainer and the command,
        not in __post_init__: the command's own default (a line a step) is not the field's, and only it can tell."""
        given = self.logging_steps != type(self).logging_steps if given is None else given
        strategy = getattr(self.logging_strategy, "value", self.logging_strategy)  # HF's enum, or a string
        if strategy != "steps" and given:
            raise ValueError(f"--logging_steps {self.logging_steps:g} acts only with --logging_strategy steps, not "
                             f"{strategy}: it would change nothing. Set --logging_strategy steps, or leave "
                             "--logging_steps out.")

    def check_engine_knobs(self) -> None:
        """For a run that builds no inference engine: refuse, naming it, an engine knob given (``ENGINE_KNOBS``)."""
        defaults = {f.name: f.default for f in fields(self)}
        for name in ENGINE_KNOBS:
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"--{name} {getattr(self, name)} acts only with an inference engine: live generation "
                                 "or evaluation; a replay of --rollouts_path without evaluation builds none, so it "
                                 f"would change nothing. Leave --{name} out, or evaluate (--eval_steps N).")

    def _check_continuous_generation(self, curriculum: bool) -> None:
        """What --groups_in_flight N (continuous generation) does not combine with, refused by name."""
        why = {
            "--rollouts_path (replay)": (bool(self.rollouts_path), "a replay generates nothing"),
            "--max_off_policy_steps 0": (self.max_off_policy_steps == 0, "groups are generated while the trainer "
                                         "trains, so a batch is up to k >= 1 steps old; set k >= 1"),
            "--filter_groups zero_variance": (self.filter_groups != "none", "its refill rounds are batch-at-a-time"),
            "--curriculum_easy_above / --curriculum_hard_below": (curriculum, "its per-batch state assumes batches "
                                                                  "generated as a unit"),
        }
        for flag, (given, reason) in why.items():
            if given:
                raise ValueError(f"--groups_in_flight {self.groups_in_flight} (continuous generation) does not combine "
                                 f"with {flag}: {reason}. Use --groups_in_flight 0 (batch at a time) for it.")
        k, prompts = self.max_off_policy_steps, self.rollouts_per_step // self.num_generations
        if self.groups_in_flight > (k + 1) * prompts:  # ContinuousGenerator._to_start starts no more than that
            raise ValueError(
                f"--groups_in_flight {self.groups_in_flight} is more than can ever be in flight: a group started at "
                f"version v is due by batch v + k, so at most (k + 1) x {prompts} groups a batch (--rollouts_per_step "
                f"{self.rollouts_per_step} / --num_generations {self.num_generations}) = {(k + 1) * prompts} are, at "
                f"--max_off_policy_steps {k}. Use --groups_in_flight {(k + 1) * prompts} or less, or raise "
                "--max_off_policy_steps.")


# The vLLM client's knobs (--vllm_server_url's) and evaluation's (--eval_strategy's): RLConfig._check_enablers.
_SERVER_KNOBS = ("vllm_server_timeout", "vllm_max_concurrency", "vllm_request_timeout_s", "vllm_max_retries",
                 "vllm_reconnect_timeout_s", "vllm_weights_dir", "vllm_weight_transfer", "vllm_weight_transfer_address")
_EVAL_KNOBS = ("eval_num_examples", "eval_samples_per_prompt", "eval_temperature", "eval_pass_threshold",
               "load_best_model_at_end", "metric_for_best_model")
_TRACKIO_KNOBS = ("project", "trackio_space_id", "trackio_bucket_id")
# The --report_to backends our extras install (pyproject.toml), by the extra.
_BACKEND_EXTRAS = {"tensorboard": "logging", "trackio": "logging", "wandb": "wandb"}
# The --report_to backends that take completion tables (training/reporting.py).
TABLE_BACKENDS = ("tensorboard", "trackio", "wandb")
# What only live generation reads (a replay generates nothing).
_LIVE_KNOBS = ("shuffle_dataset", "max_rollout_retries", "max_failed_rollouts_fraction", "curriculum_window",
               "curriculum_pass_reward", "curriculum_set_aside_epochs", "max_off_policy_steps")
# What only an inference engine reads: verifiers-rl train builds none for a replay without evaluation (RLTrainer's
# caller may pass one beside a replay, so the command checks it: check_engine_knobs).
ENGINE_KNOBS = ("top_p", "top_k", "min_p", "repetition_penalty", "generation_timeout_s", "weight_sync_probe_tokens",
                "weight_sync_bucket_mb", "vllm_server_url")  # continuous_batching_rows: validate's own message

# GRPOConfig fields whose values its __post_init__ checks against a batch of its own: restored after it.
_SHOWN_TO_GRPO_CONFIG = ("gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
                         "num_generations", "num_generations_eval")


def check_report_to(backends) -> None:
    """``report_to`` (after TrainingArguments made it a list): each a transformers integration that is installed,
    else a ValueError naming --report_to, saying which backends this project supports (transformers' error, at the
    trainer, listed its every integration; an uninstalled one failed there with a traceback)."""
    from transformers.integrations.integration_utils import (INTEGRATION_TO_CALLBACK,
                                                             get_available_reporting_integrations)

    ours = "tensorboard and trackio (tested), wandb, all (every one installed) or none"
    for backend in backends or []:
        if backend in ("all", "none"):  # HF takes each alone only, as the whole value
            raise ValueError(f"--report_to {','.join(backends)}: {backend} stands alone; name backends, or give "
                             f"{backend} by itself.")
        if backend not in INTEGRATION_TO_CALLBACK:
            raise ValueError(f"--report_to {backend} is not a logging backend; this project's: {ours}. transformers' "
                             f"others ({', '.join(sorted(set(INTEGRATION_TO_CALLBACK) - set(_BACKEND_EXTRAS)))}) are "
                             "passed on untested.")
        extra = _BACKEND_EXTRAS.get(backend)
        if extra and importlib.util.find_spec(backend) is None:  # HF's callback would raise at the trainer
            raise ValueError(f"--report_to {backend} needs the {backend} package, which is not installed: "
                             f"pip install 'verifiers_rl[{extra}]' (from this repository: pip install -e "
                             f"'.[{extra}]').")
        if not extra and backend not in get_available_reporting_integrations():
            raise ValueError(f"--report_to {backend} needs its package, which is not installed (it is one of "
                             f"transformers' integrations, untested here; this project's: {ours}).")


# Dict fields TrainingArguments takes as JSON text and passes on as keyword arguments.
_KWARGS_FIELDS = ("model_init_kwargs", "lr_scheduler_kwargs", "activation_checkpointing_kwargs",
                  "gradient_checkpointing_kwargs")


def check_json_text(config) -> None:
    """Raise ValueError naming the field whose value is JSON text ("{..."; TrainingArguments' ``_VALID_DICT_FIELDS``
    loads those) that is not valid JSON."""
    for name in config._VALID_DICT_FIELDS:
        text = getattr(config, name, None)
        if isinstance(text, str) and text.startswith("{"):
            try:
                json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{name} is not valid JSON ({error}): {text}") from None


def check_reward_weights(weights) -> None:
    """``reward_weights``: None or a list of finite numbers (TRL's torch.tensor of them; a string, one per letter,
    was counted as that many reward functions)."""
    if weights is None:
        return
    if not isinstance(weights, (list, tuple)) or not all(
            isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
        raise ValueError(f"reward_weights must be a list of finite numbers, one per reward function, got {weights!r}.")


# The paths a run writes, by field (True: a file; False: a folder).
WRITTEN_PATHS = {"output_dir": False, "save_rollouts_path": True, "vllm_weights_dir": False}


def check_written_paths(config, prefix: str = "") -> None:
    """Refuse, naming its field (``prefix``: "--" for the command's flag) and the reason, a path in ``WRITTEN_PATHS``
    this user could not create or write: the first write failed with a bare errno line (the trainer's output_dir) or
    a traceback after the first step (save_rollouts_path)."""
    for name, is_file in WRITTEN_PATHS.items():
        path = getattr(config, name)
        why = unwritable(path, is_file) if path else None
        if why:
            raise ValueError(f"{prefix}{name} {path}: {why}.")


def check_resume_spec(spec) -> None:
    """Refuse an empty --resume_from_checkpoint: it started afresh, as if not given (an unset shell variable's
    ``--resume_from_checkpoint "$CKPT"`` silently lost the run it meant to continue)."""
    if isinstance(spec, str) and not spec.strip():
        raise ValueError("resume_from_checkpoint is empty; pass a checkpoint folder, 'latest' or 'auto', or leave it "
                         "out to start afresh.")


def check_path_kind(flag: str, path, folder: bool) -> None:
    """Refuse a path the run could not create: a ``folder`` that is a file, a file that is a folder, or either under a
    file (a missing path is fine: it is created). Else the first write failed with an OSError traceback."""
    if not str(path).strip():  # Path("") is the working directory; HF's makedirs("") failed with a bare [Errno 2]
        raise ValueError(f"--{flag} is empty; pass {'a folder (. for the working one)' if folder else 'a file path'}.")
    target = Path(path).expanduser()
    if target.exists() and target.is_dir() != folder:
        kind, wanted = ("a file", "a folder (it is created if missing)") if folder else ("a folder", "a file's path")
        raise ValueError(f"--{flag} {path} is {kind}; pass {wanted}.")
    blocking = next((parent for parent in target.parents if parent.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ValueError(f"--{flag} {path}: {blocking} is a file, so nothing can be created under it; pass another "
                         "path.")


@functools.cache
def config_ranges() -> dict[str, Range]:
    """Every checked number's ``Range``: ``INHERITED_RANGES``, then RLConfig's own fields' (their ``Annotated``
    types)."""
    return {**INHERITED_RANGES, **field_ranges(RLConfig)}  # TRL's first: ours may default from them


@functools.cache
def _choices(cls: type) -> dict[str, tuple]:
    """The allowed values of every ``Literal``-typed field of ``cls``."""
    hints = get_type_hints(cls)
    return {f.name: get_args(hints[f.name]) for f in fields(cls) if get_origin(hints[f.name]) is Literal}
