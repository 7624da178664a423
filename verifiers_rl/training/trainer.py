"""RLTrainer: glue between a rollout source, the batching plan, the model and the pure loss (docs/architecture.md).

One HF Trainer step = one optimizer step = one batch. ``training_step`` runs every micro-batch of this rank
and backpropagates  partial * world_size  for each (the backend averages gradients over ranks), with gradient
synchronisation and the DeepSpeed engine step held back until the last micro-batch.

The trainer's other jobs are parts of their own, each in its module: which rollouts a step trains
(``steps.StepBatches``), checkpoints and resuming (``run_state.RunCheckpoints``), the engine's weights
(``weight_sync.EngineWeightSync``), step metrics and timing (``step_metrics``), what every rank must agree on
(``distributed``), SIGTERM/SIGINT (``preemption``) and the reach into upstream internals (``compat``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import sys
from collections.abc import Mapping

import torch
from accelerate.utils import DistributedType
from datasets import Dataset
from torch.utils.data import DataLoader
from trl import GRPOTrainer

from verifiers_rl import compat
from verifiers_rl.rollouts import evaluation
from verifiers_rl.training import progress
from verifiers_rl.training import reporting
from verifiers_rl.training import segmented_attention
from verifiers_rl.training.adapter_reference import AdapterReference, AdapterReferenceCallback
from verifiers_rl.config.lora import check_base_reference, check_peft_config, check_peft_model
from verifiers_rl.config.rl_config import RLConfig, check_resume_spec, check_written_paths
from verifiers_rl.training.distributed import (
    collective_failure_note,
    is_collective_failure,
    lost_peer_note,
    main_process_outcome,
    record_peers,
)
from verifiers_rl.training.entropy_terms import GATHER_PAD, EntropyTerms
from verifiers_rl.rollouts.generator import AsyncGenerator, GenerationTimeout, ReplaySource, RolloutSource, make_source
from verifiers_rl.inference.factory import (build_engine, check_given_engine_rows, check_given_engine_sampling,
                                            model_load_kwargs)
from verifiers_rl.core.engine import check_sequences_fit
from verifiers_rl.core.launch import launched_world_size, restart_count
from verifiers_rl.core.modeling import unwrap
from verifiers_rl.training.preemption import PreemptionCallback, PreemptionSignal, TrainingPreempted
from verifiers_rl.training.checkpoints import RunCheckpoints
from verifiers_rl.training.loss import ratio_is_per_sequence
from verifiers_rl.training.step_loss import CustomLoss, StepLoss, loss_settings
from verifiers_rl.training.step_metrics import StepMetrics, StepTimer
from verifiers_rl.training.batching import check_all_fit
from verifiers_rl.training.step_batches import StepBatches, batching_config
from verifiers_rl.training.weight_sync import EngineWeightSync, WeightSyncCallback


def _config(args, model) -> RLConfig:
    if args is None:
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
        return RLConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
    if not isinstance(args, RLConfig):
        raise TypeError(
            f"RLTrainer needs an RLConfig, got {type(args).__name__}: verifiers_rl.RLConfig takes every GRPOConfig "
            "field (`from verifiers_rl import RLConfig as GRPOConfig`)."
        )
    return args


def _tokenizer_of(model, args):
    """The tokenizer of ``model``: of a name, as ``args.model_init_kwargs`` choose its weights (revision, subfolder)."""
    from verifiers_rl.core.models import load_tokenizer

    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        raise ValueError("Pass processing_class=<tokenizer>: the model has no name to load its tokenizer from.")
    return load_tokenizer(str(name), load_kwargs=model_load_kwargs(args) if isinstance(model, str) else None)


def _dataset_environment(args, reward_funcs, train_dataset, eval_dataset, reward_processing_classes, tokenizer,
                         eval_environment=None):
    from verifiers_rl.envs.adapters.trl_dataset import RewardFunctionsEnv
    from verifiers_rl.envs.prepare import prepare_environment

    if reward_funcs is None or train_dataset is None:
        raise ValueError("TRL's form needs both reward_funcs and train_dataset.")
    if args.eval_strategy != "no" and eval_dataset is None and eval_environment is None and not args.eval_holdout:
        # As HF's Trainer refuses it; evaluation's own message names --eval_env, a flag of the command only.
        strategy = getattr(args.eval_strategy, "value", args.eval_strategy)  # HF's enum
        raise ValueError(f"eval_strategy={strategy!r} evaluates the held-out rows, and this trainer has "
                         "none: pass eval_dataset=... (TRL's form), or hold out training rows with eval_holdout=N.")
    if isinstance(eval_dataset, Mapping):  # else its names would be read as rows
        raise ValueError(f"eval_dataset as a dict of named datasets ({', '.join(map(str, eval_dataset))}; HF evaluates "
                         "each under eval_<name>_) is not supported: pass one dataset, or evaluate each by name in a "
                         "mixture (verifiers_rl.mixture_of of RewardFunctionsEnv entries, docs/environments.md).")
    environment = RewardFunctionsEnv(
        train_dataset, reward_funcs, tokenizer, reward_weights=args.reward_weights,
        reward_processing_classes=reward_processing_classes,  # trainer_state: _give_trainer_state, as of a version
        max_new_tokens=args.max_completion_length, max_seq_len=args.max_seq_len, eval_dataset=eval_dataset,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    # This is where TRL's form loads its environment (its chat kwargs and limits are the constructor's above).
    prepare_environment(environment, chat_template_kwargs=args.chat_template_kwargs, holdout=args.eval_holdout,
                        seed=args.seed)
    environment.check_completion_room()  # the prompts as rendered for the run
    return environment


def _normalized_reward_functions(args, environment) -> tuple[tuple[str, float], ...]:
    """(name, weight) of the reward functions ``multi_objective_aggregation=normalize_then_sum`` standardises one by
    one (``batching.normalize_then_sum_advantages``); empty for TRL's default, sum_then_normalize."""
    if args.multi_objective_aggregation != "normalize_then_sum":
        return ()
    names = getattr(environment, "reward_names", None)
    if not names:
        raise ValueError("multi_objective_aggregation=normalize_then_sum standardises each of TRL-style reward_funcs "
                         "(RLTrainer(reward_funcs=..., train_dataset=...)) on its own; an environment or a rollout "
                         "file gives one reward per rollout: leave it at sum_then_normalize.")
    return tuple(zip(names, environment.reward_weights))


def _warn_without_rewards(environment) -> None:
    """Say so when the training environment scores with a rubric of no reward function (``Rubric()``): every reward,
    and so every advantage, is 0, and the run learns nothing. (The adapters score with their own rewards.)"""
    from verifiers_rl.envs.environment import Environment

    entries = getattr(environment, "entries", None)
    if entries is not None:  # a mixture: each entry scores its own groups (its rubric is only its first entry's)
        for entry in entries:
            _warn_without_rewards(entry.environment)
        return
    rubric = getattr(environment, "rubric", None)  # None in a replay
    scores_with = getattr(type(environment), "rollout", None) is Environment.rollout
    if scores_with and rubric is not None and not rubric.functions:
        logging.getLogger(__name__).warning(
            "%s: its rubric has no reward function, so every reward and every advantage is 0 and this run learns "
            "nothing. Give it one: Rubric([reward_function, ...]).", environment.name)


def _render_with_config(args, environment, eval_environment) -> None:
    """The config's ``chat_template_kwargs`` into every environment the run renders prompts of (the one place that
    decides them; ``Environment.use_chat_template_kwargs``). A run with none has nothing they could act on."""
    environments = [env for env in (environment, eval_environment) if env is not None]
    if args.chat_template_kwargs and not environments:
        raise ValueError("--chat_template_kwargs acts where environments render prompts; a replay run without an "
                         "evaluation environment (--eval_env, eval_environment=) has none: its rollouts are token ids "
                         "already. Leave it unset.")
    for env in environments:
        env.use_chat_template_kwargs(args.chat_template_kwargs)


def _give_trainer_state(state, *environments) -> None:
    """TRL-form environments, alone or a mixture's entries, give ``state()`` to their reward functions as
    ``trainer_state`` (``use_trainer_state``), as TRL's GRPOTrainer gives its own."""
    for environment in environments:
        use = getattr(environment, "use_trainer_state", None)
        if use is not None:
            use(state)


def _trl_order(model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
               reward_processing_classes=None, callbacks=None, optimizers=(None, None), quantization_config=None,
               peft_config=None, **others):
    """TRL 1.16's ``GRPOTrainer`` positional order, up to ``peft_config`` (the arguments after it are not taken)."""


def _arguments(model, positional: tuple, keywords: dict) -> dict:
    """``RLTrainer``'s arguments by name: positional ones in ``RLTrainer._construct``'s order, or in TRL's
    (``_trl_order``) when the second is not a config (TRL's second is ``reward_funcs``)."""
    from transformers import TrainingArguments

    trl_order = bool(positional) and not (positional[0] is None or isinstance(positional[0], TrainingArguments))
    signature = inspect.signature(_trl_order if trl_order else RLTrainer._construct)
    if not trl_order:  # bound without ``self``
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    try:
        bound = signature.bind(model, *positional, **keywords).arguments
    except TypeError as error:
        order = "TRL's GRPOTrainer order" if trl_order else "RLTrainer's order"
        raise TypeError(f"RLTrainer{signature} ({order}): {error}") from None
    bound.update(bound.pop("others", {}))
    if bound.pop("quantization_config", None) is not None:
        raise ValueError("quantization_config: RLTrainer loads no model by id with it; load the model quantized "
                         "(from_pretrained(..., quantization_config=...)) and pass the model.")
    return bound


def _adapters_as_model(model, peft_config):
    """A folder of LoRA adapters given by path, as the command takes it without --use_peft: their base model with them
    merged in (``core.models.resolve_model``), trained whole; TRL read the folder as no model. Beside a
    ``peft_config`` refused: which adapters would train is the caller's to say."""
    from verifiers_rl.core.models import is_adapter_folder, resolve_model

    if not isinstance(model, str) or not is_adapter_folder(model):
        return model
    if peft_config is not None:
        raise ValueError(f"peft_config beside model={model!r}, a folder of LoRA adapters: to train those adapters "
                         f"on, pass PeftModel.from_pretrained(<their base model>, {model!r}, is_trainable=True) "
                         "and no peft_config; for new adapters over their merged weights, pass "
                         f"model=verifiers_rl.core.models.resolve_model({model!r}) (a cache folder, which the new "
                         "adapters then name as their base model).")
    return resolve_model(model)


def _subfolder_joined(model, args):
    """A local folder given with ``model_init_kwargs`` ``subfolder``: the subfolder itself, as the model (TRL reads the
    model's config at the folder's top, without the subfolder, and found none there); with ``revision``, refused."""
    from verifiers_rl.core.models import check_revision

    kwargs = args.model_init_kwargs or {}
    if isinstance(model, str):
        check_revision(model, kwargs)
    if not isinstance(model, str) or "subfolder" not in kwargs or not os.path.isdir(os.path.expanduser(model)):
        return model
    args.model_init_kwargs = {key: value for key, value in kwargs.items() if key != "subfolder"}
    return os.path.join(os.path.expanduser(model), kwargs["subfolder"])


def _check_adapters_before_trl(model, peft_config, args: RLConfig) -> None:
    """``check_peft_model``'s refusals before TRL's own (which names a module the user may never have given)."""
    if peft_config is not None:
        check_peft_config(model, peft_config, model_load_kwargs(args))
    elif _is_peft(model):
        check_peft_model(model)
    for config in ([peft_config] if peft_config is not None else getattr(model, "peft_config", {}).values()):
        check_base_reference(config, args.beta, args.sync_ref_model, copied=peft_config is None)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _check_launch(accelerator, deepspeed: bool) -> None:
    """Refuse a launch that would not train one model as asked: processes Accelerate does not see (each would train
    its own copy), or a DeepSpeed config whose fixed values disagree with the run's flags (HF says so only inside
    ``train()``, as a traceback on every rank)."""
    launched = launched_world_size()
    if accelerator.num_processes != launched:
        raise RuntimeError(
            f"{launched} processes were launched but Accelerate sees {accelerator.num_processes}: each would "
            "train its own copy. On CPU pass use_cpu=True (or ACCELERATE_USE_CPU=1) with a MULTI_GPU/DEEPSPEED "
            "launch; never `accelerate launch --cpu --num_processes N`."
        )
    mismatches = compat.deepspeed_config_mismatches(accelerator) if deepspeed else []
    if mismatches:
        where = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the DeepSpeed config"
        raise ValueError(f"{where} disagrees with this run's flags ({'; '.join(mismatches)}): set those keys to "
                         '"auto" in it (the flags then fill them in), or give flags that agree.')


def _check_engine(args, engine, environment) -> None:
    """The run's engine (given or built) against the run: it takes the environment's sequences, and decodes as the
    config says."""
    check_sequences_fit(engine, getattr(environment, "max_seq_len", None))  # None: a replay
    check_given_engine_rows(args, engine)
    check_given_engine_sampling(args, engine)


def run_steps(args: RLConfig, num_batches: int) -> int:
    """Optimizer steps of the run: ``max_steps``, or when unset HF's count, ceil(num_train_epochs * steps per epoch),
    an epoch being each of the source's ``num_batches`` batches trained ``num_iterations`` times."""
    if args.max_steps is not None and args.max_steps > 0:
        return args.max_steps
    steps = math.ceil(args.num_train_epochs * num_batches * args.num_iterations)
    if steps < 1:
        raise ValueError(f"num_train_epochs={args.num_train_epochs} of {num_batches} batches trains no step: set "
                         "--max_steps N or --num_train_epochs > 0.")
    return steps


def _unused_reward(completions, **kwargs):
    """Rewards come with the rollouts; TRL's constructor still asks for a reward function."""
    return [0.0] * len(completions)


class RLTrainer(compat.TrainerHooks, GRPOTrainer):
    """A GRPOTrainer whose update equals the single-device full-batch update (docs/architecture.md).

    Args:
        model: hub id, local folder, or a loaded model.
        args: an ``RLConfig`` (default: ``RLConfig("<model name>-GRPO")``, as TRL's).
        reward_funcs, train_dataset, eval_dataset, reward_processing_classes: TRL's ``GRPOTrainer`` form: a dataset
            with a ``prompt`` column and reward functions (or reward models) become a single-turn environment
            (``envs.adapters.trl_dataset``), generated by the embedded engine or ``--vllm_server_url``.
        rollout_source: where batches come from; defaults to replaying ``args.rollouts_path``.
        environment: an ``envs.Environment`` to generate from (live, asynchronous); needs ``engine`` on the main
            process (an ``inference`` engine whose weights the trainer refreshes after every optimizer step).
        loss_fn: optional custom loss, ``loss_fn(LossInputs) -> per-token loss [R, T] or a partial loss``.
        eval_environment: what ``evaluate`` (every ``--eval_steps``) rolls out on the engine; defaults to
            ``environment``. A replay run evaluates too when given one and an ``engine``.

    Positional arguments follow ``_construct``'s order (model, args, processing_class, rollout_source, ...) or, when
    the second is not a config, TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, ...)`` (``_trl_order``).
    """

    def __init__(self, model, *positional, **keywords):
        self._construct(**_arguments(model, positional, keywords))

    def _construct(
        self,
        model,
        args: RLConfig | None = None,
        processing_class=None,
        rollout_source: RolloutSource | None = None,
        environment=None,
        engine=None,
        loss_fn: CustomLoss | None = None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        eval_environment=None,
        *,
        reward_funcs=None,
        train_dataset=None,
        eval_dataset=None,
        reward_processing_classes=None,
    ):
        args = _config(args, model)
        check_written_paths(args)  # the first write came after the model loaded, save_rollouts_path's after a step
        model = _subfolder_joined(_adapters_as_model(model, peft_config), args)
        args.check_logging_steps()
        _ = args.device  # this process's set-up (launch.prepare_process, then transformers'): before any collective
        record_peers()  # every rank's pid: a survivor names a peer that died
        if reward_funcs is not None or train_dataset is not None:
            if environment is not None or rollout_source is not None or args.rollouts_path:
                raise ValueError("Pass either reward_funcs and train_dataset (TRL's form) or an environment / "
                                 "rollout source / --rollouts_path, not both.")
            processing_class = processing_class or _tokenizer_of(model, args)
            environment = _dataset_environment(args, reward_funcs, train_dataset, eval_dataset,
                                               reward_processing_classes, processing_class, eval_environment)
            if engine is None and args.process_index == 0:  # sets up this process first (launch.py)
                engine = build_engine(args, model, processing_class)
        elif args.reward_weights is not None:
            raise ValueError("reward_weights weights TRL-style reward_funcs; an environment's rubric weights its own "
                             "functions (set them there).")
        self.engine = engine
        self._reward_functions = _normalized_reward_functions(args, environment)
        self.live = environment is not None  # on every rank (only the main process holds the generator)
        _render_with_config(args, environment, eval_environment)  # before the rows are counted (lengths may change)
        _give_trainer_state(lambda: self.state, environment, eval_environment)
        _warn_without_rewards(environment)
        # Before the generator reads the dataset: --eval_holdout moves rows out of it.
        self.evaluation = evaluation.prepare(args, environment, eval_environment)
        self._eval_environment = eval_environment or environment  # what evaluate() without --eval_strategy rolls out
        self._trained = False  # set when train() returns or fails: evaluate() then loads the model's weights first
        if (environment is not None) == (rollout_source is not None or bool(args.rollouts_path)):
            raise ValueError("RLTrainer needs one rollout source: an environment, or rollout_source / --rollouts_path.")
        self.generator: AsyncGenerator | None = None
        self._source: RolloutSource | None = None  # the main process's; the other ranks never read a source

        def made() -> int:
            _check_engine(args, engine, environment)
            self._source = make_source(args, rollout_source, environment, engine)
            self.generator = self._source if environment is not None else None
            if isinstance(self._source, ReplaySource):  # a file's over-long rollout: refused now, not at its batch
                check_all_fit(self._source.batches, args.max_seq_len, args.overlong, str(self._source.path))
            return len(self._source)

        num_batches = main_process_outcome(made)
        if self.evaluation is not None:
            main_process_outcome(lambda: self.evaluation.check_engine(engine))
        max_steps = run_steps(args, num_batches)
        self._steps_per_epoch = num_batches * args.num_iterations  # the train dataloader's length: HF's epochs
        if self.generator is not None:
            self.generator.total_batches = math.ceil(max_steps / args.num_iterations)
        placeholder = Dataset.from_dict({"prompt": ["(rollouts come from the rollout source)"]})
        # TRL refuses sync_ref_model under PEFT (it keeps no reference model); ours mixes a copy of the adapters
        # (adapter_reference.py). With beta = 0 TRL's own refusal stands.
        adapter_sync = bool(args.sync_ref_model and args.beta != 0.0 and (peft_config is not None or _is_peft(model)))
        _check_adapters_before_trl(model, peft_config, args)
        super().__init__(
            model=model,
            # TRL checks reward_weights against its reward functions: one placeholder per weight.
            reward_funcs=[_unused_reward] * len(args.reward_weights or [None]),
            # self.args from here on: the user's config stays as they built it.
            args=args.trl_view(max_steps=max_steps, sync_ref_model=args.sync_ref_model and not adapter_sync),
            train_dataset=placeholder,
            eval_dataset=placeholder if self.evaluation is not None else None,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )
        check_peft_model(unwrap(self.model))  # wrapped by now, whether peft_config or a PeftModel was given
        _check_launch(self.accelerator, self.is_deepspeed_enabled)
        self.loss_fn = loss_fn
        self.args.sync_ref_model = args.sync_ref_model  # what runs (TRL's callback or the adapters' reference)
        self.adapter_reference = self._adapter_reference() if adapter_sync else None
        self._build_parts()

    def _adapter_reference(self) -> AdapterReference:
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise ValueError("sync_ref_model under PEFT mixes a copy of the adapters, which ZeRO-3 partitions across "
                             "ranks: not implemented. Use DDP (or ZeRO-1/2), or leave sync_ref_model off.")
        reference = AdapterReference(unwrap(self.model))
        self.add_callback(AdapterReferenceCallback(reference))
        return reference

    def _build_parts(self) -> None:
        args, accelerator = self.args, self.accelerator
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        sink = lambda: compat.step_metrics(self)  # noqa: E731 - TRL replaces the dict when it logs
        reduce = ((lambda how: lambda t: accelerator.reduce(t, reduction=how)) if accelerator.num_processes > 1
                  else (lambda how: lambda t: t))
        zero3 = bool(self.is_deepspeed_enabled and accelerator.state.deepspeed_plugin.zero_stage == 3)
        self.metrics = StepMetrics(sink, reduce("sum"), reduce("max"),
                                   ratio_is_per_sequence(args.importance_sampling_level))
        gather = ((lambda t: accelerator.gather(accelerator.pad_across_processes(t, dim=0, pad_index=GATHER_PAD)))
                  if accelerator.num_processes > 1 else (lambda t: t))
        self.entropy = EntropyTerms(args.top_entropy_quantile, args.entropy_coef, gather)
        if self.entropy.masks and self.loss_fn is not None:
            raise ValueError("top_entropy_quantile masks the built-in loss's tokens; with a custom loss_fn leave it at "
                             "1.0 (LossInputs carries no entropy mask).")
        self.step_loss = StepLoss(args, loss_settings(args), self.entropy, self.metrics, self.loss_fn,
                                  reference=lambda: (self.ref_model, self.adapter_reference))
        batching = batching_config(args, self.model, accelerator.num_processes, pad, self._reward_functions)
        self.steps = StepBatches(self._source, args, batching,
                                 accelerator.device, lambda: self.state.global_step)
        self.timer = StepTimer(sink, lambda: self.steps.wait_s)
        self.checkpoints = RunCheckpoints(
            args, accelerator, self.steps, self.generator, lambda: unwrap(self.model),
            accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else 0,
            # TRL's SyncRefModelCallback (added by GRPOTrainer for --sync_ref_model) moves it: checkpoints keep it.
            reference=lambda: (self.adapter_reference if self.adapter_reference is not None
                               else unwrap(self.ref_model) if args.sync_ref_model else None),
        )
        self.weight_sync = EngineWeightSync(
            args, accelerator, self.engine, self.generator, tokenizer,
            gather_model=lambda: self.model_wrapped if self.is_deepspeed_enabled else self.model,
            bare_model=lambda: unwrap(self.model), zero3=zero3, log=self.metrics.log, timed=self.timer.add_sync,
        )
        if self.live:  # every rank: the weight sync's gathers, probe and error hand-over are collective
            self.add_callback(WeightSyncCallback(self.sync_weights, lambda: self.checkpoints.resumed_from is not None))
        self.preemption = PreemptionSignal(lambda: lost_peer_note(self.accelerator.process_index, self.args.output_dir))
        self._preemption = PreemptionCallback(self.preemption, accelerator.device)
        self.add_callback(self._preemption)
        self.add_callback(self.timer)  # after the weight sync: a step ends when the engine holds its weights
        progress.install(self, self.steps.sample_completions)
        reporting.install(self, lambda: self.steps.latest_rollouts)

    def train(self, resume_from_checkpoint=None, **kwargs):
        """HF ``train``, plus: ``resume_from_checkpoint`` (default ``args.resume_from_checkpoint``) may be a folder or
        ``latest`` and continues the run exactly (``checkpoint.py``); SIGTERM/SIGINT finish the current optimizer
        step, write a checkpoint and raise ``TrainingPreempted`` on every rank (a second signal exits at once)."""
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        check_resume_spec(resume_from_checkpoint)
        # Installed before anything collective: a survivor of a dead peer that the launcher signals names the dead
        # one and exits (``PreemptionSignal``), also while it handles its failed collective below.
        self.preemption.install()
        try:
            if resume_from_checkpoint:
                path = self.checkpoints.restore(resume_from_checkpoint, self.state.global_step)
            else:
                self.checkpoints.check_fresh()
                path = None
            self._say_restart(resume_from_checkpoint, path)
            output = super().train(resume_from_checkpoint=path, **kwargs)
        except RuntimeError as exc:
            accelerator = self.accelerator
            if accelerator.num_processes > 1 and is_collective_failure(exc):
                note = collective_failure_note(accelerator.num_processes, accelerator.process_index,
                                               self.args.ddp_timeout, self.args.output_dir)
                # Said now: the launcher's SIGTERM may end this process before the traceback is printed.
                sys.stderr.write(f"\n[rank {accelerator.process_index}] {note}\n")
                sys.stderr.flush()
                exc.add_note(note)
            raise
        finally:
            self.preemption.uninstall()
            segmented_attention.uninstall()  # transformers' own sdpa again (the forward installs ours when needed)
            if self.generator is not None:
                # A thread stuck past the generation timeout (a hanging synchronous reward) ignores a cancel.
                self.generator.close(timeout_s=2.0 if isinstance(sys.exc_info()[1], GenerationTimeout) else 30.0)
                self.weight_sync.generator = None  # closed: a later weight load has no batch to wait for
            # The engine stays open (TRL form's too): evaluate() after train() samples with it.
            self._trained = True
        stopped_by = self._preemption.stopped_by
        if stopped_by is not None and self.state.global_step < self.state.max_steps:
            raise TrainingPreempted(stopped_by, self.checkpoints.last_checkpoint, self.state.global_step)
        return output

    def _say_restart(self, spec, path: str | None) -> None:
        """In workers restarted by torch elastic (``--max_restarts``): one line saying where the restart goes on."""
        count = restart_count()
        if not count or not self.accelerator.is_main_process:
            return
        where = (f"resuming from {path}" if path else
                 f"--resume_from_checkpoint {spec}: no checkpoint yet, starting fresh" if spec else
                 "no --resume_from_checkpoint (auto makes a restart resume): training starts from the beginning")
        print(f"verifiers_rl: restart {count} of this launch (torch elastic): {where}.", flush=True)

    @property
    def engine(self):
        """The inference engine (main process): generation, evaluation and the weight sync use it."""
        return self._engine

    @engine.setter
    def engine(self, engine) -> None:
        self._engine = engine
        if "weight_sync" in self.__dict__:
            self.weight_sync.engine = engine

    # --- HF hooks: data -------------------------------------------------------------------------------------

    def get_train_dataloader(self):
        # One item per optimizer step of an epoch of the source's batches, on every rank (the batch itself comes from
        # the source): HF's epochs are then the data's, for --save_strategy / --eval_strategy epoch and epoch logged.
        return DataLoader(list(range(self._steps_per_epoch)), batch_size=1, collate_fn=lambda items: items)

    # --- evaluation and the engine's weights --------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Roll out the held-out split on the engine at the current weights (``evaluation.py``) and log
        ``{prefix}_reward``, ``{prefix}_pass@1``, ``{prefix}_pass@k``, ... (backends show ``eval/...``). Every rank
        calls it (HF does, every ``--eval_steps``); the main process evaluates and every rank gets the metrics. It
        draws no random numbers that training uses, so it leaves the training trajectory as it was."""
        self.evaluation = evaluation.for_evaluate(self.evaluation, self.args, self._eval_environment, eval_dataset)
        # Every rank alike: a replay's engine holds older weights; after train() so may a live one's (best model).
        if not self.live or self._trained:
            self.sync_weights()
        run = self.evaluation.run
        metrics = main_process_outcome(lambda: run(self.engine).metrics(metric_key_prefix))
        compat.log_outside_training(self, metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def named_weights(self, bucket_bytes: int | None = None, stats=None):
        """The policy's full weights as ``(hf_name, tensor)`` on the main process (``EngineWeightSync.named_weights``;
        every rank must exhaust it)."""
        return self.weight_sync.named_weights(bucket_bytes, stats)

    def sync_weights(self) -> None:
        """Stream the current policy into the engine as version ``global_step`` and probe it (every rank calls it)."""
        self.weight_sync.sync(self.state.global_step)

    # --- one optimizer step -------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.timer.training_started()
        model.train()
        rank_batch = self.steps.next(lambda batch: self.step_loss.fill_fixed_logprobs(model, batch))
        if self.steps.iteration == 1:  # a new batch: TRL counts each generated batch's tokens once
            self.state.num_input_tokens_seen += rank_batch.stats.input_tokens
        # TRL's num_tokens: the running count, set rather than averaged over the logging window.
        compat.step_metrics(self)["num_tokens"] = [float(self.state.num_input_tokens_seen)]
        if self.entropy.masks:  # the quantile of the whole batch's entropies, before the first backward
            self.entropy.prepare(rank_batch, lambda mb: self.step_loss.logprobs(model, mb).entropy)
        world_size = self.accelerator.num_processes
        deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        self.metrics.begin_step()
        total = torch.zeros((), device=self.accelerator.device)
        last = len(rank_batch.micro_batches) - 1
        for k, mb in enumerate(rank_batch.micro_batches):
            # Only the last backward of the step may all-reduce (DDP) or step the engine (DeepSpeed).
            compat.set_sync_gradients(self.accelerator, k == last)
            sync = contextlib.nullcontext() if (k == last or deepspeed) else self.accelerator.no_sync(model)
            with sync:
                with self.compute_loss_context_manager():
                    partial = self.compute_loss(model, mb)
                # Backends average gradients over ranks; numerator / (denominator / D) undoes it.
                scaled = partial * world_size
                self.accelerator.backward(scaled, **({"scale_wrt_gas": False} if deepspeed else {}))
            total = total + scaled.detach().to(total.dtype)
        self.metrics.end_step(rank_batch)
        # HF averages the returned value over ranks: the mean of (rank sum * D) is the global loss.
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The partial loss of one micro-batch: its numerator over the global denominator (``StepLoss.partial``)."""
        if return_outputs:
            raise ValueError("RLTrainer.compute_loss does not return outputs.")
        return self.step_loss.partial(model, inputs)
