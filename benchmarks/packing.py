"""Packed vs padded micro-batches on a long-tailed length distribution.

What it measures: one optimizer step's rollouts (16 groups x 4 = 64 by default) with a long-tailed completion
length (lognormal body of 20-100 tokens, a tail up to ~1000; prompts of 20-60 tokens) are planned by
``verifiers_rl.training.batching.plan_batch`` either as padded micro-batches (R rows each, sequences sorted by length)
or as packed micro-batches (one row of at most T tokens each, first-fit decreasing), or as ``auto`` chooses
(without a varlen kernel: the padded or packed layout of lower modelled cost). For every configuration
the table gives the number of micro-batches, real tokens (the sequences'), computed tokens (rows x width, summed),
the share of computed tokens that are not padding, and the wall time of one real forward + backward over all
micro-batches of a small random Llama model (``verifiers_rl.core.models.build_tiny_model``: hidden 128, 4 layers,
~400-token vocabulary) through ``verifiers_rl.training.forward.micro_batch_logprobs`` (median of a few repetitions
after one warm-up), on CPU with 2 threads.

Note on the model: it attends through sdpa, so a packed row attends run by run (``segmented_attention``: each
sequence over itself, not the whole row); a padded row attends over its width. The "attention cells" column counts
what the forward computes (``policy.attention_cells``), and ``auto`` models the same (``run_attention``).

``--workload uniform``: the long-tail benchmark's uniform multi-turn step instead (8 groups x 4 rows of ~118 tokens:
a 40-token prompt, 76-80 completion tokens; its model, hidden 256 x 4 layers; one padded micro-batch of 32 rows or
packed rows of at most 684 tokens, as ``benchmarks/long_tail.py --workloads multi --lengths uniform`` plans them),
where packed rows model marginally fewer attention cells than one padded micro-batch but take 8 micro-batches. It
also prints what one micro-batch costs beyond its rows, in token-times: (time of rows=1 - time of rows=32) / 31
micro-batches, over rows=32's time per token (the same tokens and cells either way), what
``batching.MICRO_BATCH_OVERHEAD_TOKENS`` stands for.

Run (about 45 s on 2 idle cores; ``--quick``: 32 rollouts, fewer configurations, one repetition, about 10 s):

    PYTHONPATH=. .venv/bin/python benchmarks/packing.py
    PYTHONPATH=. .venv/bin/python benchmarks/packing.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/packing.py --workload uniform
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from verifiers_rl.training.batching import MICRO_BATCH_OVERHEAD_TOKENS, BatchingConfig, plan_batch  # noqa: E402
from verifiers_rl.core.models import build_tiny_model  # noqa: E402
from verifiers_rl.training.forward import attends_run_by_run, attention_cells, attention_cost, micro_batch_logprobs  # noqa: E402
from verifiers_rl.core.rollout import Rollout  # noqa: E402
from verifiers_rl.rollouts.synthetic import random_rollouts  # noqa: E402
from timing import at_least  # noqa: E402  (benchmarks/timing.py)

MAX_SEQ_LEN = 1100
FIRST_TOKEN_ID = 4


def long_tailed_rollouts(num_groups: int, group_size: int, vocab_size: int, seed: int = 0) -> list[Rollout]:
    """Rollouts whose completion lengths are mostly 20-100 tokens with a long tail to ~1000.

    Body (90%): lognormal with median 45 tokens; tail (10%): lognormal with median 450; clipped to [8, 1000].
    Prompts: 20-60 tokens, shared within a group. Every completion token is trained on.
    """
    rng = random.Random(seed)
    rollouts = []
    for group in range(num_groups):
        prompt = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(rng.randint(20, 60))]
        for _ in range(group_size):
            if rng.random() < 0.9:
                n = rng.lognormvariate(math.log(45), 0.45)
            else:
                n = rng.lognormvariate(math.log(450), 0.5)
            n = int(min(max(round(n), 8), 1000))
            completion = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]
            rollouts.append(
                Rollout(
                    prompt_ids=list(prompt),
                    completion_ids=completion,
                    completion_mask=[1] * n,
                    reward=float(rng.random() < 0.5),
                    group_id=f"g{group}",
                )
            )
    return rollouts


def uniform_rollouts(vocab_size: int, seed: int = 0) -> list[Rollout]:
    """8 groups x 4 rollouts of ~118 tokens: a 40-token prompt per group, 76-80 completion tokens each."""
    return random_rollouts(8, 4, vocab_size=vocab_size, seed=seed, prompt_len=(40, 40), completion_len=(76, 80))


def step_seconds(model, micro_batches, repeats: int) -> float:
    """Median wall time of forward + backward over all micro-batches (one warm-up first)."""

    def one_step():
        model.zero_grad(set_to_none=True)
        for mb in micro_batches:
            out = micro_batch_logprobs(model, mb, temperature=1.0, chunk_size=1024)
            loss = (out.logps * mb.loss_mask).sum()
            loss.backward()

    one_step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tiny_model(hidden: int, seed: int, layers: int = 4):
    """A random Llama (``build_tiny_model``) in training mode, and its vocabulary size."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="vrl-bench-") as folder:
        build_tiny_model(folder, hidden_size=hidden, num_layers=layers, seed=seed)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    return model, len(tokenizer)


def measure(model, rollouts: list[Rollout], configs, max_seq_len: int, repeats: int) -> list[dict]:
    """Each (mode, label, BatchingConfig fields) planned by ``plan_batch`` and timed (``step_seconds``); ``auto``
    gets the model's attention cost and kernel, as the trainer gives them, and its row names what it chose."""
    results = []
    for mode, label, kwargs in configs:
        if mode == "auto":
            kwargs = dict(kwargs, attention_cost=attention_cost(model), run_attention=attends_run_by_run(model))
        config = BatchingConfig(world_size=1, max_seq_len=max_seq_len, overlong="truncate", **kwargs)
        (rank_batch,) = plan_batch(rollouts, config)
        mbs = rank_batch.micro_batches
        real = sum(mb.real_tokens for mb in mbs)
        computed = sum(mb.computed_tokens for mb in mbs)
        assert real == rank_batch.stats.real_tokens and computed == rank_batch.stats.computed_tokens
        shapes = [tuple(mb.input_ids.shape) for mb in mbs]
        cells = sum(attention_cells(mb, attends_run_by_run(model)) for mb in mbs)  # query-key pairs computed
        seconds = step_seconds(model, mbs, repeats)
        if mode == "auto":
            mode = "auto -> " + ("packed" if rank_batch.stats.extra["packed_micro_batches"] else "padded")
        results.append(dict(mode=mode, label=label, mbs=len(mbs), real=real, computed=computed, seconds=seconds,
                            shapes=shapes, attention_cells=cells, fraction=forwarded_real_fraction(rank_batch.stats)))
    return results


def forwarded_real_fraction(stats) -> float:
    """The share of the computed tokens that are not padding: shared prompts are forwarded once per group, so the
    sequences' tokens (``real``) can exceed the computed tokens, and real / computed read above 100%."""
    return (stats.computed_tokens - stats.padding_tokens) / stats.computed_tokens


def print_table(results: list[dict]) -> None:
    print(
        "| mode | setting | micro-batches | real tokens | computed tokens | non-padding fraction | attention cells (M) "
        "| fwd+bwd s/step | real tok/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['mode']} | {r['label']} | {r['mbs']} | {r['real']} | {r['computed']} | "
            f"{r['fraction']:.1%} | {r['attention_cells'] / 1e6:.1f} | {r['seconds']:.3f} | "
            f"{r['real'] / r['seconds']:,.0f} |"
        )


def uniform(args) -> None:
    """``--workload uniform``: the long-tail benchmark's uniform multi-turn step, and one micro-batch's cost."""
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    repeats = args.repeats or 7
    model, vocab = tiny_model(256, args.seed)
    rollouts = uniform_rollouts(vocab, seed=args.seed)
    max_seq_len, budget = 171, 684  # the long-tail benchmark's uniform multi-turn step: budget = 4 x max_seq_len
    shared = dict(share_prompt_training="auto")  # RLConfig's default, as the long-tail benchmark trains
    configs = [("padded", f"rows={r}, unshared", dict(mode="padded", rows_per_micro_batch=r)) for r in (1, 32)]
    configs += [("padded", "rows=32", dict(mode="padded", rows_per_micro_batch=32, **shared)),
                ("packed", f"tokens={budget}", dict(mode="packed", max_tokens_per_microbatch=budget, **shared)),
                ("auto", f"rows=32, tokens={budget}",
                 dict(mode="auto", rows_per_micro_batch=32, max_tokens_per_microbatch=budget, **shared))]
    results = measure(model, rollouts, configs, max_seq_len, repeats)
    lengths = sorted(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    print(f"\n{len(rollouts)} rollouts (8 groups x 4), vocab {vocab}, sequence length {lengths[0]}-{lengths[-1]}; "
          f"tiny Llama (hidden 256, 4 layers), CPU, {torch.get_num_threads()} threads, median of {repeats} after 1 "
          f"warm-up; prompts shared as RLConfig's default shares them (share_prompt_training auto) but in the rows "
          f"marked unshared (one row per sequence).\n")
    print_table(results)
    one_row, all_rows = results[0], results[1]  # the same unshared rows: tokens and cells equal but for padding
    per_token = all_rows["seconds"] / all_rows["computed"]
    overhead = (one_row["seconds"] - all_rows["seconds"]) / (one_row["mbs"] - all_rows["mbs"])
    print(f"\none micro-batch beyond its rows: {overhead * 1e3:.1f} ms = {overhead / per_token:.0f} token-times "
          f"(rows=1 vs rows=32: the same rows in {one_row['mbs']} micro-batches or {all_rows['mbs']}); "
          f"the cost model charges {MICRO_BATCH_OVERHEAD_TOKENS}.")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batch, fewer repetitions (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=["longtail", "uniform"], default="longtail",
                        help="uniform: the long-tail benchmark's uniform multi-turn step (see above)")
    args = parser.parse_args(argv)
    if args.workload == "uniform" and args.quick:
        parser.error("--quick shrinks the longtail workload; --workload uniform has one size")
    at_least(parser, args, 1, "repeats")  # 0 silently meant the default, below it no timing at all
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.workload == "uniform":
        return uniform(args)

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    num_groups, group_size = (8, 4) if args.quick else (16, 4)
    repeats = args.repeats or (1 if args.quick else 5)
    padded_rows = [4, 8] if args.quick else [1, 4, 8, 16]
    packed_budgets = [2048] if args.quick else [2048, 4096]

    model, vocab = tiny_model(128, args.seed)
    rollouts = long_tailed_rollouts(num_groups, group_size, vocab, seed=args.seed)

    lengths = sorted(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    completion_lengths = sorted(len(r.completion_ids) for r in rollouts)

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))]

    configs = [("padded", f"rows={r}", dict(mode="padded", rows_per_micro_batch=r)) for r in padded_rows]
    configs += [("packed", f"tokens={t}", dict(mode="packed", max_tokens_per_microbatch=t)) for t in packed_budgets]
    # What --micro_batching auto chooses without a varlen kernel: the padded or packed layout of lower modelled cost.
    configs += [("auto", f"rows={r}, tokens={packed_budgets[0]}",
                 dict(mode="auto", rows_per_micro_batch=r, max_tokens_per_microbatch=packed_budgets[0]))
                for r in padded_rows[-2:]]
    results = measure(model, rollouts, configs, MAX_SEQ_LEN, repeats)

    print(
        f"\n{len(rollouts)} rollouts ({num_groups} groups x {group_size}), vocab {vocab}, max_seq_len {MAX_SEQ_LEN}; "
        f"completion length p50/p90/max = {pct(completion_lengths, 0.5)}/{pct(completion_lengths, 0.9)}/"
        f"{completion_lengths[-1]}, sequence length p50/p90/max = {pct(lengths, 0.5)}/{pct(lengths, 0.9)}/"
        f"{lengths[-1]}; tiny Llama (hidden 128, 4 layers), CPU, {torch.get_num_threads()} threads, "
        f"median of {repeats} after 1 warm-up.\n"
    )
    needed_cells = sum(min(n, MAX_SEQ_LEN) ** 2 for n in lengths)
    print_table(results)
    padded = [r for r in results if r["mode"] == "padded"]
    packed = [r for r in results if r["mode"] == "packed"]
    best_padded = min(padded, key=lambda r: r["seconds"])
    best_packed = min(packed, key=lambda r: r["seconds"])
    packed_fraction = min(r["fraction"] for r in packed)
    print(
        f"\npacked/best-padded time: {best_packed['seconds'] / best_padded['seconds']:.2f} "
        f"(packed {best_packed['label']} {best_packed['seconds']:.3f} s vs padded {best_padded['label']} "
        f"{best_padded['seconds']:.3f} s); packed non-padding fraction {packed_fraction:.1%} (target >= 95%)."
    )
    print(
        f"attention cells = what the forward computes: run by run in packed rows (each sequence over itself), "
        f"rows x width^2 in padded rows; the sequences alone need {needed_cells / 1e6:.1f} M."
    )
    print("\nmicro-batch shapes (rows x width):")
    for r in results:
        print(f"- {r['mode']} {r['label']}: " + ", ".join(f"{a}x{b}" for a, b in r["shapes"]))


if __name__ == "__main__":
    main()
