"""Our RLTrainer (k = 0 and k = 1) against TRL's own GRPOTrainer, at equal work: wall time between optimizer steps.

At equal work (the ``equal16`` and ``equal128`` workloads, the default): the learning rate is 0, so both policies
stay the starting model and sample the same length distribution for the whole run; the tables give the wall time
between optimizer steps on both sides (``on_step_end`` to ``on_step_end``: generation, scoring, training, the
optimizer step and our weight load all inside), completion tokens per second, the length distributions side by side
(with their two-sample Kolmogorov-Smirnov distance), and the phases (generation, training, weight sync). The
``quickstart`` workload is the learning run (learning rate 2e-5): its steps do unequal work once the policies learn
different answer lengths, so it is reported as reward after N steps and wall time, not as a speed ratio.

What it measures: these trainers, run one after the other in this one process, on the same problem:

- ``trl``: ``trl.GRPOTrainer`` with ``use_vllm=False`` (its in-process transformers ``generate`` on the policy
  itself, synchronous: generate, score, then train);
- ``verifiers_rl k=0``: ``RLTrainer`` from the ``reverse_text`` environment through the embedded HF engine (its own
  copy of the weights, refreshed after every step), synchronous;
- ``verifiers_rl k=1``: the same, generating one step ahead on the generator thread (the weight load and the
  post-sync probe run under the generator's batch lock, between two batches);
- ``verifiers_rl k=0 unshared``: k = 0 with ``share_prompt_training="off"`` (every completion's row carries its own copy of
  the prompt, as TRL's do); the other two run with the default ``share_prompt_training="auto"``.

Workloads (``--workloads``, several in one run): ``equal16`` / ``equal128``: SmolLM2-135M-Instruct, 4 prompts x 4
samples, 16 / 128 new tokens, learning rate 0, 2 torch threads, our micro-batching ``auto``; ``tiny`` is described
below; ``quickstart`` is the README's quickstart run:
SmolLM2-135M-Instruct (``verifiers_rl.core.models.smollm2_dir()``), 4 prompts x 4 samples, 16 new tokens,
``max_seq_len`` 128, learning rate 2e-5, 2 torch threads, and our micro-batching left at its default ``auto``
(the quickstart's: on CPU it picks, per batch, one packed row holding every group's shared prompt once and its
completions when the cost model finds that cheaper than padded shared rows, ~1.2x the unique tokens between
groups of different prompt lengths), the rest as below. Any of its settings can be overridden by the flags.

Same for all of them: the model (``tiny``: a random Llama from ``verifiers_rl.core.models.build_tiny_model``, hidden
256, 4 layers, loaded from the same folder), the prompts (the ``reverse_text`` dataset, system prompt included, in the order our
generator draws them; TRL gets them as a dataset of chat prompts with ``shuffle_dataset=False``), the reward
(``reversal_similarity``, partial credit by edit distance), the batch (4 prompts x 8 generations = 32 rollouts per
optimizer step, trained as one micro-batch of 32 rows: TRL ``per_device_train_batch_size=32``,
``gradient_accumulation_steps=1``, ``steps_per_generation=1``; ours ``rollouts_per_step=32``,
``per_device_train_batch_size=32``), ``max_completion_length`` (48), temperature 1.0 with the full softmax (top_k 0,
top_p 1), ``loss_type="grpo"``, ``scale_rewards="group"``, ``num_iterations=1``, ``beta=0`` (no reference model),
epsilon 0.2, AdamW (``adamw_torch_fused``, transformers' default) at a constant learning rate of 1e-3, fp32, no
gradient checkpointing, and the torch thread count (every trainer runs at each count in ``--threads``, default 1 and
2; ``torch.set_num_threads`` is process-wide).
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

    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py          # equal16 and equal128, trl k0 k1
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py --workloads tiny --threads 2 --trainers trl k0 k1
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py --workloads quickstart --trainers trl k1   # the learning run

Timings depend on what else runs on the machine: every progress line (stderr) carries ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
from collections import defaultdict
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

os.environ.setdefault("ACCELERATE_USE_CPU", "true")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from verifiers_rl.config.rl_config import RLConfig  # noqa: E402
from verifiers_rl.envs import load_environment  # noqa: E402
from verifiers_rl.envs.builtin.reverse_text import reversal_similarity  # noqa: E402
from verifiers_rl.envs.parsers import Parser  # noqa: E402
from verifiers_rl.rollouts.generator import AsyncGenerator  # noqa: E402
from verifiers_rl.inference.factory import build_engine  # noqa: E402
from verifiers_rl.core.models import build_tiny_model, smollm2_dir  # noqa: E402
from verifiers_rl.training.prefix import unique_tokens  # noqa: E402
from verifiers_rl.training.trainer import RLTrainer  # noqa: E402
from steps import StepRecorder, grpo_settings, watch_ours  # noqa: E402  (benchmarks/steps.py)
from timing import at_least, fill_in, load, log, once_each, quiet  # noqa: E402  (timing.py)


WORKLOADS = {
    "tiny": dict(model="tiny", hidden=256, layers=4, prompts=4, num_generations=8, max_completion_length=48,
                 max_seq_len=160, learning_rate=1e-3, threads=[1, 2], micro_batching="padded"),
    "quickstart": dict(model="smollm2", prompts=4, num_generations=4, max_completion_length=16, max_seq_len=128,
                       learning_rate=2e-5, threads=[2], micro_batching="auto"),
    "equal16": dict(model="smollm2", prompts=4, num_generations=4, max_completion_length=16, max_seq_len=128,
                    learning_rate=0.0, threads=[2], micro_batching="auto"),
    "equal128": dict(model="smollm2", prompts=4, num_generations=4, max_completion_length=128, max_seq_len=256,
                     learning_rate=0.0, threads=[2], micro_batching="auto"),
}
LOGGED = ("generation_time", "wait_time", "train_time", "weight_sync_time", "step_time", "tokens_forwarded",
          "tokens_unique", "packed_micro_batches")


class SplitRecorder(StepRecorder):
    """Also keeps, per step, our trainer's logged timings and token counts, or TRL's generation time and the tokens
    its loss forwards (filled in by ``watch_trl``)."""

    def __init__(self):
        super().__init__()
        self.logged: dict[str, list[float]] = defaultdict(list)
        self.lengths: list[list[int]] = []  # completion lengths (tokens) of each step's batch
        self.trainer = None  # ours: read the trained batch's completion lengths at the end of each step

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if self.trainer is not None:
            self.lengths.append([len(r.completion_ids) for r in self.trainer.steps.latest_rollouts])

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=logs, **kwargs)
        for key in LOGGED:
            if logs and key in logs:
                self.logged[key].append(float(logs[key]))

    def split(self, skip: int) -> dict[str, float]:
        """Medians over the steps after ``skip``: generation, training, forwarded and unique tokens per step."""
        logged = {key: values[skip:] for key, values in self.logged.items()}
        if "train_time" in logged:  # ours: the step's logged parts
            train, sync, wait = logged["train_time"], logged["weight_sync_time"], logged["wait_time"]
        else:  # TRL: the step interval minus its generation (which it waits for), no weight sync
            train = [step - gen for step, gen in zip(self.intervals()[skip:], logged["generation_time"])]
            sync, wait = [], logged["generation_time"]
        values = {"gen": logged["generation_time"], "train": train, "sync": sync, "wait": wait,
                  "forwarded": logged["tokens_forwarded"], "unique": logged["tokens_unique"]}
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
        recorder.lengths.append([int(mask.sum()) for mask in out["completion_mask"]])
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
    return grpo_settings(out, args.warmup + args.steps, args.learning_rate, args.prompts * args.num_generations,
                         args.num_generations, args.max_completion_length)


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
    try:  # a failed run must not leave the engine's decode thread behind the next side's
        trainer = RLTrainer(model_dir, config, processing_class=tokenizer, environment=environment, engine=engine)
        watch_ours(trainer, recorder)
        trainer.train()
    finally:
        engine.close()
    return recorder


NAMES = {
    "trl": "TRL GRPOTrainer (HF generate)",
    "k0": "verifiers_rl RLTrainer k=0",
    "k1": "verifiers_rl RLTrainer k=1",
    "k0_unshared": "verifiers_rl RLTrainer k=0, share_prompt_training off",
}


def ks_distance(a: list[int], b: list[int]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    if not a or not b:
        return float("nan")
    points = sorted(set(a) | set(b))
    cdf = lambda xs, x: sum(v <= x for v in xs) / len(xs)  # noqa: E731
    return max(abs(cdf(a, x) - cdf(b, x)) for x in points)


def quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(int(q * len(ordered)), len(ordered) - 1)]) if ordered else float("nan")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["equal16", "equal128"],
                        help="equal16 / equal128: SmolLM2, 4 x 4, 16 / 128 new tokens, learning rate 0 (equal work); "
                        "quickstart: the learning run (lr 2e-5); tiny: a random Llama")
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
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per trainer (8; --quick 4)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps at the start of each trainer's run (2; --quick 1)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch intra-op thread counts (torch.set_num_threads); every trainer runs at each")
    parser.add_argument("--trainers", nargs="+", default=["trl", "k0", "k1"], choices=list(NAMES))
    parser.add_argument("--quick", action="store_true",
                        help="4 timed steps after 1 warm-up, one thread setting (unless the flags say otherwise)")
    args = parser.parse_args(argv)
    # Checked before any model is built: --steps 0 ran every trainer, then failed on the mean of no step.
    at_least(parser, args, 1, "hidden", "layers", "prompts", "max_completion_length", "max_seq_len", "steps",
             "threads")
    at_least(parser, args, 2, "num_generations")
    once_each(parser, args, "workloads", "trainers", "threads")
    at_least(parser, args, 0, "warmup")
    at_least(parser, args, 0, "learning_rate", why="torch's optimizer refuses it (0: equal work)")
    real = [workload for workload in args.workloads if (args.model or WORKLOADS[workload]["model"]) == "smollm2"]
    if real and (args.hidden, args.layers) != (None, None):  # they were dropped without a word
        parser.error(f"--hidden/--layers shape the tiny model only: the {real[0]} workload runs SmolLM2-135M (--model "
                     "tiny runs every workload on the tiny model)")
    return args


def workload_args(base: argparse.Namespace, workload: str) -> argparse.Namespace:
    """The command's flags, each one not given taken from the workload (and ``--quick``'s sizes)."""
    args = argparse.Namespace(**vars(base))
    threads = args.threads
    quick = dict(steps=4, warmup=1) if args.quick else dict(steps=8, warmup=2)
    fill_in(args, {**WORKLOADS[workload], **quick})
    if args.model == "tiny":  # a SmolLM2 workload on the tiny model (--model tiny): the tiny workload's shape
        fill_in(args, {key: WORKLOADS["tiny"][key] for key in ("hidden", "layers")})
    if args.quick and threads is None:  # the workload's first thread count only
        args.threads = args.threads[:1]
    return args


def run_workload(base, workload: str) -> None:
    args = workload_args(base, workload)
    started = time.perf_counter()
    log(f"[{workload}] load average at start: {load()}")
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

    recorders = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.trainers:
            log(f"[{workload}] [threads={threads}] [{name}] {args.warmup} warm-up + {args.steps} timed steps "
                f"(load {load()}) ...")
            out = os.path.join(work, f"{name}_t{threads}")
            with contextlib.redirect_stdout(sys.stderr):  # our trainer's step lines; the tables go to stdout
                if name == "trl":
                    recorder = run_trl(args, model_dir, tokenizer, rows, out)
                else:
                    share = "off" if name.endswith("unshared") else "auto"
                    recorder = run_ours(args, model_dir, tokenizer, environment(), int(name[1]), out, share)
            recorders[threads, name] = recorder
            timed = recorder.intervals()[args.warmup :]
            log(f"[{workload}] [threads={threads}] [{name}] {sum(timed):.1f} s for {len(timed)} steps "
                f"({', '.join(f'{s:.2f}' for s in timed)}); load {load()}; "
                f"rewards {', '.join(f'{r:.3f}' for r in recorder.rewards)}")
    elapsed = time.perf_counter() - started
    model_name = "SmolLM2-135M-Instruct" if args.model == "smollm2" else f"random Llama hidden {args.hidden} x {args.layers} layers"
    equal = args.learning_rate == 0
    print(
        f"\n**{workload}** ({'equal work: learning rate 0' if equal else f'learning run: lr {args.learning_rate:g}'}): "
        f"reverse_text, {model_name}, {args.prompts} prompts x {args.num_generations} generations per step (ours: "
        f"{args.micro_batching} micro-batches), max_completion_length {args.max_completion_length}, temperature 1.0, "
        f"loss grpo, beta 0, {args.steps} timed steps after {args.warmup} warm-up, CPU ({os.cpu_count()} cores). "
        f"Total {elapsed:.0f} s; load average at end {load()}.\n"
    )
    if equal:
        print_equal_work(args, recorders)
    else:
        print_learning(args, recorders)


def print_equal_work(args, recorders) -> None:
    skip = args.warmup
    print("| threads | trainer | s/step (median) | s/step (mean) | ratio vs TRL | completion tokens/step | "
          "completion tokens/s | ratio vs TRL (tokens/s) | gen s | wait s | train s | sync s | cores busy |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for (threads, name), recorder in recorders.items():
        timed = recorder.intervals()[skip:]
        tokens = [sum(lengths) for lengths in recorder.lengths[skip:]]
        rows[threads, name] = (statistics.mean(timed), sum(tokens) / sum(timed))
    for (threads, name), recorder in recorders.items():
        timed = recorder.intervals()[skip:]
        step, rate = rows[threads, name]
        trl = rows.get((threads, "trl"))
        split = recorder.split(skip)
        tokens = statistics.mean(sum(lengths) for lengths in recorder.lengths[skip:])
        fmt = lambda v: "n/a" if math.isnan(v) else f"{v:.2f}"  # noqa: E731
        print(f"| {threads} | {NAMES[name]} | {statistics.median(timed):.2f} | {step:.2f} | "
              f"{f'{trl[0] / step:.2f}x' if trl else 'n/a'} | {tokens:.0f} | {rate:.1f} | "
              f"{f'{rate / trl[1]:.2f}x' if trl else 'n/a'} | {fmt(split['gen'])} | {fmt(split['wait'])} | "
              f"{fmt(split['train'])} | {fmt(split['sync'])} | {recorder.cores(skip):.2f} |")
    print("\nCompletion lengths over the timed steps (tokens; every rollout of every timed batch):\n")
    print("| threads | trainer | rollouts | mean | std | p10 | median | p90 | at the limit | KS distance to TRL |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (threads, name), recorder in recorders.items():
        lengths = [n for step in recorder.lengths[skip:] for n in step]
        trl = recorders.get((threads, "trl"))
        reference = [n for step in trl.lengths[skip:] for n in step] if trl is not None else []
        limit = sum(n >= args.max_completion_length for n in lengths) / max(len(lengths), 1)
        print(f"| {threads} | {NAMES[name]} | {len(lengths)} | {statistics.mean(lengths):.1f} | "
              f"{statistics.pstdev(lengths):.1f} | {quantile(lengths, 0.1):.0f} | {quantile(lengths, 0.5):.0f} | "
              f"{quantile(lengths, 0.9):.0f} | {limit:.0%} | "
              f"{'-' if name == 'trl' else f'{ks_distance(lengths, reference):.2f}'} |")


def print_learning(args, recorders) -> None:
    print("| threads | trainer | steps | wall s | mean reward (first 3) | mean reward (last 3) | mean completion tokens "
          "(last 3) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for (threads, name), recorder in recorders.items():
        wall = sum(recorder.intervals())
        first, last = recorder.rewards[:3], recorder.rewards[-3:]
        lengths = [statistics.mean(step) for step in recorder.lengths[-3:]]
        print(f"| {threads} | {NAMES[name]} | {len(recorder.ends)} | {wall:.1f} | {statistics.mean(first):.3f} | "
              f"{statistics.mean(last):.3f} | {statistics.mean(lengths):.1f} |")


def main() -> None:
    args = parse_args()
    quiet()
    for workload in args.workloads:
        run_workload(args, workload)


if __name__ == "__main__":
    main()
