"""The embedded engine's continuous batching against batch-at-a-time decoding, generation alone, at equal work.

A workload of ``--requests`` requests (groups of ``--samples`` sharing a prompt, the reverse_text prompts in turn),
each with its own fixed completion length: ``longtail``: ``--tail_fraction`` of the requests (at seeded random
places) ask for ``--tail_factor`` x the median ``--median_tokens``, the others for lengths spread evenly over
[median/2, 3 median/2]; ``uniform``: every request asks for the long-tail workload's mean length (the same total
tokens). The eos tokens are suppressed (the engine's eos list is replaced by an id no token has), so every request
decodes exactly its length on both sides. The two sides, on one engine (same weights, packs, threads), same seeds:

- ``batch``: the requests in consecutive batches of ``--max_rows`` through the engine's normal path (``sample``,
  its request batcher, ``BatchDecoder``): a finished row leaves its batch, none joins, the next batch starts when
  the slowest row of this one ends;
- ``continuous``: ``EmbeddedEngine.generate_continuous(requests, max_rows)`` (``RunningBatch``): a waiting request
  joins the running batch as soon as a row finishes.

Both decode on the calling thread (the engine's ``generate_in_loop_thread``, as synchronous training does), untimed
warm-up first, then ``--repeats`` repeats alternating which side goes first. Checked before any table: every request
has the same number of completion tokens on both sides (else the comparison is void and the script stops); also
printed: how many requests drew identical tokens (the same seeds; a row's float rounding depends on its batch).

Decode step: one forward of the running rows' newest tokens; each row's first token comes from its prompt's forward,
on both sides. ``continuous`` counts its steps and rows (``RunningBatchStats.rows_per_step``); for ``batch`` they
follow from the lengths (a batch steps until its longest row ends, row r runs in its first length_r - 1 steps).
Occupancy: mean rows per decode step. This measures the engine alone; through the trainer (``--groups_in_flight``
with ``--continuous_batching_rows``) see ``long_tail.py``.

    PYTHONPATH=. .venv/bin/python benchmarks/continuous_batching.py           # SmolLM2-135M, 64 requests, 3 repeats
    PYTHONPATH=. .venv/bin/python benchmarks/continuous_batching.py --quick   # a smoke test (tiny model), under a minute

The benchmark sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads, as ``long_tail.py`` does and as the README asks of
a continuous run on the CPU, unless the environment already names a policy (``OMP_WAIT_POLICY=ACTIVE`` measures
OpenMP's default); the header line names it.

Timings depend on what else runs on the machine: every progress line (stderr) carries ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

from timing import at_least, fill_in, load, log, model_name, once_each, passive_openmp  # noqa: E402  (timing.py)

passive_openmp()  # before torch loads OpenMP: the engine runs under the policy a continuous trainer runs it with

import torch  # noqa: E402

from verifiers_rl.core.models import load_tokenizer, resolve_model  # noqa: E402
from verifiers_rl.envs import RolloutSampling, derive_seed, sampling_for_rollout  # noqa: E402
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig  # noqa: E402
from verifiers_rl.inference.embedded.running_batch import DecodeRequest  # noqa: E402

WORDS = ["abc", "hello", "tree", "pqrstu", "river", "mountain", "xyz", "stone"]
SIDES = ("batch", "continuous")
NO_TOKEN = -1  # an eos id no token has: every row decodes to its own length
DEFAULTS = dict(requests=64, max_rows=16, median_tokens=32, repeats=3)
QUICK = dict(requests=16, max_rows=4, median_tokens=8, repeats=1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="'smollm2' (SmolLM2-135M-Instruct, the default), 'tiny' (the default with --quick) or a folder")
    parser.add_argument("--workloads", nargs="+", choices=["longtail", "uniform"], default=["longtail", "uniform"])
    parser.add_argument("--requests", type=int, default=None, help="(64; --quick 16)")
    parser.add_argument("--samples", type=int, default=4, help="requests per prompt (a group), consecutive")
    parser.add_argument("--max_rows", type=int, default=None,
                        help="rows decoding at once, on both sides (16; --quick 4)")
    parser.add_argument("--median_tokens", type=int, default=None, help="(32; --quick 8)")
    parser.add_argument("--tail_fraction", type=float, default=0.1)
    parser.add_argument("--tail_factor", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats of each side (after one warm-up; 3, --quick 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: the tiny model, 16 requests, max_rows 4, median 8 tokens, 1 repeat")
    args = parser.parse_args(argv)
    fill_in(args, QUICK if args.quick else DEFAULTS)
    args.model = args.model or ("tiny" if args.quick else "smollm2")
    model_name(parser, args.model)
    at_least(parser, args, 1, "requests", "max_rows", "samples", "repeats", "threads", "tail_factor")
    at_least(parser, args, 2, "median_tokens")
    once_each(parser, args, "workloads")
    if not 0 <= args.tail_fraction <= 1:
        parser.error(f"--tail_fraction must be in [0, 1] (got {args.tail_fraction})")
    return args


def lengths_of(args, workload: str) -> list[int]:
    """Each request's completion length (fixed, seeded)."""
    n, median = args.requests, args.median_tokens
    rng = random.Random(0)
    short = [round(median / 2 + median * i / max(n - 1, 1)) for i in range(n)]  # evenly over [m/2, 3m/2]
    rng.shuffle(short)
    tail = set(rng.sample(range(n), round(args.tail_fraction * n)))
    longtail = [args.tail_factor * median if i in tail else short[i] for i in range(n)]
    if workload == "longtail":
        return longtail
    return [round(statistics.mean(longtail))] * n


def run_batch_side(engine, prompts, lengths, seeds, max_rows):
    """Consecutive batches of ``max_rows`` requests through ``sample``; (seconds, tokens per request)."""
    async def one(prompt, n, seed):
        with sampling_for_rollout(RolloutSampling(seed)):
            return await engine.sample(prompt, n)

    async def all_batches():
        out = []
        for start in range(0, len(prompts), max_rows):
            part = range(start, min(start + max_rows, len(prompts)))
            out += await asyncio.gather(*[one(prompts[i], lengths[i], seeds[i]) for i in part])
        return out

    calls = engine.generate_calls
    begin = time.perf_counter()
    samples = asyncio.run(all_batches())
    seconds = time.perf_counter() - begin
    batches = -(-len(prompts) // max_rows)
    if engine.generate_calls - calls != batches:  # the batcher must decode exactly the batches asked for
        raise SystemExit(f"batch side: {engine.generate_calls - calls} engine batches, expected {batches}")
    return seconds, [s.token_ids for s in samples]


def run_continuous_side(engine, prompts, lengths, seeds, max_rows):
    """``generate_continuous`` over all requests; (seconds, tokens per request, rows per decode step)."""
    # RolloutSampling(seed)'s first call samples with derive_seed(seed, 0): the batch side's seed.
    requests = [DecodeRequest(p, n, 1.0, derive_seed(seed, 0)) for p, n, seed in zip(prompts, lengths, seeds)]
    begin = time.perf_counter()
    run = engine.generate_continuous(requests, max_rows)
    seconds = time.perf_counter() - begin
    return seconds, [s.token_ids for s in run.samples], run.stats.rows_per_step


def batch_steps(lengths: list[int], max_rows: int) -> list[int]:
    """Rows per decode step of consecutive batches: a batch steps until its longest row ends (its first token from
    the prompt's forward), row r runs in its first length_r - 1 steps."""
    rows = []
    for start in range(0, len(lengths), max_rows):
        part = lengths[start:start + max_rows]
        rows += [sum(n - 1 > step for n in part) for step in range(max(part) - 1)]
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)
    words = [WORDS[g % len(WORDS)] for g in range(-(-args.requests // args.samples))]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Reverse the text: {w}"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for w in words for _ in range(args.samples)][: args.requests]
    engine = EmbeddedEngine(folder, tokenizer, SamplingConfig(temperature=1.0, top_k=0, top_p=1.0),
                            max_batch_size=args.max_rows, generate_in_loop_thread=True)
    engine.eos_token_ids[:] = [NO_TOKEN]  # the list both decoders hold: suppressed on both sides
    warm = [8] * min(args.requests, args.max_rows)
    run_batch_side(engine, prompts[: len(warm)], warm, list(range(len(warm))), args.max_rows)
    run_continuous_side(engine, prompts[: len(warm)], warm, list(range(len(warm))), args.max_rows)

    results = {}  # (workload, side) -> list of (seconds, tokens, rows per step)
    identical = {}
    for workload in args.workloads:
        lengths = lengths_of(args, workload)
        for repeat in range(args.repeats):
            seeds = [derive_seed("continuous_batching", repeat, i) for i in range(args.requests)]
            tokens = {}
            for side in (SIDES if repeat % 2 == 0 else SIDES[::-1]):
                if side == "batch":
                    seconds, ids = run_batch_side(engine, prompts, lengths, seeds, args.max_rows)
                    steps = batch_steps(lengths, args.max_rows)
                else:
                    seconds, ids, steps = run_continuous_side(engine, prompts, lengths, seeds, args.max_rows)
                tokens[side] = ids
                results.setdefault((workload, side), []).append((seconds, sum(map(len, ids)), steps))
                log(f"[{workload}] [{side}] repeat {repeat}: {seconds:.2f} s, {sum(map(len, ids))} tokens, "
                    f"{len(steps)} decode steps; load {load()}")
            counts = {side: [len(t) for t in ids] for side, ids in tokens.items()}
            if counts["batch"] != counts["continuous"] or counts["batch"] != lengths:
                bad = [i for i, (a, b) in enumerate(zip(counts["batch"], counts["continuous"])) if a != b]
                raise SystemExit(f"[{workload}] repeat {repeat}: completion lengths differ between the sides "
                                 f"(requests {bad[:10]}) or from the asked lengths: the comparison is void")
            same = sum(a == b for a, b in zip(tokens["batch"], tokens["continuous"]))
            identical.setdefault(workload, []).append(same)
            # the continuous side's steps carry every token but each row's first (from its prompt's forward)
            if sum(results[(workload, "continuous")][-1][2]) != sum(lengths) - len(lengths):
                raise SystemExit(f"[{workload}]: continuous rows per step do not add up to the tokens decoded")

    print(f"\nEmbedded engine, generation alone: {args.model} ({folder}), {args.requests} requests in groups of "
          f"{args.samples}, max_rows {args.max_rows}, temperature 1, seeded, eos suppressed (every request decodes "
          f"its fixed length: the same completion tokens per request on both sides, checked), {args.threads} torch "
          f"threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, {args.repeats} repeat(s) after a warm-up, sides "
          "alternating.")
    for workload in args.workloads:
        lengths = lengths_of(args, workload)
        print(f"\n{workload}: lengths median {statistics.median(lengths):.0f}, mean {statistics.mean(lengths):.1f}, "
              f"max {max(lengths)}, {sum(lengths)} completion tokens; requests with identical tokens on both sides: "
              f"{', '.join(f'{s}/{len(lengths)}' for s in identical[workload])} (per repeat)\n")
        print("| side | wall s (median) | wall s (min-max) | completion tokens/s (median) | decode steps | "
              "rows per decode step | tokens/s vs batch (median) | (min-max over repeats) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        base = results[(workload, "batch")]
        for side in SIDES:
            runs = results[(workload, side)]
            seconds = [s for s, _, _ in runs]
            total, steps = runs[0][1], runs[0][2]
            ratios = [b[0] / r[0] for b, r in zip(base, runs)]  # equal tokens: the wall-time ratio is the rate's
            print(f"| {side} | {statistics.median(seconds):.2f} | {min(seconds):.2f}-{max(seconds):.2f} | "
                  f"{total / statistics.median(seconds):.1f} | {len(steps)} | {statistics.mean(steps):.2f} | "
                  f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |")
    engine.close()


if __name__ == "__main__":
    main()
