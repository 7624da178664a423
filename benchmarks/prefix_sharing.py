"""Prompt once per group: the training forward + backward with shared-prefix rows (``share_prompt_training`` on / auto) against
one row per sequence (off), over prompt and completion lengths from the quickstart's to long completions.

What it measures: for each workload (G completions per prompt; prompt length P; completion lengths uniform in
[C/2, 3C/2]), one optimizer step's rollouts are planned by ``verifiers_rl.training.batching.plan_batch`` as padded
micro-batches (``--rows`` sequences each) three ways: ``off`` (one row per sequence, the prompt repeated), ``on``
(one row per group part: the prompt once, then every completion) and ``auto`` (the part size with the lowest
modelled cost, ``verifiers_rl.training.prefix.best_part_size``). The table gives the tokens forwarded (padding included),
the attention cells the forward computes (``policy.attention_cells``: shared rows attend run by run, a
completion over the prompt and itself; plain padded rows over their width), the
modelled cost (tokens + attention_cost x cells, a run's overhead counted as ``RUN_OVERHEAD_CELLS`` cells, in token
units; ``policy.attention_cost`` from the model config),
and the median wall time of a real forward + backward over all micro-batches through
``verifiers_rl.training.forward.micro_batch_logprobs`` (the three modes interleaved, after one warm-up each).

The model: a random Llama shaped like one SmolLM2-135M layer stack (hidden 576, MLP 1536, 9 heads of 64, 3
key/value heads) with ``--layers`` layers (default 2) and a 400-token vocabulary (the output layer costs the same in
every mode: only loss tokens reach it); ``--model smollm2`` runs the real SmolLM2-135M-Instruct instead (slow).

The last line fits wall time = a x tokens + b x cells over every row and prints b / a, the measured cost of an
attention cell in token units, beside the modelled ``attention_cost`` that ``auto`` decides with; where a or b
comes out at or below 0 (noisy times under load) it says the fit is unreliable instead.

Run (about 3 minutes on 2 idle cores; ``--quick``: two workloads, one repetition, about 30 s):

    PYTHONPATH=. .venv/bin/python benchmarks/prefix_sharing.py
    PYTHONPATH=. .venv/bin/python benchmarks/prefix_sharing.py --quick
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from verifiers_rl.training.batching import BatchingConfig, plan_batch  # noqa: E402
from verifiers_rl.training.forward import attends_run_by_run, attention_cells, attention_cost, micro_batch_logprobs  # noqa: E402
from verifiers_rl.core.rollout import Rollout  # noqa: E402
from timing import at_least, load, log  # noqa: E402  (benchmarks/timing.py)

# (name, prompt length P, mean completion length C, completions per prompt G, groups)
WORKLOADS = [
    ("quickstart-like", 40, 16, 4, 4),
    ("long prompt", 400, 50, 8, 2),
    ("balanced", 100, 100, 8, 2),
    ("long completions", 40, 200, 8, 2),
    ("very long completions", 100, 600, 8, 1),
]
MODES = ("off", "on", "auto")


def group_rollouts(prompt_len: int, completion_len: int, group_size: int, groups: int, vocab: int, seed: int):
    rng = random.Random(seed)
    rollouts = []
    for group in range(groups):
        prompt = [rng.randrange(4, vocab) for _ in range(prompt_len)]
        for _ in range(group_size):
            n = rng.randint(max(completion_len // 2, 1), completion_len * 3 // 2)
            rollouts.append(Rollout(prompt, [rng.randrange(4, vocab) for _ in range(n)], [1] * n,
                                    float(rng.random() < 0.5), f"g{group}"))
    return rollouts


def forwarded_shapes(micro_batches) -> list[tuple[int, int]]:
    return [tuple((mb.shared.input_ids if mb.shared is not None else mb.input_ids).shape) for mb in micro_batches]


def one_step(model, micro_batches) -> float:
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    for mb in micro_batches:
        out = micro_batch_logprobs(model, mb, temperature=1.0, chunk_size=1024)
        (out.logps * mb.loss_mask).sum().backward()
    return time.perf_counter() - start


def build_model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model == "smollm2":
        from verifiers_rl.core.models import smollm2_dir

        return AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), dtype=torch.float32)
    config = LlamaConfig(vocab_size=400, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def fit_line(rows: list[dict], cost: float) -> str:
    """Wall time = a x tokens + b x cells fitted over every row, and b / a (an attention cell's cost in token units)
    beside the modelled ``attention_cost``; a cost at or below 0, which load makes of noisy times, is no measurement:
    the line says the fit is unreliable instead of giving b / a as a fact."""
    design = torch.tensor([[float(r["tokens"]), float(r["cells"])] for r in rows], dtype=torch.float64)
    seconds = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)[:, None]
    per_token, per_cell = torch.linalg.lstsq(design, seconds).solution[:, 0].tolist()
    line = f"fit: seconds = {per_token:.3e} x tokens {'-' if per_cell < 0 else '+'} {abs(per_cell):.3e} x cells -> "
    if min(per_token, per_cell) <= 0:
        return line + ("UNRELIABLE: a cost at or below 0 per " + ("token" if per_token <= 0 else "cell") + " is "
                       f"no measurement (times too noisy under load: rerun on idle cores); auto models {cost:.2e} "
                       "(policy.attention_cost).")
    return line + (f"an attention cell costs {per_cell / per_token:.2e} tokens measured; auto models {cost:.2e} "
                   "(policy.attention_cost).")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2-shaped", "smollm2"], default="smollm2-shaped")
    parser.add_argument("--layers", type=int, default=None, help="layers of the SmolLM2-shaped model (2)")
    parser.add_argument("--rows", type=int, default=8, help="sequences per padded micro-batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.model == "smollm2" and args.layers is not None:  # the real model has its own 30 layers
        parser.error("--layers shapes the smollm2-shaped model only; --model smollm2 runs the real model's layers")
    args.layers = 2 if args.layers is None else args.layers
    at_least(parser, args, 1, "layers", "rows", "threads", "repeats")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    workloads = WORKLOADS[:2] if args.quick else WORKLOADS
    torch.set_num_threads(args.threads)
    model = build_model(args)
    model.train()
    cost, runs = attention_cost(model), attends_run_by_run(model)
    vocab = model.config.vocab_size
    log(f"load average at start: {load()}")
    started = time.perf_counter()

    rows = []
    for name, prompt_len, completion_len, group_size, groups in workloads:
        rollouts = group_rollouts(prompt_len, completion_len, group_size, groups, vocab, args.seed)
        plans = {}
        for mode in MODES:
            config = BatchingConfig(mode="padded", rows_per_micro_batch=args.rows, max_seq_len=8192,
                                    max_tokens_per_microbatch=65536, share_prompt_training=mode, attention_cost=cost,
                                    run_attention=runs)
            (rank_batch,) = plan_batch(rollouts, config)
            plans[mode] = rank_batch
            one_step(model, rank_batch.micro_batches)  # warm-up
        times = {mode: [] for mode in MODES}
        for _ in range(repeats):  # interleaved, so load changes hit the three modes alike
            for mode in MODES:
                times[mode].append(one_step(model, plans[mode].micro_batches))
        for mode in MODES:
            rank_batch = plans[mode]
            shapes = forwarded_shapes(rank_batch.micro_batches)
            tokens = rank_batch.stats.computed_tokens
            cells = sum(attention_cells(mb, runs) for mb in rank_batch.micro_batches)
            modelled_cells = sum(attention_cells(mb, runs, with_overhead=True) for mb in rank_batch.micro_batches)
            rows.append(dict(name=name, P=prompt_len, C=completion_len, G=group_size, groups=groups, mode=mode,
                             tokens=tokens, unique=rank_batch.stats.unique_tokens, cells=cells,
                             modelled=tokens + cost * modelled_cells, shapes=shapes,
                             seconds=statistics.median(times[mode])))
        log(f"[{name}] " + ", ".join(f"{m} {statistics.median(times[m]):.3f} s" for m in MODES) + f" (load {load()})")

    model_name = ("SmolLM2-135M-Instruct" if args.model == "smollm2" else
                  f"random Llama shaped like SmolLM2 (hidden 576, 9 heads, 3 kv heads, MLP 1536), {args.layers} layers")
    print(f"\n{model_name}; padded micro-batches of {args.rows} sequences; fp32 CPU, {args.threads} threads; median of "
          f"{repeats} after 1 warm-up; total {time.perf_counter() - started:.0f} s, load average at end {load()}.\n")
    print("| workload | P | C | G x groups | share_prompt_training | tokens forwarded | / unique | attention cells (M) | "
          "modelled cost | fwd+bwd s | vs off | rows x width |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        off = next(x for x in rows if x["name"] == r["name"] and x["mode"] == "off")
        shapes = ", ".join(f"{a}x{b}" for a, b in sorted(set(r["shapes"])))
        print(f"| {r['name']} | {r['P']} | {r['C']} | {r['G']} x {r['groups']} | {r['mode']} | {r['tokens']} | "
              f"{r['tokens'] / r['unique']:.2f} | {r['cells'] / 1e6:.2f} | {r['modelled']:.0f} | {r['seconds']:.3f} | "
              f"{r['seconds'] / off['seconds']:.2f} | {shapes} |")
    print(f"\n{fit_line(rows, cost)}")
    chosen = [r for r in rows if r["mode"] == "auto"]
    best = sum(1 for r in chosen if r["seconds"] <= 1.1 * min(x["seconds"] for x in rows if x["name"] == r["name"]))
    print(f"auto within 10% of the fastest mode on {best} of {len(chosen)} workloads.")


if __name__ == "__main__":
    main()
