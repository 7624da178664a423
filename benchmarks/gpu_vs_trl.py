"""Our RLTrainer against TRL's GRPOTrainer on one GPU: training tokens/s, MFU, generation tokens/s, peak memory.

Workload (``--shape 0.5b``, the default): a Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` with random weights (hidden 896,
24 layers, 14 attention heads, 2 key/value heads, intermediate 4864, vocab 151936, tied embeddings, q/k/v biases, rope
theta 1e6, RMSNorm eps 1e-6: 494.0M parameters), saved in fp32 to a temporary folder; a word-level tokenizer whose
151936 entries are the words ``w0``, ``w1``, ... plus ``<pad>`` and ``<eos>`` (a prompt of P words is exactly P
tokens); prompts of 512 random words (seed 0), one per optimizer step, 8 samples each, 256 new tokens, temperature 1
(full softmax). The random model almost never samples ``<eos>``, so both sides generate (nearly) every completion to
its limit: the table's mean completion length shows it. Learning rate 0 (both policies stay the starting model: equal
work every step), AdamW (``adamw_torch_fused``), beta 0, loss ``grpo``, ``bf16=True`` (fp32 weights, bf16 autocast:
both trainers load the checkpoint in fp32 by default), no gradient checkpointing, one micro-batch per step on both
sides (TRL: ``per_device_train_batch_size=8``, one generation per step; ours: ``micro_batching="padded"``, 8 rows per
micro-batch), reward: a cheap function of the completion text. Each trainer runs ``--warmup`` + ``--steps`` steps.
``--shape tiny`` (hidden 64, 2 layers, vocab 1000, 32-token prompts, 16 new tokens) checks the script on CPU.
Qwen2: Qwen2.5's own architecture (the engine's captured GPU decode step, ``inference/graph_decode.py``, takes Llama
and Qwen2 models).

Trainers (``--trainers``, run one after the other in this process, each freed before the next):

- ``trl``: ``trl.GRPOTrainer`` with ``use_vllm=False``: transformers ``generate`` on the training model itself
  (under accelerate's bf16 autocast), then training; every row carries its own copy of the prompt.
- ``k0_shared`` / ``k0_unshared``: ``RLTrainer`` in TRL's form (the same dataset and reward function), generating with
  the embedded engine (its own bf16 copy of the weights on the GPU, as ``bf16=True`` makes it, refreshed after every
  step, prompt prefill shared by a group, each decode step replayed from a CUDA graph captured once per batch),
  synchronously (``max_off_policy_steps=0``), with ``share_prompt_training`` ``on`` (a group's prompt forwarded once,
  its 8 completions branching off it in one row: 512 + 8 x 256 tokens) or ``off`` (8 rows of 768).
- ``k1_shared``: as ``k0_shared``, generating one step ahead (``max_off_policy_steps=1``), overlapping training; its
  decode steps run through transformers' forward (the engine captures no graph on a worker thread).

Columns: ``step s``: median wall time between optimizer steps (``on_step_end`` to ``on_step_end``, after
``torch.cuda.synchronize()``) over the timed steps; ``gen s``, ``train s``: medians (TRL: its
``_generate_and_score_completions``, and the step minus that; ours: the generator's logged ``generation_time`` and the
trainer's logged ``train_time``; a ``synchronize()`` after each optimizer step keeps the queued kernels out of the
weight sync); ``compl tok/s``: generated tokens per step / step s; ``gen tok/s``: generated tokens / gen s (at k = 1
generation overlaps training); ``train tok/s``: tokens forwarded in training (``tokens_forwarded``, padding included:
2560 shared, 6144 unshared and TRL) / train s, and ``seq tok/s``: the step's prompt + completion tokens counted per
sequence (6144) / train s, the comparable throughput; ``TFLOP/s`` and ``MFU``: training FLOPs per step / train s
(/ ``--peak_tflops``, default 989: H100/H200 SXM dense bf16), with

    FLOPs = 6 * N_layers * T_forwarded + 6 * d * V * T_completion + 12 * n_layers * d * cells

(N_layers: the decoder layers' parameters, 357.9M; the output layer (d x V) only over completion tokens, where both
compute log-probs; cells: query-key pairs the causal mask allows, per sequence L(L+1)/2, for a shared row
P(P+1)/2 + sum over completions of C * P + C(C+1)/2; forward 4 * d FLOPs per cell and layer, x 3 with the backward);
``peak GiB``: ``torch.cuda.max_memory_allocated`` over the trainer's run (model, optimizer, our engine's copy and
caches), reset before each; ``x TRL``: TRL's step s / this step s (> 1: faster than TRL).

Run (one H100/H200, 1-2 minutes; ``--trainers`` picks; ``--budget_s``, default 170, skips a trainer when the seconds
since start plus the longest trainer's so far would pass it, so k1_shared, last, may be skipped; 0 never skips). Every
trainer's row is printed (stdout) as soon as it is done, its progress on stderr; one that fails prints its traceback
and the others still run.

    PYTHONPATH=. python benchmarks/gpu_vs_trl.py --json gpu_vs_trl.json
    PYTHONPATH=. python benchmarks/gpu_vs_trl.py --shape tiny --device cpu     # the CPU check (~1 minute)
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # --budget_s counts from here: the imports (seconds on a fresh GPU machine) included

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import traceback

import torch

from timing import at_least, log, once_each, quiet, writable_file  # benchmarks/timing.py, beside this script

SHAPES = {
    "0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, prompt=512, new=256),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1000, prompt=32, new=16),
}
TRAINERS = {"trl": None, "k0_shared": (0, "on"), "k0_unshared": (0, "off"), "k1_shared": (1, "on")}
NAMES = {"trl": "TRL GRPOTrainer (HF generate)", "k0_shared": "RLTrainer k=0, prompt sharing on",
         "k0_unshared": "RLTrainer k=0, prompt sharing off", "k1_shared": "RLTrainer k=1, prompt sharing on"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (a GPU is needed); cpu only checks the script, with --shape tiny")
    parser.add_argument("--trainers", nargs="+", choices=list(TRAINERS), default=list(TRAINERS))
    parser.add_argument("--num_generations", type=int, default=8, help="samples of the step's one prompt")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each trainer's run")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per trainer")
    parser.add_argument("--peak_tflops", type=float, default=989.0, help="the device's peak dense bf16 TFLOP/s")
    parser.add_argument("--budget_s", type=float, default=170.0, help="skip a trainer when the time so far plus the "
                        "longest trainer's so far would pass this (0: never skip)")
    parser.add_argument("--json", default=None, help="also write the numbers here (rewritten after each trainer)")
    args = parser.parse_args(argv)
    at_least(parser, args, 1, "steps")
    at_least(parser, args, 2, "num_generations")
    at_least(parser, args, 0, "warmup", "budget_s")
    once_each(parser, args, "trainers")
    if not args.peak_tflops > 0:  # NaN too: the MFU column divides by it, after the first trainer has run
        parser.error(f"--peak_tflops must be > 0 (got {args.peak_tflops}): the MFU column divides by it")
    writable_file(parser, args.json, "--json")
    # Without a GPU the default used to fall back to the 0.5B model on the CPU: hours, and no GPU number.
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: this benchmark measures one GPU (the CPU check of the script: --shape tiny "
                     "--device cpu)")
    if args.device == "cpu" and args.shape != "tiny":  # the same hours, asked for by flag
        parser.error(f"--device cpu checks the script with --shape tiny; --shape {args.shape} on the CPU takes hours "
                     "and measures no GPU")
    return args


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_model(folder: str, shape: dict, device: str):
    """The random Qwen2-family model and the word-level tokenizer (exactly ``vocab`` entries), saved in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = shape["vocab"]
    words = {f"w{i}": i for i in range(vocab - 2)}
    words.update({"<pad>": vocab - 2, "<eos>": vocab - 1})
    core = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>",
                                        unk_token="<pad>", padding_side="left")
    assert len(tokenizer) == vocab, (len(tokenizer), vocab)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["intermediate"], tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=32768, use_sliding_window=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds, not a minute of CPU
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    counts = dict(params=sum(p.numel() for p in model.parameters()),
                  layer_params=sum(p.numel() for p in model.model.layers.parameters()))
    del model
    return tokenizer, counts


def prompts(shape: dict, count: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(shape['vocab'] - 2)}" for _ in range(shape["prompt"])) for _ in range(count)]


def reward(completions, **kwargs) -> list[float]:
    """Cheap and varied (a group's rewards differ, so advantages are not all zero)."""
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


def run_trainer(name: str, args, model_dir: str, tokenizer, dataset, out: str):
    """One trainer's run; returns its recorder."""
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.training.trainer import RLTrainer
    from steps import grpo_settings, watch_ours
    from vs_trl import SplitRecorder, watch_trl

    device = args.device

    class Recorder(SplitRecorder):
        """vs_trl's recorder, with the GPU drained before every instant it takes."""

        def on_optimizer_step(self, *a, **kw):  # queued optimizer kernels count as training, not weight sync
            sync(device)

        def on_step_end(self, *a, **kw):
            sync(device)
            super().on_step_end(*a, **kw)

    shape = SHAPES[args.shape]
    settings = grpo_settings(out, args.warmup + args.steps, 0.0, args.num_generations, args.num_generations,
                             shape["new"])
    settings.update(use_cpu=device == "cpu", bf16=True)
    recorder = Recorder()
    if name == "trl":
        config = GRPOConfig(**settings, steps_per_generation=1, use_vllm=False, shuffle_dataset=False,
                            log_completions=False, mask_truncated_completions=False)
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[recorder])
        trainer.remove_callback(PrinterCallback)
        watch_trl(trainer, recorder, args.num_generations)
    else:
        k, share = TRAINERS[name]
        config = RLConfig(**settings, rollouts_per_step=args.num_generations,
                          max_seq_len=shape["prompt"] + shape["new"],
                          max_off_policy_steps=k, micro_batching="padded", share_prompt_training=share,
                          print_samples_every=0)
        trainer = RLTrainer(model_dir, config, processing_class=tokenizer, reward_funcs=reward, train_dataset=dataset)
        watch_ours(trainer, recorder)
    try:
        trainer.train()
    finally:
        recorder.trainer = None
        del trainer
    return recorder


def summarize(name: str, recorder, args, counts: dict, wall: float, peak) -> dict:
    shape, skip = SHAPES[args.shape], args.warmup
    timed = recorder.intervals()[skip:]
    split = recorder.split(skip)  # medians: gen, train, forwarded, unique
    steps = recorder.lengths[skip:]
    completions = [n for step in steps for n in step]
    tokens = statistics.mean(sum(step) for step in steps)  # generated tokens per step
    P, d, V, n = shape["prompt"], shape["hidden"], shape["vocab"], shape["layers"]
    sequence_tokens = statistics.mean(sum(P + c for c in step) for step in steps)
    shared = split["forwarded"] < sequence_tokens  # one row per group (prompt once) rather than one per sequence
    cells = statistics.mean(
        (P * (P + 1) / 2 + sum(c * P + c * (c + 1) / 2 for c in step)) if shared
        else sum((P + c) * (P + c + 1) / 2 for c in step) for step in steps)
    flops = 6 * counts["layer_params"] * split["forwarded"] + 6 * d * V * tokens + 12 * n * d * cells
    step = statistics.median(timed)  # at k = 1 the last step has no next batch to generate
    return dict(trainer=name, name=NAMES[name], step_s=step, gen_s=split["gen"], train_s=split["train"],
                completion_tokens_per_step=tokens, completion_tok_s=tokens / step, gen_tok_s=tokens / split["gen"],
                tokens_forwarded=split["forwarded"], train_tok_s=split["forwarded"] / split["train"],
                seq_tok_s=sequence_tokens / split["train"], train_tflops=flops / split["train"] / 1e12,
                mfu=flops / split["train"] / (args.peak_tflops * 1e12), peak_gib=peak,
                mean_completion_length=statistics.mean(completions), rollouts=len(completions),
                step_times=timed, wall_s=wall)


def table_header(header: str) -> None:
    print(f"\n{header}\n")
    print("| trainer | step s | gen s | train s | compl tok/s | gen tok/s | train tok/s | seq tok/s | TFLOP/s | MFU | "
          "peak GiB | mean compl len | x TRL (step) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)


def table_row(r: dict, trl: dict | None) -> None:
    """One row, printed as soon as its trainer is done (TRL runs first, so the ratio is known by then)."""
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    ratio = f"{trl['step_s'] / r['step_s']:.2f}x" if trl else "n/a"
    mfu = f"{r['mfu']:.2%}" if r["mfu"] >= 1e-4 else f"{r['mfu']:.1e}"
    print(f"| {r['name']} | {r['step_s']:.3f} | {r['gen_s']:.3f} | {r['train_s']:.3f} | "
          f"{r['completion_tok_s']:.0f} | {r['gen_tok_s']:.0f} | {r['train_tok_s']:.0f} | {r['seq_tok_s']:.0f} | "
          f"{r['train_tflops']:.3g} | {mfu} | {peak} | {r['mean_completion_length']:.1f} | {ratio} |", flush=True)


def main() -> None:
    args = parse_args()
    # vs_trl.py defaults ACCELERATE_USE_CPU to true when imported: say which device before it is.
    os.environ["ACCELERATE_USE_CPU"] = "true" if args.device == "cpu" else "false"
    import transformers
    import trl
    from datasets import Dataset

    quiet()
    shape = SHAPES[args.shape]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    env = (f"Device: {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
           f"{transformers.__version__}, trl {trl.__version__}")
    log(f"{env}; imports took {time.perf_counter() - STARTED:.1f} s")
    work = tempfile.mkdtemp(prefix="bench_gpu_vs_trl_")
    model_dir = os.path.join(work, "model")
    tokenizer, counts = build_model(model_dir, shape, args.device)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    texts = prompts(shape, args.warmup + args.steps)
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == shape["prompt"] for t in texts)
    dataset = Dataset.from_list([{"prompt": t} for t in texts])
    log(f"model {counts['params'] / 1e6:.1f}M parameters ({counts['layer_params'] / 1e6:.1f}M in the layers) in "
        f"{model_dir}; {time.perf_counter() - STARTED:.1f} s so far")
    header = (f"{args.shape} Qwen2-shaped random model ({counts['params'] / 1e6:.1f}M parameters), bf16 autocast, "
              f"{shape['prompt']}-token prompt x {args.num_generations} samples x {shape['new']} new tokens per step, "
              f"{args.steps} timed steps after {args.warmup} warm-up. {env}.")
    table_header(header)
    rows, failed, longest = [], [], 0.0
    for name in args.trainers:
        elapsed = time.perf_counter() - STARTED
        if args.budget_s and longest and elapsed + longest > args.budget_s:
            log(f"[{name}] skipped: {elapsed:.0f} s so far + {longest:.0f} s would pass --budget_s {args.budget_s:g}")
            continue
        log(f"[{name}] {args.warmup} warm-up + {args.steps} timed steps ({elapsed:.0f} s so far) ...")
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        begun = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the trainers' progress lines: stdout keeps the table
                recorder = run_trainer(name, args, model_dir, tokenizer, dataset, os.path.join(work, name))
            sync(args.device)
            peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
            wall = time.perf_counter() - begun
            row = summarize(name, recorder, args, counts, wall, peak)
            rows.append(row)
            log(f"[{name}] done in {wall:.0f} s: " + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                if k not in ("trainer", "name", "step_times")))
            table_row(row, next((r for r in rows if r["trainer"] == "trl"), None))
        except Exception:  # one failing trainer must not cost the others' numbers
            failed.append(name)
            log(f"[{name}] FAILED after {time.perf_counter() - begun:.0f} s:")
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
        longest = max(longest, time.perf_counter() - begun)
        recorder = None
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
            log(f"[{name}] freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(header=header, params=counts, rows=rows), f, indent=1)
    print(f"\nTotal {time.perf_counter() - STARTED:.0f} s; {len(rows)} of {len(args.trainers)} trainers finished.")
    if failed:  # scripts/gpu_checks.sh reads the exit status: a failed trainer is a failed check, a skipped one not
        print(f"Failed: {', '.join(failed)} (tracebacks on stderr).")
        sys.exit(1)

if __name__ == "__main__":
    main()
