"""What each of the embedded engine's CPU decode changes buys, generation alone, at provably equal work.

SmolLM2-135M-Instruct, the four ``vs_trl`` reverse_text prompts x 4 samples (a group's prompt prefilled once),
temperature 1, every request seeded (``sampling_for_rollout``): the same seeds give every variant the same tokens,
which the script asserts, so the variants do the same work. Variants (``--variants``), all through the engine's own
decode loop (a finished row leaves the batch):

- ``forward``: transformers' forward with ``F.linear`` (``llama_decode=False, cpu_matmuls="linear"``);
- ``weight_major``: transformers' forward, linear layers as ``(W x^T)^T`` with padded rows (``cpu_matmul``);
- ``lean``: after the first step, ``llama_decode``'s lean step (weight-major too);
- ``packed``: the default: the lean step with oneDNN-packed weights (``cpu_matmul.PackedWeights``), the time to
  pack them included: each batch follows a weight load, as in training, and the first batch after a load packs.

Each batch decodes on the event loop's own thread (``generate_in_loop_thread``), as synchronous training (k = 0)
does. For each of ``--max_new_tokens`` it times ``--batches`` batches after one warm-up batch (each batch its own seeds)
and prints a table: median seconds per batch, completion tokens per second, and the ratio to ``forward``.

    PYTHONPATH=. .venv/bin/python benchmarks/embedded_decode.py                 # 16 and 128 tokens, ~4 min
    PYTHONPATH=. .venv/bin/python benchmarks/embedded_decode.py --max_new_tokens 16 --batches 2

Timings depend on what else runs on the machine: every progress line (stderr) carries ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from verifiers_rl.envs import RolloutSampling, sampling_for_rollout  # noqa: E402
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig  # noqa: E402
from verifiers_rl.core.models import smollm2_dir  # noqa: E402
from timing import at_least, load, log, once_each  # noqa: E402  (benchmarks/timing.py)

VARIANTS = {
    "forward": dict(llama_decode=False, cpu_matmuls="linear"),
    "weight_major": dict(llama_decode=False, cpu_matmuls="weight_major"),
    "lean": dict(llama_decode=True, cpu_matmuls="weight_major"),
    "packed": dict(llama_decode=True, cpu_matmuls="packed"),
}
WORDS = ["abc", "hello", "tree", "pqrstu"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--max_new_tokens", nargs="+", type=int, default=[16, 128])
    parser.add_argument("--batches", type=int, default=3, help="timed batches per variant (after one warm-up)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (4 prompts)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    # Checked before SmolLM2 loads: --batches 0 decoded the warm-up batches, then failed on an empty median.
    at_least(parser, args, 1, "max_new_tokens", "batches", "samples", "threads")
    once_each(parser, args, "variants", "max_new_tokens")
    return args


def run_batch(engine: EmbeddedEngine, prompts: list[list[int]], samples: int, batch: int, n: int):
    async def one(prompt, seed):
        with sampling_for_rollout(RolloutSampling(seed, None)):
            return await engine.sample(prompt, n)

    async def all_of_them():
        return await asyncio.gather(*[one(p, 1000 * batch + 10 * i + j)
                                      for i, p in enumerate(prompts) for j in range(samples)])

    start = time.perf_counter()
    out = asyncio.run(all_of_them())
    return time.perf_counter() - start, [s.token_ids for s in out]


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = str(smollm2_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Reverse the text: {w}"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for w in WORDS]
    rows = []
    for n in args.max_new_tokens:
        tokens_of: dict[str, list] = {}
        for name in args.variants:
            # On the loop's thread, as at k = 0: a worker thread's OpenMP team competes with the main thread's (which
            # loads the weights), and the same batches then took 8.2-11.5 s against 7.0-8.6 s (128 tokens).
            engine = EmbeddedEngine(folder, tokenizer, SamplingConfig(temperature=1.0, top_k=0, top_p=1.0,
                                                                      max_new_tokens=n), generate_in_loop_thread=True,
                                    **VARIANTS[name])
            times, tokens = [], []
            for batch in range(args.batches + 1):
                # A weight load before each batch, as in training (untimed; its own weights: the tokens stay equal).
                engine.load_weights(list(engine.model.named_parameters()), version=batch)
                seconds, ids = run_batch(engine, prompts, args.samples, batch, n)
                log(f"[{n} tokens] [{name}] batch {batch}{' (warm-up)' if batch == 0 else ''}: {seconds:.2f} s, "
                    f"{sum(map(len, ids))} tokens; load {load()}")
                if batch:
                    times.append(seconds)
                    tokens.append(ids)
            engine.close()
            tokens_of[name] = tokens
            completion = statistics.mean(sum(map(len, ids)) for ids in tokens)
            rows.append((n, name, statistics.median(times), completion))
        first = next(iter(tokens_of.values()))
        for name, tokens in tokens_of.items():  # equal work: every variant sampled the same tokens
            if tokens != first:
                raise SystemExit(f"{name} sampled other tokens than {args.variants[0]} at {n} new tokens")
    print(f"\nEmbedded engine, generation alone: SmolLM2-135M-Instruct, 4 prompts x {args.samples} samples, "
          f"temperature 1, seeded (same tokens in every variant, asserted), {args.threads} torch threads, "
          f"median of {args.batches} batches after 1 warm-up.\n")
    print(f"| new tokens | variant | s/batch (median) | completion tokens/batch | completion tokens/s | vs {args.variants[0]} |")
    print("|---:|---|---:|---:|---:|---:|")
    base = {n: s for n, name, s, _ in rows if name == args.variants[0]}
    for n, name, seconds, completion in rows:
        print(f"| {n} | {name} | {seconds:.2f} | {completion:.0f} | {completion / seconds:.1f} | "
              f"{base[n] / seconds:.2f}x |")


if __name__ == "__main__":
    main()
