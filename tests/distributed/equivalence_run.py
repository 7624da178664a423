"""One launch, many configurations: train one (or two) SGD steps per configuration and save what the test compares.

Run under one process, under torchrun/Accelerate DDP, and under DeepSpeed ZeRO-3 with the same arguments;
``tests/integration/test_distributed_equivalence.py`` compares the saved parameters, logged losses and step counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from verifiers_rl.training import segmented_attention
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.rollout import group_episodes, read_rollouts
from verifiers_rl.training.step_metrics import TOKEN_METRICS
from verifiers_rl.training.trainer import RLTrainer
from verifiers_rl.training.distributed import leave_process_group

# name -> RLConfig overrides. Batches mix ragged lengths, environment tokens and fully masked sequences.
CONFIGS = {
    "grpo_token_padded1": dict(loss_type="grpo", micro_batching="padded", per_device_train_batch_size=1),
    "grpo_token_packed64": dict(loss_type="grpo", micro_batching="packed", max_tokens_per_microbatch=64),
    "grpo_sequence_padded3": dict(loss_type="grpo", importance_sampling_level="sequence", micro_batching="padded", per_device_train_batch_size=3),
    "dr_grpo_token_padded3": dict(loss_type="dr_grpo", micro_batching="padded", per_device_train_batch_size=3),
    "dr_grpo_sequence_packed96": dict(loss_type="dr_grpo", importance_sampling_level="sequence", importance_correction="sequence_truncate", micro_batching="packed", max_tokens_per_microbatch=96),
    "token_mean_padded2_clip": dict(loss_type="token_mean", micro_batching="padded", per_device_train_batch_size=2, max_grad_norm=0.05),
    "token_mean_packed256": dict(loss_type="token_mean", micro_batching="packed", max_tokens_per_microbatch=256),
    "grpo_kl_mask_padded4": dict(loss_type="grpo", beta=0.1, max_steps=2, importance_correction="token_mask", importance_cap_min=0.5, micro_batching="padded", per_device_train_batch_size=4),
    "dr_grpo_two_iterations_packed64": dict(loss_type="dr_grpo", num_iterations=2, micro_batching="packed", max_tokens_per_microbatch=64),
    "custom_loss_packed64": dict(loss_type="seq_mean_token_sum", micro_batching="packed", max_tokens_per_microbatch=64, loss_fn="reinforce"),
    "custom_partial_padded2": dict(loss_type="grpo", micro_batching="padded", per_device_train_batch_size=2, loss_fn="reinforce_partial"),
    "grpo_filter_zero_variance_padded2": dict(loss_type="grpo", filter_groups="zero_variance", micro_batching="padded", per_device_train_batch_size=2),
    "grpo_uneven_ranks_padded1": dict(loss_type="grpo", micro_batching="padded", per_device_train_batch_size=1, rollouts_per_step=3, rollouts="small"),
    # TRL's loss knobs (delta, the off-policy mask, its importance correction; the KL is bias-corrected by default).
    "trl_knobs_two_iterations_packed64": dict(loss_type="dapo", num_iterations=2, beta=0.1, delta=1.2, off_policy_mask_threshold=1.0, vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0, micro_batching="packed", max_tokens_per_microbatch=64),
    "entropy_quantile_coef_padded2": dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.05, micro_batching="padded", per_device_train_batch_size=2),
    # Prompt once per group (share_prompt_training; the configurations above run with it off).
    "grpo_shared_padded4": dict(loss_type="grpo", micro_batching="padded", per_device_train_batch_size=4, share_prompt_training="on"),
    "dr_grpo_shared_split_padded3": dict(loss_type="dr_grpo", micro_batching="padded", per_device_train_batch_size=3, share_prompt_training="on"),
    # TRL's sync_ref_model: the reference mixed towards the policy after every step (ZeRO-3: gathered, mixed on
    # rank 0, re-partitioned), so steps 2 and 3 take their KL against a moved reference.
    "sync_ref_kl_three_steps": dict(loss_type="grpo", beta=0.1, max_steps=3, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, micro_batching="padded", per_device_train_batch_size=4),
    "grpo_kl_mask_shared_padded4": dict(loss_type="grpo", beta=0.1, max_steps=2, importance_correction="token_mask", importance_cap_min=0.5, micro_batching="padded", per_device_train_batch_size=4, share_prompt_training="on"),
    "dr_grpo_two_iterations_shared_packed64": dict(loss_type="dr_grpo", num_iterations=2, micro_batching="packed", max_tokens_per_microbatch=64, share_prompt_training="on"),
    "token_mean_shared_auto_packed256": dict(loss_type="token_mean", micro_batching="packed", max_tokens_per_microbatch=256, share_prompt_training="auto"),
    "grpo_uneven_ranks_shared_padded4": dict(loss_type="grpo", micro_batching="padded", per_device_train_batch_size=4, rollouts_per_step=3, rollouts="small", share_prompt_training="on"),
    # Episodes of 1-3 branches (a v1 sub-agent's shape): advantages over episodes, each branch a sequence, the
    # branches of one episode on different ranks and micro-batches; one step of every episode of the file.
    "grpo_branches_padded2": dict(loss_type="grpo", micro_batching="padded", per_device_train_batch_size=2, rollouts="branching", rollouts_per_step="episodes"),
    "dr_grpo_branches_batch_std_shared_packed64": dict(loss_type="dr_grpo", scale_rewards="batch", micro_batching="packed", max_tokens_per_microbatch=64, share_prompt_training="on", rollouts="branching", rollouts_per_step="episodes"),
}
# Each prompt-sharing configuration and the unshared one whose update it must equal (micro-batching never changes it).
SHARED_TWINS = {
    "grpo_shared_padded4": "grpo_token_padded1",
    "dr_grpo_shared_split_padded3": "dr_grpo_token_padded3",
    "grpo_kl_mask_shared_padded4": "grpo_kl_mask_padded4",
    "dr_grpo_two_iterations_shared_packed64": "dr_grpo_two_iterations_packed64",
    "token_mean_shared_auto_packed256": "token_mean_packed256",
    "grpo_uneven_ranks_shared_padded4": "grpo_uneven_ranks_padded1",
}


def reinforce_loss(inputs):
    """A user's loss: plain REINFORCE per token, aggregated by the trainer under the global denominator."""
    return -inputs.advantages * inputs.logps


def reinforce_partial_loss(inputs):
    """A user's loss that aggregates itself: it returns this micro-batch's partial (token mean over the batch)."""
    return inputs.aggregate(-inputs.advantages * inputs.logps, "token_mean")


class StepCounter(TrainerCallback):
    """Counts real optimizer steps (on the innermost torch optimizer) and scheduler steps."""

    def __init__(self):
        self.optimizer_steps = 0
        self.scheduler = None

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        inner = optimizer
        while not type(inner).__module__.startswith("torch.optim"):
            inner = inner.optimizer
        inner.register_step_post_hook(lambda *_: setattr(self, "optimizer_steps", self.optimizer_steps + 1))
        self.scheduler = lr_scheduler

    def scheduler_steps(self) -> int:
        scheduler = self.scheduler
        while not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            scheduler = scheduler.scheduler
        return scheduler.last_epoch


def full_parameters(trainer) -> dict[str, torch.Tensor]:
    model = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.accelerator.unwrap_model(trainer.model)
    params = dict(model.named_parameters())
    if trainer.is_deepspeed_enabled:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name.removeprefix("module."): p.detach().clone() for name, p in params.items()}
    return {name: p.detach().clone() for name, p in params.items()}


def process_topology(accelerator) -> dict:
    """Where this process sits: what the launcher set and what Accelerate and torch.distributed made of it."""
    import torch.distributed as dist

    record = {
        "env": {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")},
        "process_index": accelerator.process_index,
        "local_process_index": accelerator.local_process_index,
        "num_processes": accelerator.num_processes,
        "is_main_process": accelerator.is_main_process,
        "is_local_main_process": accelerator.is_local_main_process,
        "pg_timeout_s": None,
    }
    if dist.is_initialized() and dist.get_backend() == "gloo":  # an NCCL group (a GPU run) has no CPU backend
        # Private API, for the test only: the gloo group's collective timeout (what ddp_timeout must set).
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        record["pg_timeout_s"] = backend.options._timeout.total_seconds()
    return record


def rank_loss_tokens(trainer) -> int:
    """Loss tokens in this rank's share of the last batch."""
    return int(sum(int(mb.loss_mask.sum()) for mb in trainer.steps.rank_batch.micro_batches))


def run(name: str, overrides: dict, model: str, rollouts: dict[str, str], out: Path, extra: dict) -> None:
    overrides = dict(overrides)
    rollouts_file = rollouts[overrides.pop("rollouts", "main")]
    loss_fn = {"reinforce": reinforce_loss, "reinforce_partial": reinforce_partial_loss, None: None}[overrides.pop("loss_fn", None)]
    settings = dict(
        output_dir=str(out / "trainer" / name),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=1e9,
        weight_decay=0.0,
        gradient_checkpointing=False,
        max_seq_len=64,
        rollouts_per_step=16,
        rollouts_path=rollouts_file,
        seed=0,
        disable_tqdm=True,
        share_prompt_training="off",
    )
    settings.update(extra)
    settings.update(overrides)
    if settings["rollouts_per_step"] == "episodes":  # the whole file in one step (rollouts_per_step counts episodes)
        settings["rollouts_per_step"] = len(group_episodes(read_rollouts(rollouts_file)))
    settings.setdefault("max_steps", settings.get("num_iterations", 1))
    counter = StepCounter()
    trainer = RLTrainer(model, RLConfig(**settings), callbacks=[counter], loss_fn=loss_fn)
    trainer.train()
    params = full_parameters(trainer)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    losses = [entry["loss"] for entry in logged]
    metrics = {key: [entry[key] for entry in logged] for key in TOKEN_METRICS if all(key in e for e in logged)}
    tokens = {key: [entry[key] for entry in logged] for key in ("tokens_forwarded", "tokens_unique")}
    rank_record = {**process_topology(trainer.accelerator), "loss_tokens": rank_loss_tokens(trainer)}
    (out / f"{name}.rank{trainer.accelerator.process_index}.json").write_text(json.dumps(rank_record))
    if trainer.accelerator.is_main_process:
        torch.save(params, out / f"{name}.pt")
        record = {
            "losses": losses,
            "metrics": metrics,
            "tokens": tokens,
            # ZeRO-3 steps its inner optimizer once per parameter sub-group; the engine counts real steps.
            "optimizer_steps": trainer.model_wrapped.global_steps if trainer.is_deepspeed_enabled else counter.optimizer_steps,
            "scheduler_steps": counter.scheduler_steps(),
            "global_steps": trainer.state.global_step,
            "num_processes": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "model_class": type(trainer.model_wrapped).__name__,
        }
        (out / f"{name}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()
    del trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rollouts", required=True)
    parser.add_argument("--small_rollouts", required=True)
    parser.add_argument("--branching_rollouts", required=True, help="episodes of several branches (episode_id)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--ddp_timeout", type=int, default=None, help="RLConfig.ddp_timeout, when given")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: tests/gpu (fp32 unless --bf16)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights (Accelerate's mixed precision)")
    args = parser.parse_args()
    # Packed and shared rows attend run by run wherever that computes fewer cells: these rows are short, and at the
    # default per-run overhead every one would attend densely; so the ranks mix both attention paths. (In main: the
    # test module imports CONFIGS from here, and its process keeps the default.)
    segmented_attention.RUN_OVERHEAD_CELLS = 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(CONFIGS)
    extra = {} if args.ddp_timeout is None else {"ddp_timeout": args.ddp_timeout}
    extra.update(use_cpu=args.device == "cpu", bf16=args.bf16)  # bf16 stated: RLConfig turns it on where CUDA is
    for name in names:
        print(f"[equivalence] rank {os.environ.get('RANK', '0')}: {name}", file=sys.stderr, flush=True)
        files = {"main": args.rollouts, "small": args.small_rollouts, "branching": args.branching_rollouts}
        run(name, CONFIGS[name], args.model, files, out, extra)


if __name__ == "__main__":
    main()
    leave_process_group()
