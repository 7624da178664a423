"""Soak: a long run must not grow. Two runs of the tiny model, recording after every optimizer step:

- ``live``: 300 steps at k = 1 (generation one step ahead on the generator thread, weight sync and probe after every
  step, a checkpoint every 100 steps with the newest 2 kept, the rollouts appended to a file);
- ``replay``: 1,000 steps replaying a rollouts file (a checkpoint every 250 steps with the newest 2 kept).

Targets, from the first 10% of a run to its end: resident memory (RSS) grows < 50 MiB; threads, open files and
child processes the same; the median step time (the interval between optimizer steps) of the last 10% of steps
within 10% of the median of the first 10% (after ``--warmup`` steps).

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py                       # both; ~8-12 min on 2 idle cores
    PYTHONPATH=. .venv/bin/python benchmarks/soak.py --mode live --steps 100   # a quicker look

Prints a table per run (the curve, every 10% of the run) and a verdict line per target (exit status 1 if one fails).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

import psutil  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks.steps import run_settings  # noqa: E402
from benchmarks.timing import at_least, load, log  # noqa: E402


STEPS = {"live": 300, "replay": 1000}  # each mode's default --steps
MODES = {"both": ["live", "replay"], "live": ["live"], "replay": ["replay"]}


class Probe(TrainerCallback):
    """RSS, threads, open files, child processes and the time of every optimizer step."""

    def __init__(self, name: str):
        self.name = name
        self.process = psutil.Process()
        self.rows: list[Row] = []
        self.last = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        rss = self.process.memory_info().rss / 2**20
        self.rows.append(Row(state.global_step, rss, self.process.num_threads(), self.process.num_fds(),
                             len(self.process.children(recursive=True)), now - self.last))
        self.last = now
        if state.global_step % 100 == 0:
            log(f"[soak {self.name}] step {state.global_step}: rss {rss:.0f} MiB, {threading.active_count()} python "
                f"threads, load {load()}")


@dataclass
class Row:
    step: int
    rss: float  # MiB
    threads: int
    open_files: int
    children: int
    seconds: float  # since the previous optimizer step


def config(work: str, steps: int, **extra):
    from verifiers_rl.config.rl_config import RLConfig

    values = dict(
        run_settings(os.path.join(work, "out"), steps, 1e-3), rollouts_per_step=16, num_generations=4,
        max_completion_length=8, max_seq_len=128, gradient_checkpointing=False, save_strategy="steps",
        save_total_limit=2, print_samples_every=0, seed=0,
    )
    values.update(extra)
    return RLConfig(**values)


def run(mode: str, steps: int) -> list[Row]:
    from transformers import AutoTokenizer

    from verifiers_rl.envs import load_environment
    from verifiers_rl.inference.factory import build_engine
    from verifiers_rl.core.models import resolve_model
    from verifiers_rl.core.rollout import write_rollouts
    from verifiers_rl.rollouts.synthetic import random_rollouts
    from verifiers_rl.training.trainer import RLTrainer

    model = resolve_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model)
    work = tempfile.mkdtemp(prefix=f"verifiers_rl-soak-{mode}-")
    probe = Probe(mode)
    engine = None
    if mode == "live":
        args = config(work, steps, max_off_policy_steps=1, save_steps=100,
                      save_rollouts_path=os.path.join(work, "rollouts.jsonl"))
        environment = load_environment("reverse_text", tokenizer=tokenizer, num_examples=2000)
        engine = build_engine(args, model, tokenizer)
        trainer = RLTrainer(model, args, processing_class=tokenizer, environment=environment, engine=engine,
                            callbacks=[probe])
    else:  # 40 batches of 16, replayed round and round
        path = os.path.join(work, "replay.jsonl")
        write_rollouts(path, random_rollouts(160, 4, vocab_size=390, seed=0, completion_len=(4, 40)))
        trainer = RLTrainer(model, config(work, steps, rollouts_path=path, save_steps=250), processing_class=tokenizer,
                            callbacks=[probe])
    started = time.perf_counter()
    log(f"[soak {mode}] {steps} steps of the tiny model in {work} (load {load()})")
    trainer.train()
    if engine is not None:
        engine.close()
    log(f"[soak {mode}] done in {time.perf_counter() - started:.0f} s (load {load()})")
    return probe.rows


def tenth_of(steps: int) -> int:
    """The steps in each window of step time: a tenth of the run, at least one."""
    return max(steps // 10, 1)


def windows(steps: int, warmup: int) -> tuple[slice, slice]:
    """The rows of the first window (a tenth of the run after ``warmup``) and of the last tenth; ValueError when the
    two would overlap, as a verdict comparing a window with itself says nothing."""
    tenth = tenth_of(steps)
    if warmup + 2 * tenth > steps:
        raise ValueError(f"the first window of step time ({tenth} steps after the warm-up) and the last tenth of the "
                         f"run ({tenth} steps) would overlap in {steps} steps")
    return slice(warmup, warmup + tenth), slice(steps - tenth, steps)


def report(mode: str, rows: list[Row], warmup: int) -> bool:
    """The curve (every 10% of the run) and the verdicts; True when every target holds."""
    steps = len(rows)
    tenth = tenth_of(steps)
    early_window, late_window = windows(steps, warmup)
    base = rows[max(warmup, tenth) - 1]
    print(f"\n{mode}: {steps} steps, tiny model, 16 rollouts per step; load at the end {load()}\n")
    print("| step | RSS (MiB) | RSS - base (MiB) | threads | open files | child processes | median step s (last 10%) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows[tenth - 1::tenth]:
        window = [r.seconds for r in rows[max(row.step - tenth, 0):row.step]]
        print(f"| {row.step} | {row.rss:.1f} | {row.rss - base.rss:+.1f} | {row.threads} | {row.open_files} | "
              f"{row.children} | {statistics.median(window):.3f} |")
    last = rows[-1]
    first = rows[early_window]
    early = statistics.median(r.seconds for r in first)
    late = statistics.median(r.seconds for r in rows[late_window])
    checks = [
        (f"RSS growth step {base.step} -> {last.step}: {last.rss - base.rss:+.1f} MiB (target < 50)",
         last.rss - base.rss < 50),
        (f"threads {base.threads} -> {last.threads}, open files {base.open_files} -> {last.open_files}, child "
         f"processes {base.children} -> {last.children} (target: constant)",
         (last.threads, last.open_files, last.children) == (base.threads, base.open_files, base.children)),
        (f"median step time {early:.3f} s (steps {first[0].step}-{first[-1].step}) -> {late:.3f} s (last {tenth}): "
         f"{late / early:.2f}x (target within 10%)", abs(late / early - 1) <= 0.10),
    ]
    print()
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'} ({mode}): {text}")
    return all(ok for _, ok in checks)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=list(MODES), default="both")
    parser.add_argument("--steps", type=int, default=None, help="default: 300 live, 1000 replay")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the first window's step time")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    at_least(parser, args, 0, "warmup")
    at_least(parser, args, 1, "steps", "threads")
    # Checked before the run, for each mode's steps: report() would find its windows overlap once the run is done.
    for mode in MODES[args.mode]:
        steps = STEPS[mode] if args.steps is None else args.steps
        try:
            windows(steps, args.warmup)
        except ValueError as error:
            given = "--steps" if args.steps is not None else f"the {mode} run's default --steps"
            parser.error(f"{given} ({steps}) must be >= --warmup ({args.warmup}) + 2 x {tenth_of(steps)}: {error}; "
                         "raise --steps or lower --warmup")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    results = {mode: run(mode, STEPS[mode] if args.steps is None else args.steps) for mode in MODES[args.mode]}
    return 0 if all([report(mode, rows, args.warmup) for mode, rows in results.items()]) else 1


if __name__ == "__main__":
    sys.exit(main())
