"""RLTrainer: glue between a rollout source, the batching plan, the model and the pure loss (SPEC §3).

One HF Trainer step = one optimizer step = one batch. ``training_step`` runs every micro-batch of this rank
and backpropagates  partial * world_size  for each (the backend averages gradients over ranks), with gradient
synchronisation and the DeepSpeed engine step held back until the last micro-batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import GRPOTrainer

from .batching import BatchingConfig, MicroBatch, RankBatch, plan_batch
from .checkpoint import (
    CheckpointError,
    RunState,
    check_fits,
    load_pending,
    load_run_state,
    model_signature,
    partial_root,
    publish,
    resolve_checkpoint,
    rows_sha256,
    save_run_state,
)
from .config import RLConfig
from .generator import AsyncGenerator, ReplaySource, RolloutSource, drop_zero_variance_groups
from .loss import GlobalCounts, aggregation_weights, per_token_loss
from . import evaluation, progress, reporting
from .policy import attention_cost, micro_batch_logprobs, sequence_logprobs, splits_packed_rows, unwrap
from .preemption import PreemptionSignal, TrainingPreempted
from .rollouts import append_rollouts
from .weights import (
    GatherStats,
    WeightSyncError,
    WeightSyncWarning,
    compare_logprobs,
    default_probe_tolerance,
    gathered_named_weights,
    probe_token_ids,
    probe_warning,
)

logger = logging.getLogger(__name__)


class MainProcessError(RuntimeError):
    """Raised on every rank when the main process failed to produce what all ranks wait for."""


def _main_process_outcome(compute: Callable[[], Any], scatter: bool = False) -> Any:
    """Run ``compute`` on rank 0 and hand its result (or its error) to every rank, so no rank waits forever.

    With ``scatter``, ``compute`` returns one object per rank and each rank receives its own.
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed:
        result = compute()
        return result[0] if scatter else result
    rank, world = dist.get_rank(), dist.get_world_size()
    outcome: list[Any]
    error = None
    if rank == 0:
        try:
            result = compute()
            outcome = [("ok", item) for item in result] if scatter else [("ok", result)]
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
            message = f"{type(exc).__name__}: {exc}"
            outcome = [("error", message)] * (world if scatter else 1)
    else:
        outcome = [None] * (world if scatter else 1)
    if scatter:
        received: list[Any] = [None]
        dist.scatter_object_list(received, outcome if rank == 0 else None, src=0)
        status, payload = received[0]
    else:
        dist.broadcast_object_list(outcome, src=0)
        status, payload = outcome[0]
    if status == "error":
        if error is not None:
            raise error
        raise MainProcessError(f"The main process failed: {payload}")
    return payload


# gloo reports a lost peer as a plain RuntimeError; these are the messages seen for a killed or a stopped peer (in a
# collective, or in DDP's all-reduce during backward).
_GLOO_PEER_LOST = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "caused pair closure",
                   "Timed out waiting")


def _is_collective_failure(exc: BaseException) -> bool:
    """A collective that lost its peers: torch's distributed errors (NCCL's), or gloo's plain RuntimeErrors."""
    return isinstance(exc, dist.DistError) or any(marker in str(exc) for marker in _GLOO_PEER_LOST)


def _collective_failure_note(accelerator, timeout_s: int) -> str:
    return (
        f"verifiers_rl: a collective between the {accelerator.num_processes} processes failed on process "
        f"{accelerator.process_index}: another process died (its own log, on its machine, has the cause) or stopped "
        f"answering (given up after --ddp_timeout, now {timeout_s} s)."
    )


@dataclass
class LossInputs:
    """What a custom loss function receives for one micro-batch (tensors [R, T], zeros off the loss mask).

    ``global_stats`` maps a mask name to its counts over the whole step batch on all ranks (tokens N, valid
    sequences B_v, horizon H). ``aggregate(per_token, loss_type)`` turns per-token losses into this
    micro-batch's partial loss under the global denominator, so partials over ranks and micro-batches sum to
    the single-device loss.
    """

    logps: torch.Tensor
    proximal_logps: torch.Tensor
    sampler_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    seq_index: torch.Tensor
    sequence_loss_tokens: torch.Tensor
    global_stats: dict[str, GlobalCounts]
    loss_type: str

    def aggregate(self, per_token: torch.Tensor, loss_type: str | None = None) -> torch.Tensor:
        weights = aggregation_weights(
            loss_type or self.loss_type, self.loss_mask, self.sequence_loss_tokens, self.global_stats["loss_mask"]
        )
        return (per_token * weights.to(per_token.dtype)).sum()


CustomLoss = Callable[[LossInputs], torch.Tensor]


def _unused_reward(completions, **kwargs):
    """Rewards come with the rollouts; TRL's constructor still asks for a reward function."""
    return [0.0] * len(completions)


@dataclass
class _StepMetrics:
    """Token sums of one optimizer step on this rank; reduced over ranks once per step."""

    names: tuple = ("entropy", "clip_fraction", "is_weight", "is_ratio", "is_clipped_fraction", "kl")
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.sums[name] = self.sums.get(name, torch.zeros((), dtype=torch.float64, device=value.device)) + value


class RLTrainer(GRPOTrainer):
    """A GRPOTrainer whose update equals the single-device full-batch update (SPEC §3).

    Args:
        model: hub id, local folder, or a loaded model.
        args: an ``RLConfig``.
        rollout_source: where batches come from; defaults to replaying ``args.rollouts_path``.
        environment: an ``envs.Environment`` to generate from (live, asynchronous); needs ``engine`` on the main
            process (an ``inference`` engine whose weights the trainer refreshes after every optimizer step).
        loss_fn: optional custom loss, ``loss_fn(LossInputs) -> per-token loss [R, T] or a partial loss``.
        eval_environment: what ``evaluate`` (every ``--eval_steps``) rolls out on the engine; defaults to
            ``environment``. A replay run evaluates too when given one and an ``engine``.
    """

    def __init__(
        self,
        model,
        args: RLConfig,
        processing_class=None,
        rollout_source: RolloutSource | None = None,
        environment=None,
        engine=None,
        loss_fn: CustomLoss | None = None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        eval_environment=None,
    ):
        if not isinstance(args, RLConfig):
            raise TypeError(f"RLTrainer needs an RLConfig, got {type(args).__name__}.")
        self.engine = engine
        # Before the generator reads the dataset: --eval_holdout moves rows out of it.
        self.evaluation = evaluation.prepare(args, environment, eval_environment)
        self.generator: AsyncGenerator | None = None
        if environment is not None:
            if rollout_source is not None or args.rollouts_path:
                raise ValueError("Pass either an environment or a rollout source / --rollouts_path, not both.")
            num_batches = _main_process_outcome(lambda: len(self._start_generator(environment, engine, args)))
        elif rollout_source is None:
            if not args.rollouts_path:
                raise ValueError("RLTrainer needs a rollout source: an environment, rollout_source or --rollouts_path.")
            path, per_step = args.rollouts_path, args.rollouts_per_step
            num_batches = _main_process_outcome(lambda: len(self._load_replay(path, per_step)))
        else:
            self._replay = rollout_source
            num_batches = len(rollout_source)
        if self.evaluation is not None:
            _main_process_outcome(lambda: self.evaluation.check_engine(engine))
        if args.max_steps is None or args.max_steps <= 0:
            args.max_steps = int(num_batches * args.num_iterations * max(args.num_train_epochs, 1))
        if self.generator is not None:
            self.generator.total_batches = math.ceil(args.max_steps / args.num_iterations)
        placeholder = Dataset.from_dict({"prompt": ["(rollouts come from the rollout source)"]})
        super().__init__(
            model=model,
            reward_funcs=_unused_reward,
            args=args,
            train_dataset=placeholder,
            eval_dataset=placeholder if self.evaluation is not None else None,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )
        if environment is not None:
            self.add_callback(_WeightSyncCallback(self))
        self.preemption = PreemptionSignal()
        self.add_callback(_PreemptionCallback(self))
        progress.install(self, self.sample_completions)
        reporting.install(self, lambda: self._latest_rollouts)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if self.accelerator.num_processes != launched:
            raise RuntimeError(
                f"{launched} processes were launched but Accelerate sees {self.accelerator.num_processes}: each would "
                "train its own copy. On CPU pass use_cpu=True (or ACCELERATE_USE_CPU=1) with a MULTI_GPU/DEEPSPEED "
                "launch; never `accelerate launch --cpu --num_processes N`."
            )
        self.loss_fn = loss_fn
        self.pad_token_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        self._rank_batch: RankBatch | None = None
        self._latest_rollouts: list | None = None
        self._batch_index = 0
        self._iteration = 0
        self._resumed_from: str | None = None
        self._checkpoint_root: str | None = None  # set while HF writes a checkpoint (under its partial name)
        self._stopped_by: int | None = None  # the signal that stopped training
        self._last_checkpoint: str | None = None
        self._rows_sha256: str | None = None

    def _load_replay(self, path, rollouts_per_step) -> RolloutSource:
        self._replay = ReplaySource(path, rollouts_per_step)
        return self._replay

    def _start_generator(self, environment, engine, args: RLConfig) -> AsyncGenerator:
        if engine is None:
            raise ValueError("Generating from an environment needs an inference engine on the main process.")
        self.generator = AsyncGenerator(
            environment,
            engine,
            rollouts_per_step=args.rollouts_per_step,
            num_generations=args.num_generations,
            max_off_policy_steps=args.max_off_policy_steps,
            timeout_s=args.generation_timeout_s,
            seed=args.seed,
            steps_per_batch=args.num_iterations,
            filter_groups=args.filter_groups == "zero_variance",
            max_refill_batches=args.max_refill_batches,
        )
        self._replay = self.generator
        return self.generator

    def train(self, resume_from_checkpoint=None, **kwargs):
        """HF ``train``, plus: ``resume_from_checkpoint`` (default ``args.resume_from_checkpoint``) may be a folder or
        ``latest`` and continues the run exactly (``checkpoint.py``); SIGTERM/SIGINT finish the current optimizer
        step, write a checkpoint and raise ``TrainingPreempted`` on every rank (a second signal exits at once)."""
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        self._stopped_by = None
        try:
            path = self._restore(resume_from_checkpoint) if resume_from_checkpoint else None
            self.preemption.install()
            try:
                output = super().train(resume_from_checkpoint=path, **kwargs)
            finally:
                self.preemption.uninstall()
        except RuntimeError as exc:
            if self.accelerator.num_processes > 1 and _is_collective_failure(exc):
                exc.add_note(_collective_failure_note(self.accelerator, self.args.ddp_timeout))
            raise
        finally:
            if self.generator is not None:
                self.generator.close()
        if self._stopped_by is not None and self.state.global_step < self.state.max_steps:
            raise TrainingPreempted(self._stopped_by, self._last_checkpoint, self.state.global_step)
        return output

    # --- checkpoints --------------------------------------------------------------------------------------------

    def _run_state(self) -> RunState:
        """This run's position and identity (main process: only it holds the rollout source)."""
        args = self.args
        if self.generator is not None:
            if self._rows_sha256 is None:
                self._rows_sha256 = rows_sha256(self.generator.rows)
            source = {
                "kind": "live",
                "environment": self.generator.environment.name,
                "rows_sha256": self._rows_sha256,
                "num_generations": args.num_generations,
                "seed": args.seed,
            }
        else:
            source = {"kind": "replay", "path": str(getattr(self._replay, "path", "")),
                      "sha256": getattr(self._replay, "sha256", None)}
        return RunState(
            global_step=self.state.global_step,
            next_batch=self._batch_index,
            iteration=self._iteration,
            num_iterations=args.num_iterations,
            rollouts_per_step=args.rollouts_per_step,
            world_size=self.accelerator.num_processes,
            zero_stage=self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else 0,
            model=model_signature(unwrap(self.model)),
            source=source,
        )

    def _restore(self, spec) -> str:
        """Check the checkpoint ``spec`` names against this run and restore the rollout source's position, the
        batches generated ahead and (part-way through a batch) each rank's slice of it. Errors reach every rank."""

        def load():
            path = resolve_checkpoint(spec, self.args.output_dir)
            saved = load_run_state(path)
            check_fits(saved, self._run_state(), path)
            if self.generator is not None:
                self.generator.restore(saved.next_batch, load_pending(path, saved))
            self._truncate_saved_rollouts(saved)
            return str(path), saved

        path, saved = _main_process_outcome(load)
        self._batch_index, self._iteration = saved.next_batch, saved.iteration
        self._rank_batch = None
        if saved.mid_batch():
            rank_file = f"{path}/rank_batch-{self.accelerator.process_index}.pt"
            rank_batch: RankBatch = torch.load(rank_file, map_location="cpu", weights_only=False)
            rank_batch.micro_batches = [mb.to(self.accelerator.device) for mb in rank_batch.micro_batches]
            self._rank_batch = rank_batch
        self._resumed_from = path
        if self.accelerator.is_main_process:
            logger.info("Resuming from %s at step %d (next batch %d).", path, saved.global_step, saved.next_batch)
        return path

    def _truncate_saved_rollouts(self, saved: RunState) -> None:
        """``--save_rollouts_path``: drop what the stopped run appended after its checkpoint (those batches are
        trained again), so the file holds every batch once."""
        target = self.args.save_rollouts_path
        record = saved.save_rollouts
        if not target or record is None or os.path.abspath(target) != record["path"]:
            return
        size = os.path.getsize(target) if os.path.exists(target) else 0
        if size < record["bytes"]:
            raise CheckpointError(
                f"--save_rollouts_path {target!r} holds {size} bytes, fewer than the {record['bytes']} it held at the "
                "checkpoint: it was changed since. Pass another --save_rollouts_path."
            )
        os.truncate(target, record["bytes"])

    def _issue_warnings_after_load(self, load_result) -> None:
        # A tied output layer is saved once, under the input embedding's name: its absence is not a missing weight.
        model = unwrap(self.model)
        aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        aliases -= {name for name, _ in model.named_parameters()}
        load_result.missing_keys[:] = [key for key in load_result.missing_keys if key not in aliases]
        super()._issue_warnings_after_load(load_result)

    def _get_output_dir(self, trial) -> str:
        return self._checkpoint_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """HF's checkpoint, written under ``.partial-checkpoint-N`` with this run's state beside it, then renamed to
        ``checkpoint-N`` in one step once every rank has written its part."""
        run_dir = super()._get_output_dir(trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        root = partial_root(run_dir, self.state.global_step)
        self._checkpoint_root = str(root)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._checkpoint_root = None
        written = root / os.path.basename(final)
        self._save_run_state(written)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            publish(root, Path(final))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_local_main_process and written.is_dir():
            publish(root, Path(final))  # a node that does not share the output folder with the main process
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        self._last_checkpoint = final

    def _save_run_state(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if self._rank_batch is not None and 0 < self._iteration < self.args.num_iterations:
            # Its proximal log-probs came from weights older than the checkpoint's: keep the slice itself.
            torch.save(self._rank_batch, folder / f"rank_batch-{self.accelerator.process_index}.pt")
        if self.accelerator.is_main_process:
            state = self._run_state()
            target = self.args.save_rollouts_path
            if target and os.path.exists(target):
                state.save_rollouts = {"path": os.path.abspath(target), "bytes": os.path.getsize(target)}
            save_run_state(folder, state, self.generator.pending() if self.generator is not None else {})

    def _agreed_signal(self) -> int:
        """The stop signal any rank has received (0 if none): one all-reduce, so every rank stops at the same step."""
        local = self.preemption.received or 0
        if self.accelerator.num_processes == 1:
            return local
        flag = torch.tensor([local], dtype=torch.int64, device=self.accelerator.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    # --- evaluation ------------------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Roll out the held-out split on the engine at the current weights (``evaluation.py``) and log
        ``{prefix}_reward``, ``{prefix}_pass@1``, ``{prefix}_pass@k``, ... (backends show ``eval/...``). Every rank
        calls it (HF does, every ``--eval_steps``); the main process evaluates and every rank gets the metrics. It
        draws no random numbers that training uses, so it leaves the training trajectory as it was."""
        if self.evaluation is None:
            raise ValueError("No evaluation configured: pass --eval_steps N (and --eval_env for a replay run).")
        if self.generator is None:
            self.sync_weights()  # replay: the engine holds the weights of the previous evaluation, or the initial ones
        run = self.evaluation.run
        metrics = _main_process_outcome(lambda: run(self.engine).metrics(metric_key_prefix))
        # Trainer.log, not GRPOTrainer.log: that one would flush the training metrics gathered since the last log.
        super(GRPOTrainer, self).log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    # --- weights to the engine ----------------------------------------------------------------------------------

    _probe_ids: list[int] | None = None  # the probe's tokens, once the first sync found the engine can be probed
    _probe_checked = False
    _syncs = 0  # weight syncs so far (the probe runs on the first and every weight_sync_probe_every-th)

    def _zero3(self) -> bool:
        return bool(self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3)

    def named_weights(self, bucket_bytes: int | None = None, stats: GatherStats | None = None):
        """The policy's full weights as a stream of ``(hf_name, tensor)`` on the main process (nothing elsewhere),
        gathered bucket by bucket (``weights.gathered_named_weights``; default bucket ``weight_sync_bucket_mb``).

        Every rank must exhaust it, in lockstep (ZeRO-3 gathers are collective); tensors are valid only until the
        next item is requested.
        """
        model = self.model_wrapped if self.is_deepspeed_enabled else self.model
        if bucket_bytes is None:
            bucket_bytes = int(self.args.weight_sync_bucket_mb * 2**20)
        is_main = self.accelerator.is_main_process
        return gathered_named_weights(model, bucket_bytes, is_main=is_main, zero3=self._zero3(), stats=stats)

    def sync_weights(self) -> None:
        """Stream the current policy into the engine as version ``global_step``, then probe the engine.

        Every rank must call it (ZeRO-3 gathers and the probe's forward are collective). A failure of the engine
        on the main process stops every rank with an error once the gathers are done, instead of a hang.
        """
        version = self.state.global_step
        start = time.perf_counter()
        generating = self.accelerator.is_main_process and self.engine is not None and self.generator is not None
        # The exact schedule: batches of older versions are generated first (an error there stops every rank).
        _main_process_outcome(lambda: self.generator.wait_for_older_batches(version) if generating else None)
        # The batch lock, held through the load AND the probe: no batch mixes two versions, and the probe is not
        # queued behind the next batch's generation (which would serialise k >= 1 into generate-then-train).
        with self.generator.hold_weights() if generating else contextlib.nullcontext():
            stats = self._load_engine_weights(version)
            self._metrics["train"]["weight_sync_s"].append(time.perf_counter() - start)
            logger.debug("Weight sync to version %d: %s in %.3f s.", version, stats, time.perf_counter() - start)
            self._probe_engine(version)
        if generating:
            self.generator.weights_updated()

    def _load_engine_weights(self, version: int) -> GatherStats:
        stats = GatherStats()
        stream = self.named_weights(stats=stats)
        is_main = self.accelerator.is_main_process
        loading = is_main and self.engine is not None
        error: BaseException | None = None
        left = 0
        try:
            if loading:
                self.engine.load_weights(stream, version=version)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below, once every gather is done
            error = exc
        try:
            # The other ranks are still gathering: join every remaining bucket before anything else.
            left = sum(1 for _ in stream)
        except Exception as exc:  # noqa: BLE001 - a merge error, raised after the last gather
            error = error or exc
        if loading and error is None and left:
            error = RuntimeError(
                f"{type(self.engine).__name__}.load_weights returned with {left} of {stats.tensors} tensors unread."
            )

        def outcome() -> None:
            if error is not None:
                raise WeightSyncError(
                    f"Loading policy version {version} into the engine failed: {type(error).__name__}: {error}"
                ) from error

        _main_process_outcome(outcome)
        return stats

    def _probe_tolerance(self) -> float:
        """The configured tolerance, else one that fits the precision of both sides (the engine's on the main
        process: a bf16 server under a float32 trainer rounds as much as a bf16 trainer)."""
        if self.args.weight_sync_probe_tolerance is not None:
            return float(self.args.weight_sync_probe_tolerance)
        return default_probe_tolerance(
            "bf16" if self.args.bf16 else None, "fp16" if self.args.fp16 else None, getattr(self.engine, "dtype", None)
        )

    def _probe_engine(self, version: int) -> None:
        """Compare the engine's log-probs of a fixed sequence with the trainer's; warn loudly on a gap. Runs at the
        first sync and then at every ``weight_sync_probe_every``-th (the same syncs on every rank)."""
        self._syncs += 1
        if self.args.weight_sync_probe_tokens == 0 or (self._syncs - 1) % self.args.weight_sync_probe_every:
            return
        if not self._probe_checked:
            # Only the main process holds the engine; every rank must agree on running the (collective) forward.
            probed = _main_process_outcome(lambda: callable(getattr(self.engine, "prompt_logprobs", None)))
            self._probe_checked = True
            if probed:
                vocab = unwrap(self.model).get_input_embeddings().num_embeddings
                self._probe_ids = probe_token_ids(self._tokenizer, self.args.weight_sync_probe_tokens, vocab)
            elif self.accelerator.is_main_process:
                logger.info("The engine %s has no prompt_logprobs: no post-sync probe.", type(self.engine).__name__)
        if self._probe_ids is None:
            return
        ids = self._probe_ids
        trainer_logps = self._trainer_prompt_logprobs(ids)
        tolerance = self._probe_tolerance()

        def check():
            try:
                engine_logps = self.engine.prompt_logprobs(ids)
            except Exception as exc:
                raise WeightSyncError(
                    f"The post-sync probe of policy version {version} failed: {type(exc).__name__}: {exc}"
                ) from exc
            result = compare_logprobs(trainer_logps, [float(x) for x in engine_logps])
            if not result.max_gap <= tolerance:
                message = probe_warning(result, version, tolerance)
                logger.warning(message)
                warnings.warn(message, WeightSyncWarning, stacklevel=2)
            return result

        result = _main_process_outcome(check)
        self._metrics["train"]["weight_sync_probe_gap"].append(result.max_gap)

    @torch.no_grad()
    def _trainer_prompt_logprobs(self, ids: list[int]) -> list[float] | None:
        """The policy's log p(token_t | tokens_<t), t >= 1, at temperature 1 (main process; None elsewhere)."""
        zero3 = self._zero3()
        if not zero3 and not self.accelerator.is_main_process:
            return None
        # Under ZeRO-3 the forward gathers shards, so every rank runs it; otherwise the bare model runs on the main
        # process alone (a DDP forward may broadcast buffers, a collective the other ranks would not join).
        model = self.model_wrapped if zero3 else unwrap(self.model)
        was_training = model.training
        model.eval()  # no dropout: the engine's forward has none either
        try:
            logps = sequence_logprobs(model, ids, self.accelerator.device)
        finally:
            model.train(was_training)
        return logps.cpu().tolist() if self.accelerator.is_main_process else None

    # --- data ---------------------------------------------------------------------------------------------------

    def get_train_dataloader(self):
        # One item per optimizer step on every rank; the batch itself comes from the rollout source.
        return DataLoader(list(range(self.args.max_steps)), batch_size=1, collate_fn=lambda items: items)

    def batching_config(self) -> BatchingConfig:
        args = self.args
        return BatchingConfig(
            world_size=self.accelerator.num_processes,
            mode=self.micro_batching_mode(),
            rows_per_micro_batch=args.per_device_train_batch_size,
            max_tokens_per_microbatch=args.max_tokens_per_microbatch,
            max_seq_len=args.max_seq_len,
            horizon=args.dr_grpo_horizon,
            overlong=args.overlong,
            mask_truncated_completions=args.mask_truncated_completions,
            scale_rewards=args.scale_rewards,
            pad_token_id=self.pad_token_id,
            # A flash/varlen kernel cannot take the shared rows' tree mask; "on" then fails with the flag's name.
            share_prompt_training="off" if args.share_prompt_training == "auto" and splits_packed_rows(self.model) else args.share_prompt_training,
            attention_cost=attention_cost(self.model),
        )

    def micro_batching_mode(self) -> str:
        """``auto`` packs when the attention kernel splits packed rows by position ids (flash/varlen); otherwise a
        packed row's mask is dense over the row, and ``batching.cheapest_layout`` picks per batch by modelled cost."""
        if self.args.micro_batching != "auto":
            return self.args.micro_batching
        return "packed" if splits_packed_rows(self.model) else "auto"

    def _plan(self, batch_index: int) -> list[RankBatch]:
        waited = time.perf_counter()
        rollouts = self._replay.batch(batch_index)
        waited = time.perf_counter() - waited
        extra = {"reward_errors": float(sum(r.metrics.get("reward_errors", 0.0) for r in rollouts))}
        if self.generator is not None:
            extra.update(self.generator.filter_stats.pop(batch_index, {}))
        elif self.args.filter_groups == "zero_variance":  # replay: filter only
            kept, dropped = drop_zero_variance_groups(rollouts)
            extra.update(groups_kept=float(len({r.group_id for r in kept})), groups_dropped=float(dropped))
            if not kept:
                logger.warning("Batch %d: no group has reward variance; training on it unfiltered.", batch_index)
            rollouts = kept or rollouts
        self._latest_rollouts = rollouts
        if self.args.save_rollouts_path:
            append_rollouts(self.args.save_rollouts_path, rollouts)
        rank_batches = plan_batch(rollouts, self.batching_config(), batch_index)
        versions = [r.policy_version for r in rollouts if r.policy_version is not None]
        if versions:
            # Staleness: optimizer steps between the weights that sampled a rollout and the weights it trains.
            staleness = [self.state.global_step - v for v in versions]
            for rank_batch in rank_batches:
                rank_batch.stats.extra.update(
                    staleness_max=float(max(staleness)), staleness_mean=sum(staleness) / len(staleness)
                )
        if self.generator is not None:
            # Time the trainer sat waiting for rollouts (0 when generation ran ahead), and the batch's generation.
            extra.update(wait_time=waited, generation_time=self.generator.generation_seconds.pop(batch_index, 0.0))
        for rank_batch in rank_batches:
            rank_batch.stats.extra.update(extra)
        return rank_batches

    def sample_completions(self) -> list:
        """A few completions of the newest batch, for the progress output (main process; empty elsewhere)."""
        count = self.args.num_completions_to_print or 3
        return progress.sample_lines(self._latest_rollouts, count) if self._latest_rollouts else []

    def _next_rank_batch(self, model) -> RankBatch:
        """This rank's slice of the current batch; a new batch every ``num_iterations`` optimizer steps."""
        if self._rank_batch is None or self._iteration == self.args.num_iterations:
            index = self._batch_index
            rank_batch = _main_process_outcome(lambda: self._plan(index), scatter=True)
            rank_batch.micro_batches = [mb.to(self.accelerator.device) for mb in rank_batch.micro_batches]
            self._batch_index += 1
            self._iteration = 0
            self._fill_fixed_logprobs(model, rank_batch)
            self._rank_batch = rank_batch
        self._iteration += 1
        return self._rank_batch

    @torch.no_grad()
    def _fill_fixed_logprobs(self, model, rank_batch: RankBatch) -> None:
        """Reference log-probs (beta > 0) and, with several updates per batch, proximal log-probs: once per batch,
        before the first update, on every rank for the same number of micro-batches."""
        for mb in rank_batch.micro_batches:
            if self.args.num_iterations > 1:
                mb.proximal_logps = self._logprobs(model, mb).logps.detach()
            if self.beta != 0.0:
                mb.ref_logps = self._reference_logprobs(model, mb)

    def _reference_logprobs(self, model, mb: MicroBatch) -> torch.Tensor:
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, mb).logps
        with unwrap(model).disable_adapter():  # PEFT: the base model is the reference
            return self._logprobs(model, mb).logps

    def _logprobs(self, model, mb: MicroBatch):
        return micro_batch_logprobs(model, mb, self.args.temperature, self.args.logprob_chunk_size or None)

    # --- one optimizer step -------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        model.train()
        rank_batch = self._next_rank_batch(model)
        world_size = self.accelerator.num_processes
        deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        self._step_metrics = _StepMetrics()
        total = torch.zeros((), device=self.accelerator.device)
        last = len(rank_batch.micro_batches) - 1
        for k, mb in enumerate(rank_batch.micro_batches):
            # Only the last backward of the step may all-reduce (DDP) or step the engine (DeepSpeed).
            self.accelerator.gradient_state._set_sync_gradients(k == last)
            sync = contextlib.nullcontext() if (k == last or deepspeed) else self.accelerator.no_sync(model)
            with sync:
                with self.compute_loss_context_manager():
                    partial = self.compute_loss(model, mb)
                # Backends average gradients over ranks; numerator / (denominator / D) undoes it.
                scaled = partial * world_size
                self.accelerator.backward(scaled, **({"scale_wrt_gas": False} if deepspeed else {}))
            total = total + scaled.detach().to(total.dtype)
        self._log_step_metrics(rank_batch, time.perf_counter() - start)
        # HF averages the returned value over ranks: the mean of (rank sum * D) is the global loss.
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The partial loss of one micro-batch: its numerator over the global denominator (SPEC §3)."""
        if return_outputs:
            raise ValueError("RLTrainer.compute_loss does not return outputs.")
        mb: MicroBatch = inputs
        output = self._logprobs(model, mb)
        logps = output.logps
        proximal = mb.proximal_logps if mb.proximal_logps is not None else logps.detach()
        args = self.args
        terms = per_token_loss(
            logps,
            mb.advantages.to(logps.dtype),
            mb.loss_mask,
            mb.seq_index,
            proximal_logps=proximal,
            sampler_logps=mb.sampler_logps,
            ref_logps=mb.ref_logps,
            level=args.importance_sampling_level,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            correction=args.importance_correction,
            correction_cap=args.importance_cap,
            correction_cap_min=args.importance_cap_min,
            beta=self.beta,
        )
        inputs_for_hook = LossInputs(
            logps=logps,
            proximal_logps=proximal,
            sampler_logps=mb.sampler_logps,
            ref_logps=mb.ref_logps,
            advantages=mb.advantages,
            loss_mask=mb.loss_mask,
            seq_index=mb.seq_index,
            sequence_loss_tokens=mb.sequence_loss_tokens,
            global_stats={"loss_mask": mb.counts},
            loss_type=args.loss_type,
        )
        if self.loss_fn is None:
            partial = inputs_for_hook.aggregate(terms.per_token_loss)
        else:
            result = self.loss_fn(inputs_for_hook)
            partial = result if result.dim() == 0 else inputs_for_hook.aggregate(result)
        # Anchor every parameter in the graph, even for a micro-batch without loss tokens.
        partial = partial + 0.0 * logps.sum()
        self._accumulate(mb, output.entropy, terms)
        return partial

    def _accumulate(self, mb: MicroBatch, entropy, terms) -> None:
        mask = mb.loss_mask
        m = self._step_metrics
        m.add("entropy", (entropy * mask).sum())
        m.add("clip_fraction", (terms.clip_active * mask).sum())
        if mb.sampler_logps is not None:
            m.add("is_weight", (terms.is_weight * mask).sum())
            m.add("is_ratio", (terms.is_ratio_raw * mask).sum())
            m.add("is_clipped_fraction", ((terms.is_weight != terms.is_ratio_raw).to(mask.dtype) * mask).sum())
        if terms.kl is not None:
            m.add("kl", (terms.kl.detach() * mask).sum())

    def _log_step_metrics(self, rank_batch: RankBatch, seconds: float) -> None:
        m = self._step_metrics
        names = [name for name in m.names if name in m.sums]
        if names:
            stacked = torch.stack([m.sums[name] for name in names])
            reduced = self.accelerator.reduce(stacked, reduction="sum") if self.accelerator.num_processes > 1 else stacked
            # Token-weighted over the whole batch: sums over all ranks divided by the global token count N.
            tokens = max(rank_batch.counts.loss_tokens, 1)
            for name, value in zip(names, reduced.tolist()):
                self._metrics["train"][name].append(value / tokens)
        stats = rank_batch.stats
        train = self._metrics["train"]
        train["reward"].append(stats.reward_mean)
        train["reward_std"].append(stats.reward_std)
        train["truncated_fraction"].append(stats.truncated_fraction)
        train["real_token_fraction"].append(1 - stats.padding_tokens / max(stats.computed_tokens, 1))
        train["tokens_forwarded"].append(float(stats.computed_tokens))
        train["tokens_unique"].append(float(stats.unique_tokens))
        train["micro_batches_per_rank"].append(float(len(rank_batch.micro_batches)))
        train["loss_tokens"].append(float(rank_batch.counts.loss_tokens))
        train["step_time"].append(seconds)
        for name, value in stats.extra.items():
            train[name].append(value)


class _WeightSyncCallback(TrainerCallback):
    """After every optimizer step, the engine gets the new weights and is probed (every rank takes part: the ZeRO-3
    gathers and the probe's forward are collective). A resumed run loads the checkpoint's weights before its first
    batch."""

    def __init__(self, trainer: "RLTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer._resumed_from is not None:
            self.trainer.sync_weights()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.sync_weights()


class _PreemptionCallback(TrainerCallback):
    """At the end of each optimizer step: if any rank got SIGTERM/SIGINT, save a checkpoint and stop (every rank)."""

    def __init__(self, trainer: "RLTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        signum = self.trainer._agreed_signal()
        if signum:
            self.trainer._stopped_by = signum
            control.should_save = True
            control.should_training_stop = True
