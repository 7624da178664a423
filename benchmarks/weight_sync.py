"""Weight sync under DeepSpeed ZeRO-3 (2 processes, CPU, gloo): bucketed gathers vs one parameter at a time.

What it measures: the time of one weight sync, as ``RLTrainer.sync_weights`` does it, for a model whose parameters
ZeRO-3 sharded over 2 ranks (``deepspeed.zero.Init``, ``stage3_param_persistence_threshold: 0`` so every tensor is
really sharded). Each mode walks ``verifiers_rl.training.weight_stream.gathered_named_weights`` on both ranks in lockstep:

- ``gather``: gather only (the stream drained on every rank, the tensors dropped);
- ``gather+load``: the main process feeds the stream to an ``EmbeddedEngine`` (its own unsharded copy of the
  model): ``load_weights`` checks each tensor and copies it into its staging area, then swaps it in.

Bucket sizes: 0 (one parameter per gather: a collective round per tensor), a few MiB sizes, and "all" (the whole
model in one gather, as the trainer did before bucketing: it needs the full model in memory on every rank).
Modes run round-robin, N repetitions each, after one warm-up; the table gives the median (and fastest) seconds per
sync on the main process and the median's ratio to one-at-a-time of the same kind. Models: ~10M (a random Llama:
hidden 384, 6 layers, ~400-token vocabulary, tied) and SmolLM2-135M's architecture with random weights (hidden 576,
30 layers, 9 heads, 3 kv heads, intermediate 1536, vocabulary 49152, tied; random weights time the same).

Measured here (2 shared CPU cores, median of 7; runs vary by +-20% with the machine's load): on CPU/gloo the sync
is dominated by moving the bytes (135M: ~540 MB), so bucketing saves 15-40%, not multiples. One-at-a-time costs
~0.4 ms more per tensor (272 gathers for the 135M model); 256 MiB buckets (3 gathers) match one whole-model
gather while holding at most 256 MiB extra per rank instead of the whole model:

    llama-10M     gather       one-at-a-time (56)  0.140 s | 16 MiB (3) 0.095 s | 256 MiB (1) 0.079 s | all 0.093 s
    llama-10M     gather+load  one-at-a-time       0.131 s | 16 MiB     0.096 s | 256 MiB     0.108 s | all 0.107 s
    smollm2-135M  gather       one-at-a-time (272) 0.676 s | 16 MiB (31) 0.615 s | 256 MiB (3) 0.573 s | all 0.577 s
    smollm2-135M  gather+load  one-at-a-time       0.857 s | 16 MiB     0.819 s | 256 MiB     0.776 s | all 0.727 s

Run (about 2-3 minutes on 2 idle cores; ``--quick``: the 10M model only, 3 repetitions):

    PYTHONPATH=. .venv/bin/python benchmarks/weight_sync.py
    PYTHONPATH=. .venv/bin/python benchmarks/weight_sync.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

from timing import at_least, log  # noqa: E402  (benchmarks/timing.py)

MIB = 1 << 20
BUCKETS_MB = [0, 4, 16, 64, 256, "all"]
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def model_configs(quick: bool) -> dict:
    from transformers import LlamaConfig

    configs = {
        "llama-10M": LlamaConfig(vocab_size=400, hidden_size=384, intermediate_size=768, num_hidden_layers=6,
                                 num_attention_heads=6, num_key_value_heads=6, tie_word_embeddings=True),
    }
    if not quick:
        configs["smollm2-135M"] = LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=100000.0,
        )
    return configs


def sync_once(model, bucket_bytes: int, is_main: bool, engine, version: int):
    """One sync as the trainer does it: the main process's engine consumes the stream, everyone drains it."""
    from verifiers_rl.training.weight_stream import GatherStats, gathered_named_weights

    stats = GatherStats()
    stream = gathered_named_weights(model, bucket_bytes, is_main=is_main, zero3=True, stats=stats)
    if is_main and engine is not None:
        engine.load_weights(stream, version=version)
    for _ in stream:
        pass
    return stats


def worker(args) -> None:
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # lets RLConfig's helper skip DeepSpeed's CPU shm op build
    import torch
    import torch.distributed as dist

    from verifiers_rl.core.launch import _skip_deepspeed_cpu_shm_op

    _skip_deepspeed_cpu_shm_op()
    import deepspeed
    from transformers import AutoTokenizer, LlamaForCausalLM

    from verifiers_rl.inference import EmbeddedEngine
    from verifiers_rl.core.models import build_tiny_model

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    is_main = rank == 0
    tokenizer = None
    if is_main:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tempfile.mkdtemp(), hidden_size=32, num_layers=1))
    rows = []
    for name, config in model_configs(args.quick).items():
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG, dtype=torch.float32):
            model = LlamaForCausalLM(config)
        assert all(hasattr(p, "ds_id") for p in model.parameters()), "ZeRO-3 did not shard the model"
        num_params = sum(p.ds_numel for p in model.parameters())
        engine = None
        if is_main:
            config.pad_token_id = config.eos_token_id = tokenizer.eos_token_id
            engine = EmbeddedEngine(LlamaForCausalLM(config), tokenizer)
        modes = [(kind, size) for size in BUCKETS_MB for kind in ("gather", "gather+load")]
        times: dict = {mode: [] for mode in modes}
        buckets: dict = {}
        for repetition in range(args.repetitions + 1):  # the first round warms up
            for kind, size in modes:
                bucket_bytes = 1 << 50 if size == "all" else int(size * MIB)
                dist.barrier()
                start = time.perf_counter()
                stats = sync_once(model, bucket_bytes, is_main, engine if kind == "gather+load" else None, repetition)
                dist.barrier()
                if repetition:
                    times[(kind, size)].append(time.perf_counter() - start)
                buckets[(kind, size)] = stats.buckets
        if is_main:
            for kind, size in modes:
                median = statistics.median(times[(kind, size)])
                baseline = statistics.median(times[(kind, 0)])
                rows.append(dict(model=name, params=num_params, mode=kind, bucket=size, gathers=buckets[(kind, size)],
                                 seconds=median, fastest=min(times[(kind, size)]), ratio=median / baseline,
                                 runs=len(times[(kind, size)])))
            log(f"[weight_sync] {name} done")
        del model, engine
    if is_main:
        with open(args.out, "w") as handle:
            json.dump(rows, handle)
    dist.barrier()


def table(rows: list[dict]) -> str:
    lines = [
        "| model | params | mode | bucket MiB | gathers per sync | s per sync (median) | fastest | vs one-at-a-time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in sorted(rows, key=lambda r: (r["model"], r["mode"])):
        names = {0: "0 (one param)", "all": "all (whole model)"}
        bucket = names.get(row["bucket"], row["bucket"])
        lines.append(
            f"| {row['model']} | {row['params'] / 1e6:.1f}M | {row['mode']} | {bucket} | {row['gathers']} | "
            f"{row['seconds']:.3f} | {row['fastest']:.3f} | {row['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 10M model only, 3 repetitions")
    parser.add_argument("--repetitions", type=int, default=None, help="timed syncs per mode (5; --quick 3)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repetitions is None:
        args.repetitions = 3 if args.quick else 5
    # Checked before the two ranks launch: 0 ran the warm-up syncs, then failed on an empty median in both ranks.
    at_least(parser, args, 1, "repetitions")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "rows.json")
        from verifiers_rl.core.engine import free_port

        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", str(free_port()),
                   os.path.abspath(__file__), "--worker", "--out", out, "--repetitions", str(args.repetitions)]
        command += ["--quick"] if args.quick else []
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        start = time.monotonic()
        subprocess.run(command, env=env, check=True)
        with open(out) as handle:
            rows = json.load(handle)
    print(f"\nWeight sync under ZeRO-3, 2 processes on CPU (gloo), median of {args.repetitions} "
          f"({time.monotonic() - start:.0f} s in all):\n")
    print(table(rows))


if __name__ == "__main__":
    main()
