"""Wall time per optimizer step with asynchronous generation (k = 1) against synchronous generation (k = 0).

What it measures: ``RLTrainer`` training live from the ``reverse_text`` environment through the embedded HF
engine on the main process (as ``examples/train.py`` does), with ``max_off_policy_steps`` k = 0 (generate batch b,
then train on it) and k = 1 (the generator thread produces batch b + 1 while the trainer trains on batch b). The
model is a random Llama from ``verifiers_rl.core.models.build_tiny_model`` (hidden 256, 4 layers, ~400-token
vocabulary by default), sized so that generating one batch and training on one batch take similar time; the
script first measures both phases alone and prints them, so the reader can see how balanced they are:

- G, gen only: one batch of rollouts (``rollouts_per_step`` = 32 = 4 prompts x 8, up to 48 new tokens) generated
  by the engine through the environment, nothing else running (median of a few batches after a warm-up batch);
- T, train only: one ``RLTrainer`` optimizer step on a batch generated beforehand (replayed), without an engine.

Step time is the interval between consecutive ``on_step_end`` callbacks (a full period: waiting for the batch,
forward + backward + optimizer step, weight load into the engine and its post-sync probe); the first
``--warmup`` steps of every run are skipped. Perfect overlap gives k=1 / k=0 = max(G, T) / (G + T), 0.5 when G = T.

With n >= 2 threads, G is measured before any training at that count, so only the engine's worker thread has an
OpenMP thread team. In the live runs the trainer's thread has one too, and libgomp, once it manages more threads
than there are cores, stops spin-waiting between parallel regions: generation (many tiny ops) then runs ~1.7x
slower than G (0.70 s against 0.40 s per batch on 2 cores), even at k = 0 where the two never run at once.

Runs (``--variants``):

- ``k0``, ``k1``: the library as it is (``RLTrainer.sync_weights`` holds the generator's batch lock through the
  weight load and the post-sync probe, so the probe never waits behind the next batch's generation);
- ``k1_no_probe`` (not run by default): k = 1 with ``weight_sync_probe_tokens=0``, to see what the post-sync probe
  (one forward of the trainer's model and one of the engine's) costs per step.

Every run is repeated for each torch intra-op thread count in ``--threads`` (``torch.set_num_threads``, which is
process-wide: the training thread and the engine's worker thread share it). With n threads each phase alone may
use n cores; with k = 1 both phases run at once, so on 2 cores n = 2 puts 4 OpenMP threads on 2 cores, while
n = 1 gives each phase its own core (torch releases the GIL inside its ops, so the two threads do overlap).

Run (about 1 minute on 2 idle cores, far longer on a busy machine; ``--quick``: fewer steps, one thread
setting, about 30 s):

    PYTHONPATH=. .venv/bin/python benchmarks/async_generation.py
    PYTHONPATH=. .venv/bin/python benchmarks/async_generation.py --quick   # its sizes fill in the flags not given
    PYTHONPATH=. .venv/bin/python benchmarks/async_generation.py --threads 1 --rounds 2 --variants k0 k1 k1_no_probe

Timings depend on what else runs on the machine: every progress line (stderr) carries ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

os.environ.setdefault("ACCELERATE_USE_CPU", "true")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from verifiers_rl.config.rl_config import RLConfig  # noqa: E402
from verifiers_rl.envs import load_environment  # noqa: E402
from verifiers_rl.rollouts.generator import AsyncGenerator  # noqa: E402
from verifiers_rl.inference.factory import build_engine  # noqa: E402
from verifiers_rl.core.models import build_tiny_model  # noqa: E402
from verifiers_rl.training.trainer import RLTrainer  # noqa: E402
from steps import StepRecorder, run_settings  # noqa: E402  (benchmarks/steps.py)
from timing import at_least, fill_in, load, log, once_each, quiet_start  # noqa: E402  (benchmarks/timing.py)

DEFAULTS = dict(steps=8, warmup=2, phase_batches=3, threads=[1, 2])
QUICK = dict(steps=4, warmup=1, phase_batches=2, threads=[1])


class ListSource:
    """A rollout source over batches already in memory (train-only timing)."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def batch(self, index):
        return self.batches[index % len(self.batches)]


def make_config(args, k: int, steps: int, out: str, **overrides) -> RLConfig:
    options = dict(
        run_settings(out, steps, 1e-4),
        rollouts_per_step=args.rollouts,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.micro_batch or args.rollouts,
        max_completion_length=args.max_completion_length,
        max_seq_len=args.max_seq_len,
        temperature=1.0,
        max_off_policy_steps=k,
        loss_type="grpo",
        micro_batching="padded",
        gradient_checkpointing=False,
        seed=0,
        generation_timeout_s=600.0,
    )
    options.update(overrides)
    return RLConfig(**options)


# name -> (k, RLConfig overrides)
VARIANTS = {
    "k0": (0, {}),
    "k1": (1, {}),
    "k1_no_probe": (1, {"weight_sync_probe_tokens": 0}),
}
DESCRIPTIONS = {
    "k0": "k=0 (synchronous)",
    "k1": "k=1 (one step ahead)",
    "k1_no_probe": "k=1, weight_sync_probe_tokens=0 (probe off)",
}


def make_environment(args, tokenizer):
    return load_environment(
        "reverse_text", tokenizer=tokenizer, max_new_tokens=args.max_completion_length, max_seq_len=args.max_seq_len
    )


def median(values):
    return statistics.median(values) if values else float("nan")


def measure_phases(args, model_dir: str, tokenizer, out: str) -> tuple[float, float, float]:
    """Generation alone (median seconds per batch), training alone (median seconds per step), mean completion length."""
    config = make_config(args, 0, args.warmup + args.steps, out)
    engine = build_engine(config, model_dir, tokenizer)
    generator = AsyncGenerator(
        make_environment(args, tokenizer), engine, args.rollouts, args.num_generations, max_off_policy_steps=0
    )
    loop = asyncio.new_event_loop()
    batches, gen_times = [], []
    for index in range(args.phase_batches + 1):
        start = time.perf_counter()
        batches.append(loop.run_until_complete(generator._generate(index)))
        gen_times.append(time.perf_counter() - start)
    loop.close()
    engine.close()
    lengths = [len(r.completion_ids) for batch in batches for r in batch]
    timer = StepRecorder()
    config = make_config(args, 0, args.warmup + args.steps, out)
    trainer = RLTrainer(
        model_dir, config, processing_class=tokenizer, rollout_source=ListSource(batches), callbacks=[timer]
    )
    trainer.train()
    train_times = timer.intervals()[args.warmup :]
    return median(gen_times[1:]), median(train_times), statistics.mean(lengths)


def run_live(args, model_dir: str, tokenizer, variant: str, out: str) -> tuple[list[float], float]:
    k, overrides = VARIANTS[variant]
    config = make_config(args, k, args.warmup + args.steps, out, **overrides)
    engine = build_engine(config, model_dir, tokenizer)
    timer = StepRecorder()
    trainer = RLTrainer(
        model_dir,
        config,
        processing_class=tokenizer,
        environment=make_environment(args, tokenizer),
        engine=engine,
        callbacks=[timer],
    )
    trainer.train()
    engine.close()
    return timer.intervals()[args.warmup :], timer.cores(args.warmup)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per optimizer step")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--micro_batch", type=int, default=0, help="rows per micro-batch (default: the whole batch)")
    parser.add_argument("--max_completion_length", type=int, default=48)
    parser.add_argument("--max_seq_len", type=int, default=160)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (8; --quick 4)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps at the start of each run (2; --quick 1)")
    parser.add_argument("--phase_batches", type=int, default=None, help="batches timed for gen only (3; --quick 2)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch intra-op thread counts to try (1 2; --quick 1)")
    parser.add_argument("--variants", nargs="+", default=["k0", "k1"], choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variants this many times, alternating (steps pooled; helps on a busy machine)")
    parser.add_argument("--quick", action="store_true",
                        help="4 timed steps after 1 warm-up, 2 gen-only batches, 1 thread (the flags given stand)")
    args = parser.parse_args(argv)
    fill_in(args, QUICK if args.quick else DEFAULTS)
    # Checked before the model is built: --steps 0 trained its runs, then failed dividing by no time.
    at_least(parser, args, 1, "hidden", "layers", "rollouts", "max_completion_length", "max_seq_len", "steps",
             "phase_batches", "threads", "rounds")
    at_least(parser, args, 2, "num_generations")
    once_each(parser, args, "threads", "variants")
    at_least(parser, args, 0, "warmup", "micro_batch")
    if args.rollouts % args.num_generations:
        parser.error(f"--rollouts ({args.rollouts}) must be a multiple of --num_generations ({args.num_generations})")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    started = quiet_start()
    work = tempfile.mkdtemp(prefix="bench_async_")
    model_dir = os.path.join(work, "model")
    build_tiny_model(model_dir, hidden_size=args.hidden, num_layers=args.layers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    phases, runs, used = {}, {}, {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        log(f"[threads={threads}] gen only / train only (load {load()}) ...")
        phases[threads] = measure_phases(args, model_dir, tokenizer, os.path.join(work, f"phases_t{threads}"))
        gen_s, train_s, mean_len = phases[threads]
        log(f"[threads={threads}] gen {gen_s:.3f} s/batch, train {train_s:.3f} s/step "
            f"(mean completion {mean_len:.1f} tokens)")
        for round_ in range(args.rounds):
            for variant in args.variants if round_ % 2 == 0 else args.variants[::-1]:
                log(f"[threads={threads}] {variant}: {args.warmup} warm-up + {args.steps} timed steps "
                    f"(load {load()}) ...")
                out = os.path.join(work, f"{variant}_t{threads}_{round_}")
                steps, cores = run_live(args, model_dir, tokenizer, variant, out)
                runs.setdefault((threads, variant), []).extend(steps)
                used.setdefault((threads, variant), []).append(cores)
                log(f"[threads={threads}] {variant}: median {median(steps):.3f} s/step "
                    f"({', '.join(f'{s:.2f}' for s in steps)}; {cores:.2f} cores busy; load {load()})")
    elapsed = time.perf_counter() - started
    log(f"load average at end: {load()}")

    print(
        f"\nRLTrainer on reverse_text, embedded HF engine, random Llama hidden {args.hidden} x {args.layers} layers, "
        f"{args.rollouts} rollouts/step ({args.rollouts // args.num_generations} prompts x {args.num_generations}, "
        f"one micro-batch of {args.micro_batch or args.rollouts} rows), max_completion_length "
        f"{args.max_completion_length}, {args.steps} timed steps after {args.warmup} warm-up per run, "
        f"{args.rounds} round(s), CPU ({os.cpu_count()} "
        f"cores). Total {elapsed:.0f} s; load average at end {load()}.\n"
    )
    print("Each phase alone (G: one batch generated by the engine, T: one trainer step on a ready batch):\n")
    print("| torch threads | G gen only (s/batch) | T train only (s/step) | mean completion tokens "
          "| ideal k=1/k=0 = max(G,T)/(G+T) |")
    print("|---:|---:|---:|---:|---:|")
    for threads, (gen_s, train_s, mean_len) in phases.items():
        ideal = max(gen_s, train_s) / (gen_s + train_s)
        print(f"| {threads} | {gen_s:.3f} | {train_s:.3f} | {mean_len:.1f} | {ideal:.2f} |")
    print("\nLive training, wall time per optimizer step:\n")
    print("| torch threads | run | median s/step | mean s/step | min | max | median / k=0 median (same threads) "
          "| cores busy (process CPU s / wall s) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for (threads, variant), steps in runs.items():
        base = runs.get((threads, "k0"))
        ratio = f"{median(steps) / median(base):.2f}" if base else "n/a"
        print(
            f"| {threads} | {DESCRIPTIONS[variant]} | {median(steps):.3f} | {statistics.mean(steps):.3f} | "
            f"{min(steps):.3f} | {max(steps):.3f} | {ratio} | {statistics.mean(used[threads, variant]):.2f} |"
        )
    k0 = [median(steps) for (threads, variant), steps in runs.items() if variant == "k0"]
    k1 = {
        variant: min(median(steps) for (_, v), steps in runs.items() if v == variant)
        for variant in args.variants
        if variant != "k0"
    }
    if k0 and k1:
        best = min(k0)
        print("\nBest over thread settings, against the best k=0 (" + f"{best:.3f} s/step): "
              + "; ".join(f"{DESCRIPTIONS[v]}: {m:.3f} s/step = {m / best:.2f}x" for v, m in k1.items()))


if __name__ == "__main__":
    main()
