"""End-to-end optimizer steps per second: our RLTrainer (k = 0 and k = 1) against TRL's own GRPOTrainer.

What it measures: these trainers, run one after the other in this one process, on the same problem:

- ``trl``: ``trl.GRPOTrainer`` with ``use_vllm=False`` (its in-process transformers ``generate`` on the policy
  itself, synchronous: generate, score, then train);
- ``verifiers_rl k=0``: ``RLTrainer`` from the ``reverse_text`` environment through the embedded HF engine (its own
  copy of the weights, refreshed after every step), synchronous;
- ``verifiers_rl k=1``: the same, generating one step ahead on the generator thread (the weight load and the
  post-sync probe run under the generator's batch lock, between two batches);
- ``verifiers_rl k=0 unshared``: k = 0 with ``share_prompt_training="off"`` (every completion's row carries its own copy of
  the prompt, as TRL's do); the other two run with the default ``share_prompt_training="auto"``.

Workloads (``--workload``): ``tiny`` (default) is described below; ``quickstart`` is the README's quickstart run:
SmolLM2-135M-Instruct (``verifiers_rl.models.smollm2_dir()``), 4 prompts x 4 samples, 16 new tokens,
``max_seq_len`` 128, learning rate 2e-5, 2 torch threads, and our micro-batching left at its default ``auto``
(the quickstart's: on CPU it picks, per batch, one packed row holding every group's shared prompt once and its
completions when the cost model finds that cheaper than padded shared rows, ~1.2x the unique tokens between
groups of different prompt lengths), the rest as below. Any of its settings can be overridden by the flags.

Same for all of them: the model (``tiny``: a random Llama from ``verifiers_rl.models.build_tiny_model``, hidden
256, 4 layers, loaded from the same folder), the prompts (the ``reverse_text`` dataset, system prompt included, in the order our
generator draws them; TRL gets them as a dataset of chat prompts with ``shuffle_dataset=False``), the reward
(``reversal_similarity``, partial credit by edit distance), the batch (4 prompts x 8 generations = 32 rollouts per
optimizer step, trained as one micro-batch of 32 rows: TRL ``per_device_train_batch_size=32``,
``gradient_accumulation_steps=1``, ``steps_per_generation=1``; ours ``rollouts_per_step=32``,
``per_device_train_batch_size=32``), ``max_completion_length`` (48), temperature 1.0 with the full softmax (top_k 0,
top_p 1), ``loss_type="grpo"``, ``scale_rewards="group"``, ``num_iterations=1``, ``beta=0`` (no reference model),
epsilon 0.2, AdamW at a constant learning rate of 1e-3, fp32, no gradient checkpointing, and the torch thread count
(every trainer runs at each count in ``--threads``, default 1 and 2; ``torch.set_num_threads`` is process-wide).
Differences that remain are the trainers' own: ours keeps a second copy of the weights in the engine (loaded after
every step), records the sampler's log-probs and applies the truncated importance weight; TRL generates with the
training model and applies no correction.

Each trainer runs ``--warmup`` + ``--steps`` optimizer steps; the wall time is taken over the last ``--steps``
(between ``on_step_end`` callbacks, so generation, scoring, training and the weight load are all inside).
``mean reward (last 3)`` is the mean batch reward over the last three steps (a sanity check that all of them train
on the same task, not a learning-speed comparison). ``cores busy`` is this process's CPU seconds per wall second over
the timed steps: about 2 when it has both cores to itself and uses them, lower when other work takes them.

A second table splits the timed steps (medians): ``gen s`` is the time a batch took to generate (TRL: its
``_generate_and_score_completions``, which also scores; ours: the generator's time for the batch, scoring
included, which at k = 1 overlaps training), ``train s`` the training forward/backward and optimizer step (TRL:
the step minus generation; ours: ``training_step`` minus the wait for the batch), and the tokens each step's
training forwards (padding included) against the step's unique tokens (each group's common prefix counted once;
TRL's rows all repeat the prompt and pad to the longest prompt and completion of the batch).

Run (about 1.5 minutes on 2 idle cores, longer on a busy machine; ``--quick``: 4 timed steps, 1 thread setting,
about 30 s):

    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py --threads 2 --trainers trl k0 k1
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py --workload quickstart   # about 8 minutes on 2 idle cores

Timings depend on what else runs on the machine: every progress line (stderr) carries ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
from collections import defaultdict
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

os.environ.setdefault("ACCELERATE_USE_CPU", "true")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from verifiers_rl.config import RLConfig  # noqa: E402
from verifiers_rl.envs import load_environment  # noqa: E402
from verifiers_rl.envs.builtin.reverse_text import reversal_similarity  # noqa: E402
from verifiers_rl.envs.parsers import Parser  # noqa: E402
from verifiers_rl.generator import AsyncGenerator  # noqa: E402
from verifiers_rl.inference.factory import build_engine  # noqa: E402
from verifiers_rl.models import build_tiny_model, smollm2_dir  # noqa: E402
from verifiers_rl.prefix import unique_tokens  # noqa: E402
from verifiers_rl.trainer import RLTrainer  # noqa: E402
from timing import StepRecorder, load, log  # noqa: E402  (benchmarks/timing.py)


WORKLOADS = {
    "tiny": dict(model="tiny", hidden=256, layers=4, prompts=4, num_generations=8, max_completion_length=48,
                 max_seq_len=160, learning_rate=1e-3, threads=[1, 2], micro_batching="padded"),
    "quickstart": dict(model="smollm2", prompts=4, num_generations=4, max_completion_length=16, max_seq_len=128,
                       learning_rate=2e-5, threads=[2], micro_batching="auto"),
}
LOGGED = ("generation_time", "wait_time", "step_time", "tokens_forwarded", "tokens_unique", "packed_micro_batches")


class SplitRecorder(StepRecorder):
    """Also keeps, per step, our trainer's logged timings and token counts, or TRL's generation time and the tokens
    its loss forwards (filled in by ``watch_trl``)."""

    def __init__(self):
        super().__init__()
        self.logged: dict[str, list[float]] = defaultdict(list)

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=logs, **kwargs)
        for key in LOGGED:
            if logs and key in logs:
                self.logged[key].append(float(logs[key]))

    def split(self, skip: int) -> dict[str, float]:
        """Medians over the steps after ``skip``: generation, training, forwarded and unique tokens per step."""
        logged = {key: values[skip:] for key, values in self.logged.items()}
        if "wait_time" in logged:  # ours (TRL logs a step_time of its own, but no wait)
            train = [step - wait for step, wait in zip(logged["step_time"], logged["wait_time"])]
        else:  # TRL: the step interval minus its generation
            train = [step - gen for step, gen in zip(self.intervals()[skip:], logged["generation_time"])]
        values = {"gen": logged["generation_time"], "train": train, "forwarded": logged["tokens_forwarded"],
                  "unique": logged["tokens_unique"]}
        split = {key: statistics.median(v) if v else float("nan") for key, v in values.items()}
        # The share of steps whose micro-batches micro_batching=auto packed (absent: a fixed mode, or TRL).
        packed = logged.get("packed_micro_batches")
        split["packed"] = statistics.mean(packed) if packed else float("nan")
        return split


def watch_trl(trainer: GRPOTrainer, recorder: SplitRecorder, num_generations: int) -> None:
    """Time TRL's generation (and scoring) per step and count the tokens its loss forwards (rows x width of the
    prompt and completion tensors) and the step's unique tokens (as ours: a group's common token prefix once, plus
    the rest of each sequence; TRL's groups are ``num_generations`` consecutive rows)."""
    generate = trainer._generate_and_score_completions
    compute_loss = trainer.compute_loss

    def timed_generate(*args, **kwargs):
        started = time.perf_counter()
        out = generate(*args, **kwargs)
        recorder.logged["generation_time"].append(time.perf_counter() - started)
        sequences = [p[pm.bool()].tolist() + c[cm.bool()].tolist() for p, pm, c, cm in
                     zip(out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"])]
        groups = [sequences[start : start + num_generations] for start in range(0, len(sequences), num_generations)]
        unique = sum(unique_tokens(g) for g in groups)
        recorder.logged["tokens_unique"].append(float(unique))
        recorder.logged["tokens_forwarded"].append(0.0)
        return out

    def counted_compute_loss(model, inputs, *args, **kwargs):
        recorder.logged["tokens_forwarded"][-1] += inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
        return compute_loss(model, inputs, *args, **kwargs)

    trainer._generate_and_score_completions = timed_generate
    trainer.compute_loss = counted_compute_loss


def trl_reward(completions, answer, **kwargs) -> list[float]:
    """The reverse_text rubric's reward in TRL's calling convention (conversational completions)."""
    parser = Parser()
    return [reversal_similarity(completion, target, parser) for completion, target in zip(completions, answer)]


def common(args, out: str) -> dict:
    return dict(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_steps=args.warmup + args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=args.prompts * args.num_generations,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_iterations=1,
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        gradient_checkpointing=False,
        seed=0,
    )


def run_trl(args, model_dir, tokenizer, rows, out) -> SplitRecorder:
    config = GRPOConfig(**common(args, out), steps_per_generation=1, use_vllm=False, shuffle_dataset=False,
                        log_completions=False, mask_truncated_completions=False)
    dataset = Dataset.from_list([{"prompt": row.prompt, "answer": row.answer} for row in rows])
    recorder = SplitRecorder()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=trl_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the table
    assert trainer.args.generation_batch_size == args.prompts * args.num_generations
    watch_trl(trainer, recorder, args.num_generations)
    trainer.train()
    return recorder


def run_ours(args, model_dir, tokenizer, environment, k, out, share_prompt_training="auto") -> SplitRecorder:
    config = RLConfig(**common(args, out), rollouts_per_step=args.prompts * args.num_generations,
                      max_seq_len=args.max_seq_len, max_off_policy_steps=k, micro_batching=args.micro_batching,
                      share_prompt_training=share_prompt_training)
    engine = build_engine(config, model_dir, tokenizer)
    recorder = SplitRecorder()
    trainer = RLTrainer(model_dir, config, processing_class=tokenizer, environment=environment, engine=engine,
                        callbacks=[recorder])
    trainer.train()
    engine.close()
    return recorder


NAMES = {
    "trl": "TRL GRPOTrainer (HF generate)",
    "k0": "verifiers_rl RLTrainer k=0",
    "k1": "verifiers_rl RLTrainer k=1",
    "k0_unshared": "verifiers_rl RLTrainer k=0, share_prompt_training off",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="tiny",
                        help="preset of the settings below (tiny: a random Llama; quickstart: SmolLM2, 4 x 4, 16 tokens)")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default=None)
    parser.add_argument("--hidden", type=int, default=None, help="tiny model only")
    parser.add_argument("--layers", type=int, default=None, help="tiny model only")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per optimizer step")
    parser.add_argument("--num_generations", type=int, default=None)
    parser.add_argument("--max_completion_length", type=int, default=None)
    parser.add_argument("--max_seq_len", type=int, default=None)
    parser.add_argument("--learning_rate", type=float, default=None)
    parser.add_argument("--micro_batching", choices=["padded", "packed", "auto"], default=None,
                        help="our trainer's micro-batches (TRL always pads): padded rows, packed rows of at most "
                        "4 x max_seq_len tokens, or auto (the cheaper per batch by the cost model)")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per trainer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each trainer's run")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch intra-op thread counts (torch.set_num_threads); every trainer runs at each")
    parser.add_argument("--trainers", nargs="+", default=list(NAMES), choices=list(NAMES))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for key, value in WORKLOADS[args.workload].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.quick:
        args.steps, args.warmup, args.threads = 4, 1, args.threads[:1]

    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    log(f"load average at start: {load()}")
    work = tempfile.mkdtemp(prefix="bench_vs_trl_")
    if args.model == "smollm2":
        model_dir = str(smollm2_dir())
    else:
        model_dir = os.path.join(work, "model")
        build_tiny_model(model_dir, hidden_size=args.hidden, num_layers=args.layers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def environment():
        return load_environment("reverse_text", tokenizer=tokenizer, max_new_tokens=args.max_completion_length,
                                max_seq_len=args.max_seq_len)

    # The prompts our generator draws, in its order (one batch = args.prompts rows), handed to TRL unshuffled.
    env = environment()
    order = AsyncGenerator(env, engine=None, rollouts_per_step=args.prompts * args.num_generations,
                           num_generations=args.num_generations, seed=0)
    rows = [env.dataset[i] for b in range(args.warmup + args.steps) for _, i in order._rows_of(b)]

    results = {}
    splits = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.trainers:
            log(f"[threads={threads}] [{name}] {args.warmup} warm-up + {args.steps} timed steps (load {load()}) ...")
            out = os.path.join(work, f"{name}_t{threads}")
            if name == "trl":
                recorder = run_trl(args, model_dir, tokenizer, rows, out)
            else:
                share = "off" if name.endswith("unshared") else "auto"
                recorder = run_ours(args, model_dir, tokenizer, environment(), int(name[1]), out, share)
            timed = recorder.intervals()[args.warmup :]
            results[threads, name] = (timed, recorder.rewards, recorder.cores(args.warmup))
            splits[threads, name] = recorder.split(args.warmup)
            log(f"[threads={threads}] [{name}] {sum(timed):.1f} s for {len(timed)} steps "
                f"({', '.join(f'{s:.2f}' for s in timed)}); load {load()}; "
                f"rewards {', '.join(f'{r:.3f}' for r in recorder.rewards)}")
    elapsed = time.perf_counter() - started
    log(f"load average at end: {load()}")

    model_name = "SmolLM2-135M-Instruct" if args.model == "smollm2" else f"random Llama hidden {args.hidden} x {args.layers} layers"
    print(
        f"\nreverse_text ({args.workload} workload), {model_name}, {args.prompts} prompts x "
        f"{args.num_generations} generations per step (ours: {args.micro_batching} micro-batches), max_completion_length "
        f"{args.max_completion_length}, temperature 1.0, loss grpo, beta 0, lr {args.learning_rate:g}, "
        f"{args.steps} timed steps after {args.warmup} warm-up, CPU ({os.cpu_count()} cores). "
        f"Total {elapsed:.0f} s; load average at end {load()}.\n"
    )
    print("| torch threads | trainer | steps | wall s | steps/s | ratio vs TRL (same threads) | ratio vs best TRL | "
          "median s/step | mean reward (last 3) | cores busy |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rates = {key: len(timed) / sum(timed) for key, (timed, _, _) in results.items()}
    trl_rates = [rate for (threads, name), rate in rates.items() if name == "trl"]
    best_trl = max(trl_rates) if trl_rates else None
    for (threads, name), (timed, rewards, cores) in results.items():
        rate = rates[threads, name]
        same = rates.get((threads, "trl"))
        reward = statistics.mean(rewards[-3:]) if rewards else float("nan")
        print(
            f"| {threads} | {NAMES[name]} | {len(timed)} | {sum(timed):.1f} | {rate:.3f} | "
            f"{f'{rate / same:.2f}x' if same else 'n/a'} | {f'{rate / best_trl:.2f}x' if best_trl else 'n/a'} | "
            f"{statistics.median(timed):.2f} | {reward:.3f} | {cores:.2f} |"
        )
    print("\n| torch threads | trainer | median s/step | gen s | train s | tokens forwarded/step | unique tokens/step "
          "| forwarded / unique | steps packed (auto) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for (threads, name), (timed, _, _) in results.items():
        split = splits[threads, name]
        packed = "n/a" if math.isnan(split["packed"]) else f"{split['packed']:.0%}"
        print(f"| {threads} | {NAMES[name]} | {statistics.median(timed):.2f} | {split['gen']:.2f} | {split['train']:.2f} | "
              f"{split['forwarded']:.0f} | {split['unique']:.0f} | {split['forwarded'] / split['unique']:.2f}x | "
              f"{packed} |")


if __name__ == "__main__":
    main()
