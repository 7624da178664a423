"""Soak: a long live run must not grow. 300 steps of the tiny model at k = 1 (generation one step ahead on the
generator thread, weight sync and probe after every step, a checkpoint every 100 steps with the newest 2 kept, the
rollouts appended to a file), recording after every optimizer step:

- resident memory (RSS) of the process; target: RSS after step 300 minus RSS after step 20 < 50 MB;
- threads of the process and its child processes; target: the same at step 300 as at step 20;
- step time (interval between optimizer steps); target: flat, the median of the last 40 steps within 1.25x of the
  median of steps 21-60.

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py               # ~3-5 min on 2 idle cores
    PYTHONPATH=. .venv/bin/python benchmarks/soak.py --steps 100   # quicker look

Prints a table at steps 20, 50, 100, 150, 200, 250, 300 and a verdict line per target (exit status 1 if one fails).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

import psutil  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks.timing import load, log  # noqa: E402


class Probe(TrainerCallback):
    """RSS, threads, child processes and the time of every optimizer step."""

    def __init__(self):
        self.process = psutil.Process()
        self.rows: list[tuple[int, float, int, int, float]] = []  # step, rss MiB, threads, children, step seconds
        self.last = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        rss = self.process.memory_info().rss / 2**20
        self.rows.append((state.global_step, rss, self.process.num_threads(), len(self.process.children(recursive=True)),
                          now - self.last))
        self.last = now
        if state.global_step % 50 == 0:
            log(f"[soak] step {state.global_step}: rss {rss:.0f} MiB, {threading.active_count()} python threads, "
                f"load {load()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--baseline_step", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from verifiers_rl.config import RLConfig
    from verifiers_rl.envs import load_environment
    from verifiers_rl.inference.factory import build_engine
    from verifiers_rl.models import resolve_model
    from verifiers_rl.trainer import RLTrainer

    torch.set_num_threads(args.threads)
    model = resolve_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model)
    work = tempfile.mkdtemp(prefix="verifiers_rl-soak-")
    config = RLConfig(
        output_dir=os.path.join(work, "out"), use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=1,
        max_steps=args.steps, learning_rate=1e-3, lr_scheduler_type="constant", rollouts_per_step=16,
        num_generations=4, max_completion_length=8, max_seq_len=128, max_off_policy_steps=1,
        gradient_checkpointing=False, save_strategy="steps", save_steps=100, save_total_limit=2,
        save_rollouts_path=os.path.join(work, "rollouts.jsonl"), print_samples_every=0, seed=0,
    )
    environment = load_environment("reverse_text", tokenizer=tokenizer, num_examples=2000)
    engine = build_engine(config, model, tokenizer) if config.process_index == 0 else None
    probe = Probe()
    trainer = RLTrainer(model, config, processing_class=tokenizer, environment=environment, engine=engine,
                        callbacks=[probe])
    started = time.perf_counter()
    log(f"[soak] {args.steps} steps of the tiny model at k = 1 in {work} (load {load()})")
    trainer.train()
    engine.close()
    log(f"[soak] done in {time.perf_counter() - started:.0f} s (load {load()})")

    rows = {step: (rss, threads, children) for step, rss, threads, children, _ in probe.rows}
    seconds = [row[4] for row in probe.rows]
    marks = [args.baseline_step] + [s for s in range(50, args.steps + 1, 50) if s > args.baseline_step]
    if args.steps not in marks:
        marks.append(args.steps)
    print(f"tiny model, reverse_text, 16 rollouts per step, k = 1, torch threads {args.threads}, "
          f"checkpoint every 100 steps; load at the end {load()}")
    print()
    print("| step | RSS (MiB) | RSS - RSS at step 20 (MiB) | threads | child processes | median step s (last 20) |")
    print("|---:|---:|---:|---:|---:|---:|")
    base_rss, base_threads, base_children = rows[args.baseline_step]
    for step in marks:
        rss, threads, children = rows[step]
        window = seconds[max(step - 20, 0):step]
        print(f"| {step} | {rss:.1f} | {rss - base_rss:+.1f} | {threads} | {children} | {statistics.median(window):.3f} |")
    last_rss, last_threads, last_children = rows[args.steps]
    early = statistics.median(seconds[args.baseline_step:args.baseline_step + 40])
    late = statistics.median(seconds[-40:])
    checks = [
        (f"RSS growth step {args.baseline_step} -> {args.steps}: {last_rss - base_rss:+.1f} MiB (target < 50)",
         last_rss - base_rss < 50),
        (f"threads {base_threads} -> {last_threads}, child processes {base_children} -> {last_children} (target: constant)",
         (last_threads, last_children) == (base_threads, base_children)),
        (f"median step time {early:.3f} s (steps {args.baseline_step + 1}-{args.baseline_step + 40}) -> {late:.3f} s "
         f"(last 40): {late / early:.2f}x (target <= 1.25x)", late / early <= 1.25),
    ]
    print()
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
