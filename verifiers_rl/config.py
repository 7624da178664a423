"""RLConfig: every knob of the trainer, validated once in ``__post_init__``."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from .batching import MICRO_BATCHING_MODES, OVERLONG_POLICIES, SCALE_REWARDS
from .loss import CORRECTION_MODES, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES


@dataclass
class RLConfig(GRPOConfig):
    """GRPOConfig plus the fields of the exact, asynchronous trainer.

    One optimizer step consumes ``rollouts_per_step`` rollouts, spread over ranks and micro-batches however
    ``micro_batching`` says; the update equals the single-device full-batch update. ``gradient_accumulation_steps``
    is read once, to size the default batch, and then set to 1: the trainer runs every micro-batch of a step
    inside one ``training_step``.
    """

    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "Aggregation over the global batch: grpo (sequence mean of token means), dr_grpo (token sum / "
            "(valid sequences * horizon)), token_mean (DAPO), seq_mean_token_sum.",
            "choices": list(LOSS_TYPES),
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "PPO ratio per token, or per sequence (GSPO, length-normalised).", "choices": list(IMPORTANCE_SAMPLING_LEVELS)},
    )
    importance_correction: str = field(
        default="token_truncate",
        metadata={
            "help": "Correction between the proximal and the sampler policy, when rollouts carry sampler log-probs: "
            "token_truncate (w = min(exp(p - q), cap)), token_mask, sequence_truncate, sequence_mask, none.",
            "choices": list(CORRECTION_MODES),
        },
    )
    importance_cap: float = field(default=2.0, metadata={"help": "Upper bound C of the importance weight."})
    importance_cap_min: float | None = field(
        default=None, metadata={"help": "Lower bound of the importance weight (mask modes: the lower edge)."}
    )
    max_seq_len: int = field(default=1024, metadata={"help": "Longest prompt + completion trained on, in tokens."})
    overlong: str = field(
        default="error",
        metadata={
            "help": "A rollout longer than max_seq_len: 'error' refuses the batch, 'truncate' cuts the completion's "
            "tail and marks it truncated (before any count is taken).",
            "choices": list(OVERLONG_POLICIES),
        },
    )
    dr_grpo_horizon: int | None = field(
        default=None, metadata={"help": "Horizon H of dr_grpo; defaults to max_seq_len."}
    )
    micro_batching: str = field(
        default="auto",
        metadata={
            "help": "padded: per_device_train_batch_size rows per micro-batch (length-sorted); packed: padding-free "
            "rows of at most max_tokens_per_microbatch tokens; auto: packed with a flash-attention (varlen) kernel, "
            "padded otherwise (a dense block-diagonal mask attends over the whole packed row, benchmarks/packing.py).",
            "choices": list(MICRO_BATCHING_MODES) + ["auto"],
        },
    )
    max_tokens_per_microbatch: int | None = field(
        default=None, metadata={"help": "Token budget of a packed micro-batch; defaults to 4 * max_seq_len."}
    )
    rollouts_per_step: int | None = field(
        default=None,
        metadata={
            "help": "Rollouts per optimizer step over all ranks (B). Defaults to per_device_train_batch_size * "
            "gradient_accumulation_steps * world size."
        },
    )
    logprob_chunk_size: int = field(
        default=1024, metadata={"help": "Tokens per chunk of the log-prob computation; 0 computes all logits at once."}
    )
    rollouts_path: str | None = field(
        default=None, metadata={"help": "A JSON Lines file of rollouts to train on (replay)."}
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "Advantage scaling: group std, batch std, or none.", "choices": list(SCALE_REWARDS)},
    )
    max_off_policy_steps: int = field(
        default=1,
        metadata={"help": "k: generation runs up to k optimizer steps ahead of training (0 = synchronous)."},
    )
    generation_timeout_s: float = field(
        default=600.0, metadata={"help": "Longest wait for a batch of rollouts before failing with a clear error."}
    )
    save_rollouts_path: str | None = field(
        default=None, metadata={"help": "Append every trained rollout to this JSON Lines file (the replay format)."}
    )
    num_generations: int | None = field(
        default=8, metadata={"help": "Rollouts per prompt when generating (a group)."}
    )
    print_samples_every: int = field(
        default=10,
        metadata={"help": "Print num_completions_to_print sample completions (with rewards) every N steps; 0 = never."},
    )
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision; defaults to True on a GPU, False on CPU."}
    )
    weight_sync_bucket_mb: float = field(
        default=256.0,
        metadata={
            "help": "Weight sync to the engine gathers ZeRO-3 shards in buckets of about this many MiB (one collective "
            "per bucket; also the extra memory each rank holds while a bucket is out). 0 = one parameter at a time."
        },
    )
    weight_sync_probe_tokens: int = field(
        default=32,
        metadata={
            "help": "After each weight sync, compare the engine's and the trainer's log-probs of this many fixed "
            "tokens and warn if they differ (stale layers, e.g. a tied output layer). 0 turns the probe off."
        },
    )
    weight_sync_probe_tolerance: float | None = field(
        default=None,
        metadata={
            "help": "Largest |engine - trainer| log-prob gap on the probe before the warning. Default: 1e-3 when "
            "the trainer and the engine both compute in float32, 0.5 when either uses bf16/fp16 (bf16 rounding alone "
            "moves a log-prob by up to ~0.2; a tensor left unloaded moves one by more)."
        },
    )

    vllm_server_url: str | None = field(
        default=None,
        metadata={
            "help": "Generate through this vLLM server (e.g. http://127.0.0.1:8000) instead of the embedded engine; "
            "start one with `python -m verifiers_rl.inference.vllm_server --model MODEL --port 8000`."
        },
    )
    vllm_max_concurrency: int = field(
        default=64, metadata={"help": "Most requests in flight to the vLLM server (it batches them)."}
    )
    vllm_request_timeout_s: float = field(
        default=600.0, metadata={"help": "Longest wait for one request to the vLLM server."}
    )
    vllm_max_retries: int = field(
        default=3,
        metadata={
            "help": "Further attempts after a connection error or HTTP 5xx from the vLLM server (backoff 0.5 s, "
            "doubled each time)."
        },
    )
    vllm_weights_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where weight syncs write their snapshot for the vLLM server to read (the same path on both "
            "machines). Default: a temporary folder (a server on this machine)."
        },
    )
    vllm_weight_transfer: str = field(
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

    filter_groups: str = field(
        default="none",
        metadata={
            "help": "Dynamic sampling (DAPO): 'zero_variance' drops every group whose rewards are all equal (no "
            "advantage, only cost) before batching; live generation then generates more groups until the batch is "
            "full (at most max_refill_batches more rounds), replay only filters. 'none' keeps every group.",
            "choices": ["none", "zero_variance"],
        },
    )
    max_refill_batches: int = field(
        default=3,
        metadata={
            "help": "With filter_groups: at most this many extra rounds of generation (each as many prompts as a "
            "batch) to fill a batch with informative groups; then the batch is trained as it is, with a warning."
        },
    )

    def __post_init__(self):
        _skip_deepspeed_cpu_shm_op()
        if _env_flag("ACCELERATE_USE_CPU") and _env_flag("ACCELERATE_USE_DEEPSPEED"):
            # The env flag gives the Trainer a plain CPU Accelerator that ignores the DeepSpeed plugin: the
            # ZeRO-3-partitioned model would be wrapped in DDP and fail ("'weight' must be 2-D"). use_cpu keeps both.
            os.environ.pop("ACCELERATE_USE_CPU")
            self.use_cpu = True
        if self.bf16 is None:
            self.bf16 = torch.cuda.is_available() and not self.fp16
        for deprecated, current in (("gradient_checkpointing", "activation_checkpointing"),
                                    ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            # TRL defaults the old name (gradient_checkpointing=True), which transformers 5 then reports as a
            # deprecated setting on every run; carry it over to the new name, as transformers itself would.
            if getattr(self, current, "absent") is None and getattr(self, deprecated, None) is not None:
                setattr(self, current, getattr(self, deprecated))
        self.requested_gradient_accumulation_steps = self.gradient_accumulation_steps
        requested_num_generations = self.num_generations
        # GRPOConfig sizes its own generation batch from GA and checks it against num_generations; that batch is
        # not ours, so give it values that pass, then restore.
        self.gradient_accumulation_steps = 1
        self.steps_per_generation = 2
        self.generation_batch_size = None
        self.num_generations = 2
        super().__post_init__()
        self.num_generations = requested_num_generations
        self.steps_per_generation = 1
        if self.rollouts_per_step is None:
            self.rollouts_per_step = (
                self.per_device_train_batch_size * self.requested_gradient_accumulation_steps * self.world_size
            )
        self.generation_batch_size = self.rollouts_per_step
        if self.max_tokens_per_microbatch is None:
            self.max_tokens_per_microbatch = 4 * self.max_seq_len
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad knob."""
        choices = {
            "loss_type": LOSS_TYPES,
            "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
            "importance_correction": CORRECTION_MODES,
            "overlong": OVERLONG_POLICIES,
            "micro_batching": MICRO_BATCHING_MODES + ("auto",),
            "scale_rewards": SCALE_REWARDS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"Unknown {name} {getattr(self, name)!r}; expected one of {', '.join(allowed)}.")
        positive = ("max_seq_len", "rollouts_per_step", "max_tokens_per_microbatch", "per_device_train_batch_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.dr_grpo_horizon is not None and self.dr_grpo_horizon < 1:
            raise ValueError(f"dr_grpo_horizon must be >= 1, got {self.dr_grpo_horizon}.")
        if self.micro_batching != "padded" and self.max_tokens_per_microbatch < self.max_seq_len:
            raise ValueError(
                f"max_tokens_per_microbatch ({self.max_tokens_per_microbatch}) must be >= max_seq_len ({self.max_seq_len})."
            )
        if self.importance_cap <= 0:
            raise ValueError(f"importance_cap must be > 0, got {self.importance_cap}.")
        if self.importance_cap_min is not None and not 0 <= self.importance_cap_min < self.importance_cap:
            raise ValueError("importance_cap_min must satisfy 0 <= importance_cap_min < importance_cap.")
        if self.logprob_chunk_size < 0:
            raise ValueError("logprob_chunk_size must be >= 0.")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if self.max_off_policy_steps < 0:
            raise ValueError(f"max_off_policy_steps must be >= 0, got {self.max_off_policy_steps}.")
        if self.filter_groups not in ("none", "zero_variance"):
            raise ValueError(f"Unknown filter_groups {self.filter_groups!r}; expected one of none, zero_variance.")
        if self.max_refill_batches < 0:
            raise ValueError(f"max_refill_batches must be >= 0, got {self.max_refill_batches}.")
        if self.print_samples_every < 0:
            raise ValueError(f"print_samples_every must be >= 0, got {self.print_samples_every}.")
        if self.generation_timeout_s <= 0:
            raise ValueError("generation_timeout_s must be > 0.")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}.")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError("epsilon and epsilon_high must be >= 0.")
        if self.weight_sync_bucket_mb < 0:
            raise ValueError(f"weight_sync_bucket_mb must be >= 0 (0 = one tensor per gather), got {self.weight_sync_bucket_mb}.")
        if self.weight_sync_probe_tokens < 0 or self.weight_sync_probe_tokens == 1:
            raise ValueError(f"weight_sync_probe_tokens must be 0 (off) or >= 2, got {self.weight_sync_probe_tokens}.")
        if self.weight_sync_probe_tolerance is not None and not self.weight_sync_probe_tolerance > 0:
            raise ValueError(f"weight_sync_probe_tolerance must be > 0, got {self.weight_sync_probe_tolerance}.")
        if self.use_vllm or self.vllm_server_base_url:
            # TRL's own vLLM path would start its client and an NCCL weight-transfer group (CUDA only) beside ours.
            raise ValueError(
                "use_vllm / vllm_server_base_url select TRL's vLLM client, which verifiers_rl does not use. Pass "
                "--vllm_server_url http://HOST:PORT instead (start the server with "
                "`python -m verifiers_rl.inference.vllm_server --model MODEL --port PORT`)."
            )
        if self.vllm_server_url is not None and not self.vllm_server_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_url must start with http:// or https://, got {self.vllm_server_url!r}.")
        if self.vllm_max_concurrency < 1:
            raise ValueError(f"vllm_max_concurrency must be >= 1, got {self.vllm_max_concurrency}.")
        if self.vllm_request_timeout_s <= 0:
            raise ValueError(f"vllm_request_timeout_s must be > 0, got {self.vllm_request_timeout_s}.")
        from .inference.weight_transfer import TRANSFERS

        if self.vllm_weight_transfer not in TRANSFERS:
            raise ValueError(f"vllm_weight_transfer must be one of {TRANSFERS}, got {self.vllm_weight_transfer!r}.")
        if self.vllm_max_retries < 0:
            raise ValueError(f"vllm_max_retries must be >= 0, got {self.vllm_max_retries}.")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def _skip_deepspeed_cpu_shm_op() -> None:
    """On CPU DeepSpeed compiles a shared-memory all-reduce op at every start (50-85 s on 2 cores). Only
    inference all-reduce uses it; training collectives go through gloo, so skip building it."""
    if torch.cuda.is_available() or not _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return
    import deepspeed.comm.torch  # noqa: F401  (the attribute of that name is torch itself, hence sys.modules)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
