"""Evaluate a model on an environment's held-out split: ``verifiers-rl eval``.

    verifiers-rl eval --model outputs/train --env reverse_text -n 100 -k 4 --output results.jsonl
    verifiers-rl eval --model outputs/train/checkpoint-20 --env arithmetic --temperature 0
    verifiers-rl eval --model DIR --env my_env.py --holdout 50 --seed 42      # no eval split: hold rows out
    verifiers-rl eval --model DIR --env reverse_text --vllm_server_url http://127.0.0.1:8000
    verifiers-rl eval --model DIR --env '[{"env": "reverse_text"}, {"env": "arithmetic"}]' --holdout 20   # a mixture
    verifiers-rl eval --model DIR --env my_run.yaml --holdout 20   # the mixture of a training --config's env: list

Generates with the embedded engine (or a vLLM server serving ``--model``), prints a summary table (reward, pass@1,
pass@k, each reward function's mean, tokens, time; for a mixture also each entry's line) and writes one JSON line
per rollout. The rows, seeds and metrics are those of the trainer's evaluation
(``verifiers_rl.rollouts.evaluation``): with the same ``--seed`` (the training run's, 42 unless set), ``-n``,
``-k``, ``--temperature`` and the run's sampling flags (``--top_p``, ``--top_k``, ``--min_p``,
``--repetition_penalty``, ``--chat_template_kwargs``, ``--tool_mode``), a checkpoint evaluates to what the run logged
at its step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from verifiers_rl.core.engine import SamplingConfig
from verifiers_rl.core.flags import repeated_flag
from verifiers_rl.inference.vllm.http import SERVER_WAIT_S, check_server_url

PROG = "verifiers-rl eval"  # as argparse prefixes its usage errors: every error line starts the same way
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "adapter_model.*")


class ModelFolderError(ValueError):
    """A model folder that cannot be evaluated or trained; the message says why and what to pass instead."""


def check_model_folder(path: Path, tokenizer: bool = True,
                       tokenizer_hint: str = "pass --tokenizer (e.g. the base model)") -> None:
    """Raise ``ModelFolderError`` unless ``path`` holds a config, weights and (with ``tokenizer``) a tokenizer
    (``tokenizer_hint``: what the command's user can do without one).

    A ``--output_dir`` holds them after training, and so does every ``checkpoint-N`` inside it; under DeepSpeed
    ZeRO-3 a checkpoint holds whole weights only when the DeepSpeed config sets
    ``stage3_gather_16bit_weights_on_model_save`` (ours does), otherwise just the ranks' shards.
    """
    if not path.is_dir():
        raise ModelFolderError(f"--model {str(path)!r}: no such folder.")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        step = lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1  # noqa: E731
        checkpoints = sorted(path.glob("checkpoint-*"), key=step)
        if any(path.glob("global_step*")):
            hint = ("it holds DeepSpeed ZeRO-3 shards only (global_step*/). Save whole weights with "
                    "\"stage3_gather_16bit_weights_on_model_save\": true in the DeepSpeed config (accelerate_configs/"
                    "ds_zero3*.json has it), or consolidate the shards with the zero_to_fp32.py script DeepSpeed saves "
                    "in the folder.")
        elif checkpoints:
            hint = f"it holds checkpoints; pass one of them, e.g. --model {checkpoints[-1]}."
        else:
            hint = f"no weight files ({', '.join(WEIGHT_FILES)})."
        raise ModelFolderError(f"--model {str(path)!r} has no model weights: {hint}")
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise ModelFolderError(f"--model {str(path)!r} has weights but no config.json.")
    if tokenizer and not has_tokenizer(path):
        raise ModelFolderError(f"--model {str(path)!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                               f"{tokenizer_hint}.")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer (one of ``TOKENIZER_FILES``)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        # What an error prints above itself: argparse's own usage listed every flag, ~20 lines above the one error.
        usage=f"{PROG} [--FLAG VALUE ...]   ({PROG} --help: every flag)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # else --temp is --temperature: a typo or a prefix would set a flag
    )
    parser.add_argument("--model", default="smollm2",
                        help="A folder (a trained --output_dir or any checkpoint-N in it), 'smollm2', 'tiny', or a "
                             "hub id.")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer folder or id; default: the model's.")
    parser.add_argument("--env", default="reverse_text",
                        help="A built-in name, 'pkg.module:function', a .py file, or a verifiers 0.4 (v1) environment "
                             "module (as training's --env). Several: a mixture, as training's --env: a JSON list of "
                             "entries {\"env\": ..., \"env_args\": {...}, \"name\": ...}, or a .yaml file holding that "
                             "list or a training --config (only its env: list is read); each entry's held-out rows are "
                             "evaluated and reported on their own and together.")
    parser.add_argument("--env_args", default="{}", help="JSON keyword arguments for the environment's loader.")
    parser.add_argument("--chat_template_kwargs", default="{}",
                        help="JSON variables for the chat template, as training's --chat_template_kwargs "
                             "(e.g. '{\"enable_thinking\": false}' for Qwen3).")
    parser.add_argument("--tool_mode", default="auto", choices=("auto", "template", "text"),
                        help="How tool environments show tools to the model, as training's --tool_mode (a run trained "
                             "with one evaluates as it trained with the same).")
    parser.add_argument("-n", "--num_examples", type=int, default=None,
                        help="Prompts: the held-out split's first N rows (default: all of it).")
    parser.add_argument("-k", "--samples_per_prompt", type=int, default=1, help="Samples per prompt (pass@k).")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature; 0 = greedy.")
    parser.add_argument("--top_p", type=float, default=1.0, help="Nucleus sampling (1 = off), as training's --top_p.")
    parser.add_argument("--top_k", type=int, default=0, help="Top-k sampling (0 = off), as training's --top_k.")
    parser.add_argument("--min_p", type=float, default=0.0, help="Min-p sampling (0 = off), as training's --min_p.")
    parser.add_argument("--repetition_penalty", type=float, default=1.0,
                        help="Repetition penalty (1 = off), as training's --repetition_penalty.")
    parser.add_argument("--pass_threshold", type=float, default=1.0, help="A sample passes when its reward is >= this.")
    parser.add_argument("--holdout", type=int, default=0,
                        help="Evaluate N training rows held out by a --seed shuffle (what --eval_holdout N holds out).")
    parser.add_argument("--seed", type=int, default=42,
                        help="Seeds the samples (and --holdout); 42 is the trainer's default.")
    parser.add_argument("--output", default=None, help="Write one JSON line per rollout here.")
    parser.add_argument("--max_batch_size", type=int, default=64,
                        help="Most rollouts per generate call (embedded engine).")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="The embedded engine's precision (a vLLM server has its own: vllm-serve --dtype).")
    parser.add_argument("--vllm_server_url", default=None, help="Generate through this vLLM server (serving --model).")
    parser.add_argument("--generation_timeout_s", type=float, default=600.0,
                        help="Fail when no prompt's samples finish for this many seconds (a stuck environment or "
                             "engine), as training's.")
    parser.add_argument("--vllm_server_timeout", type=float, default=SERVER_WAIT_S,
                        help="Seconds to wait for a --vllm_server_url server that is still starting (as training's).")
    why = repeated_flag(parser, sys.argv[1:] if argv is None else argv)
    if why:
        parser.error(why)
    args = parser.parse_args(argv)
    from verifiers_rl.envs.loading import keyword_arguments

    try:
        args.env_kwargs = keyword_arguments(json.loads(args.env_args), "--env_args")
    except json.JSONDecodeError as error:
        parser.error(f"--env_args is not valid JSON: {error}")
    except ValueError as error:
        parser.error(str(error))
    args.chat_template_kwargs = template_kwargs(parser, args.chat_template_kwargs)
    args.entries = mixture_entries(parser, args.env, args.env_kwargs)
    for name in ("num_examples", "samples_per_prompt", "max_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}.")
    if args.temperature == 0 and args.samples_per_prompt > 1:
        from verifiers_rl.rollouts.evaluation import greedy_samples

        parser.error(greedy_samples(f"-k {args.samples_per_prompt}", "--temperature 0"))
    if args.holdout < 0:
        parser.error(f"--holdout must be >= 0, got {args.holdout}.")
    if not math.isfinite(args.pass_threshold):
        parser.error(f"--pass_threshold must be a finite number, got {args.pass_threshold}.")
    if args.output is not None and Path(args.output).is_dir():
        parser.error(f"--output {args.output} is a folder: name the file to write the rollouts to.")
    if args.vllm_server_timeout < 0:
        parser.error(f"--vllm_server_timeout must be >= 0, got {args.vllm_server_timeout:g}.")
    if not args.generation_timeout_s > 0:
        parser.error(f"--generation_timeout_s must be > 0, got {args.generation_timeout_s:g}.")
    try:  # the engine's settings, as training builds them (inference.factory.build_engine)
        args.sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, min_p=args.min_p,
                                       repetition_penalty=args.repetition_penalty)
    except ValueError as error:
        parser.error(f"--{error}")
    try:
        check_server_url(args.vllm_server_url, "--vllm_server_url")
    except ValueError as error:
        parser.error(str(error))
    embedded_only = [f"--{name} {getattr(args, name)}" for name in ("dtype", "max_batch_size")
                     if getattr(args, name) != parser.get_default(name)]
    if args.vllm_server_url and embedded_only:
        parser.error(f"{', '.join(embedded_only)} sets the embedded engine, which --vllm_server_url replaces (the "
                     "server has its own: verifiers-rl vllm-serve --dtype; it batches requests itself).")
    if not args.vllm_server_url and args.vllm_server_timeout != parser.get_default("vllm_server_timeout"):
        parser.error(f"--vllm_server_timeout {args.vllm_server_timeout:g} acts only with --vllm_server_url: it would "
                     "change nothing. Set both, or leave it out.")
    filters = [f"--{name} {getattr(args, name):g}" for name in ("top_p", "top_k", "min_p")
               if getattr(args, name) != parser.get_default(name)]
    if args.temperature == 0 and filters:
        parser.error(f"{', '.join(filters)} filters what is sampled; --temperature 0 is greedy (the most likely "
                     "token), which no filter changes. Leave them out, or sample (--temperature > 0).")
    return args


def template_kwargs(parser: argparse.ArgumentParser, text: str) -> dict:
    """``--chat_template_kwargs``' JSON as the dict every template is rendered with; a usage error names the flag."""
    from verifiers_rl.core.choices import check_chat_template_kwargs

    try:
        return check_chat_template_kwargs(json.loads(text), "--chat_template_kwargs")
    except json.JSONDecodeError as error:
        parser.error(f"--chat_template_kwargs is not valid JSON: {error}")
    except ValueError as error:
        parser.error(str(error))


def mixture_entries(parser: argparse.ArgumentParser, spec: str, env_kwargs: dict):
    """The mixture ``--env`` describes (``envs.mixture.parse_entries``), None for one environment; a usage error
    names the entry."""
    from verifiers_rl.envs.mixture import MixtureError, parse_entries, steering_keys

    try:
        entries = parse_entries(spec, "--env")
    except MixtureError as error:
        parser.error(str(error))
    if entries is not None and env_kwargs:
        parser.error(f"--env_args acts on one environment; a mixture's entries take their own: "
                     f"--env '[{{\"env\": ..., \"env_args\": {json.dumps(env_kwargs)}}}]'.")
    # Training-only keys are said, not silently dropped: evaluation rolls out every entry's held-out rows.
    unused = steering_keys(entries or [])
    if unused:
        print(f"note: the entries' {' and '.join(unused)} steer training's draws; evaluation rolls out every "
              f"entry's held-out rows, so they are not used here")
    return entries


def open_output(path: str | None):
    """``--output``'s file opened for writing (None without one); one that cannot be is a ValueError naming it."""
    if path is None:
        return None
    try:
        return open(path, "w")
    except OSError as error:
        raise ValueError(f"--output {path}: cannot write the file ({error.strerror}).") from None


def entry_lines(result) -> str:
    """A mixture's entries, a line each: reward, pass@k and prompts (``eval/env/<name>/...`` in training's logs)."""
    lines = []
    for name, part in result.by_env.items():
        passes = ", ".join(f"pass@{k} {v:.4f}" for k, v in part.pass_at.items())
        lines.append(f"  {name}: reward {part.reward:.4f}, {passes}, {part.num_prompts} prompts")
    return "\n".join(["per environment"] + lines) if lines else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from verifiers_rl.core.models import load_tokenizer, resolve_model

    model = resolve_model(args.model)
    if Path(model).exists() or args.model.startswith((".", "/", "~")):
        # Before the slow imports: a wrong path fails at once.
        check_model_folder(Path(model).expanduser(), tokenizer=args.tokenizer is None)
    from verifiers_rl.envs.loading import load_with_args, loader_errors_named
    from verifiers_rl.envs.mixture import load_mixture
    from verifiers_rl.envs.prepare import prepare_environment
    from verifiers_rl.envs.tools import default_tool_mode
    from verifiers_rl.rollouts.evaluation import EvalSettings, eval_rows, evaluate
    import torch

    from verifiers_rl.inference.factory import make_engine
    from verifiers_rl.training.progress import RolloutProgress, plain_output_when_redirected

    plain_output_when_redirected()
    tokenizer_dir = None if args.tokenizer is None else Path(args.tokenizer).expanduser()
    if tokenizer_dir is not None and tokenizer_dir.is_dir() and not has_tokenizer(tokenizer_dir):
        # else transformers' five lines, no flag named
        raise ModelFolderError(f"--tokenizer {args.tokenizer!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}).")
    tokenizer = load_tokenizer(args.tokenizer or model, "--tokenizer" if args.tokenizer else "--model")
    # As training prepares it; an environment's own limits stand (its rollouts are scored, never trained).
    prepare = lambda env, entry=None: prepare_environment(  # noqa: E731
        env, chat_template_kwargs=args.chat_template_kwargs, holdout=args.holdout, seed=args.seed,
        holdout_flag="--holdout")
    with loader_errors_named("--env", args.env, bool(args.env_kwargs)), default_tool_mode(args.tool_mode) as readers:
        if args.entries is None:
            environment = load_with_args(args.env, tokenizer, args.tool_mode, env_args=args.env_kwargs)
            prepare(environment)
        else:  # each entry on its own, as training loads a mixture (--holdout: N rows of each)
            environment = load_mixture(args.entries, lambda entry: load_with_args(
                entry.env, tokenizer, args.tool_mode, env_args=entry.env_args), prepare, "--env")
    if args.tool_mode != "auto" and not readers:  # as training refuses it
        raise ValueError(f"--tool_mode {args.tool_mode} is not used by this evaluation: no environment it loads "
                         "renders tools (ToolEnv and verifiers environments read it). Leave it out.")
    settings = EvalSettings(args.num_examples, args.samples_per_prompt, args.temperature, args.pass_threshold,
                            args.seed, args.generation_timeout_s)
    rows = eval_rows(environment, settings.num_examples, "-n")  # a bad -n fails before the model loads
    output = open_output(args.output)  # before evaluating: a path that cannot be written loses no results
    engine = make_engine(model, tokenizer, args.sampling,
                         vllm_server_url=args.vllm_server_url, require_weight_sync=False,
                         vllm={"chat_template_kwargs": args.chat_template_kwargs,
                               "wait_s": args.vllm_server_timeout, "max_seq_len": environment.max_seq_len},
                         max_batch_size=args.max_batch_size, dtype=getattr(torch, args.dtype))
    progress = RolloutProgress(len(rows) * settings.samples_per_prompt)
    try:
        result = evaluate(environment, engine, settings, on_group=progress)
    finally:
        progress.close()
        engine.close()
    if output is not None:
        with output:
            lines = [json.dumps(record) for sample in result.samples for record in sample.records()]
            output.write("".join(line + "\n" for line in lines))
    split = f"held out by --holdout {args.holdout}" if args.holdout else "eval split"
    print(f"model  {model}\nenv    {environment.name} ({split}), seed {args.seed}, temperature {args.temperature:g}")
    print(result.table())
    if result.by_env:
        print(entry_lines(result))
    if args.output:
        print(f"wrote {len(lines)} rollouts to {args.output}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """``main`` as a command: bad input is one clear line on stderr and exit status 2, no traceback."""
    from verifiers_rl.rollouts.evaluation import EvaluationTimeout

    try:
        return main(argv)
    except (ValueError, FileNotFoundError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except EvaluationTimeout as error:  # not a usage error: the environment or the engine is stuck
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
