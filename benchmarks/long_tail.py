"""Long-tailed episodes through the trainer: batch-at-a-time against continuous generation (and TRL), at equal work.

The workload (``long_tail_env.py``): a dataset of ``--rows`` prompts, each asking for a FIXED number of completion
tokens. ``longtail``: ``--tail_fraction`` (10%) of the prompts ask for ``--tail_factor`` (8) x ``--median_tokens``,
the others for lengths spread evenly over [median/2, 3 median/2]; ``uniform``: every prompt the long-tail mean (the
same total tokens). ``single``: one model turn; ``multi``: ``--turns`` model turns (the row's length split evenly over
them, the user saying "Go on." between them), the same tail. The model's eos is suppressed (the embedded engine's
eos list is replaced by an id no token has; on a vLLM server every request carries ``"ignore_eos": true``, see
below) and each turn asks the engine for exactly its length; a sample of any other length stops the benchmark (the
sides would not do equal work). Learning rate 0: the policy stays the starting model, so every side samples from the
same weights. The reward (the share of distinct characters) only gives groups some variance.

Sides, one after the other in this one process, the same model folder, seeds and prompts:

- ``batch``: ``RLTrainer`` as today by default: ``max_off_policy_steps`` k = 1, batch b generated as a unit (the
  engine decodes the batch's requests together, a finished row leaves, none joins; the next batch starts when the
  slowest episode of this one ends);
- ``continuous``: the same with ``--groups_in_flight N`` and ``--continuous_batching_rows R`` (up to N groups in
  flight, the engine admitting new rows into its running batch as others finish, weights loaded between decode
  steps; a batch = finished whole groups, the earliest due first, each trained by its start version + k).
  Skipped, with a line saying so, while ``RLConfig`` lacks those fields;
- ``groups`` (not run by default, ``--sides ... groups``): ``--groups_in_flight N`` alone, the engine batching the
  requests it is sent as today: what the generator's part brings without the engine's;
- ``trl``: TRL's ``GRPOTrainer`` (``use_vllm=False``: ``generate`` on the policy itself, synchronous), single-turn
  only, the same prompts in our generator's order, each row held to the same length by a logits processor (eos masked
  until the row's last token, which is an eos: the same completion tokens, eos included, as our row's). TRL cannot
  run our multi-turn environment, so it has no ``multi`` row.

``--engine vllm``: our sides generate through a vLLM server instead (the project's ``.venv-vllm``, from
``scripts/install_vllm.sh``), which the benchmark starts from the model folder as the vLLM tests start theirs
(``VLLMServer``: loopback, a fresh API key, float32, ``--enforce-eager``; each wait bounded) and stops at the end,
every side of the run against the same server (its prefix cache emptied as each side starts; learning rate 0, so
the weights it holds stay the model's). Our client never sends ``ignore_eos``; the benchmark wraps that one client's
sampling payload so every request carries ``"ignore_eos": true`` (``long_tail_vllm.py``): without it a row would
end at its first sampled eos and the sides would not do equal work; ``FixedLengths`` still checks every turn's length.
Sides: ``batch``, and ``continuous`` as ``--groups_in_flight N`` alone: the server batches continuously itself, so
``--continuous_rows`` (``--continuous_batching_rows``) is refused, as RLConfig refuses it beside a server, and so
is ``groups`` (the same side there); TRL's side is refused (it generates on its policy, never through our server).
Weights load by ``files`` snapshots (RLConfig's default); ``vllm_reconnect_timeout_s`` 0 (a server lost mid-run
voids the run, and no reference probe follows each load). ``rows/step`` there is read from the server's counters
(``/metrics``): tokens generated per engine step over the timed window (``decode steps``: engine steps), a row's
first token counted since vLLM schedules prefills into the same steps. The tables name the engine.

Checked before any table, per run: every trained rollout sampled exactly the tokens its row asks (our sides) and
every TRL step's completion lengths are its rows' (TRL); a row trained on two sides has the same length on both.
The continuous side trains finished groups (a long one slides to a later batch, up to its deadline), so it may train
other rows than ``batch`` in a given step: its warm-up steps train short groups that finish first and the long groups
started then land in the timed steps, so its timed tokens/s leans its way (its ``tokens trained`` shows it).
``whole run tokens/s`` counts every trained token from the first step's start (both sides' start-up inside, the
process's one-off costs not: one untimed step of the first side runs before any side;
continuous then leaves its unfinished groups untrained): compare the two; more ``--steps`` shrink the gap.

Columns: ``s/step``: wall time between optimizer steps (``on_step_end`` to ``on_step_end``, generation, training and
the weight load inside) over the ``--steps`` after ``--warmup``, median and min-max; ``wait s`` / ``train s``: the
step's median time waiting for its batch and training (ours as the trainer logs them, ``wait_time`` and
``train_time``; TRL: its generation, and the rest of its step); ``sync s``: ours, the weight load after the step,
which batch-at-a-time holds until the engine has finished the batch it is generating (a wait for generation too): a
side whose wait and sync are ~0 is bound by training, where faster generation cannot shorten its steps;
``tokens/s``: sampled completion tokens trained per second (environment tokens between turns not counted);
``rows/step``: the mean rows a decode step ran over the timed window (occupancy; continuous: the engine's
``RunningBatchStats.rows_per_step``; batch: from each engine batch's sample lengths, a batch stepping until its
longest row ends; TRL: rows not yet finished, though ``generate`` computes every row of the batch until the longest
ends); a row's first token comes from its prompt's forward and is not a decode step (a side that decoded nothing in
the window, having generated every group before it: 0 and n/a, and a line under the table says its timed tokens/s
is training alone); ``lag``: the staleness
histogram, the share of trained tokens sampled 0, 1, ... optimizer steps before the weights that train them; ``stale
groups dropped``: groups the continuous generator dropped as older than ``max_off_policy_steps`` allows and
generated again (work done and not trained; only a resumed checkpoint's can be, so 0 here); ``x batch``: the side's
tokens/s over batch's, same run. A last table gathers those ratios.

Run (tiny random Llama hidden 256 x 4 layers, 8 prompts x 4 samples per step, median 16 tokens, 2 warm-up + 8
timed steps per side, 2 torch threads: 177 s on 2 quiet cores on 2026-11-28, TRL's sides the longest, and far longer
on a busy machine; ``--quick``, a smoke test of every side and table: under 2 minutes):

    PYTHONPATH=. .venv/bin/python benchmarks/long_tail.py --json long_tail.json
    PYTHONPATH=. .venv/bin/python benchmarks/long_tail.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/long_tail.py --workloads single --lengths longtail --sides batch continuous
    PYTHONPATH=. .venv/bin/python benchmarks/long_tail.py --engine vllm --json long_tail_vllm.json
    PYTHONPATH=. .venv/bin/python benchmarks/long_tail.py --engine vllm --quick
    # the measured runs (benchmarks/RESULTS.md), 1-2 minutes a workload on 2 quiet cores (k = 1, 3 and 6 earlier)
    PYTHONPATH=. .venv/bin/python benchmarks/long_tail.py --sides batch continuous --k 8 --groups_in_flight 64 \
        --continuous_rows 128 --rows 240 --steps 28 --workloads multi --lengths longtail --json k8.json

The benchmark sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads, for every side, unless the environment already
names a policy: the continuous side decodes on a thread of its own while training runs, each with an OpenMP team,
and OpenMP's idle threads otherwise spin, taking the 2 cores from each other (``OMP_WAIT_POLICY=ACTIVE`` measures
the default; the header line and the JSON name the policy).

``--engine vllm --quick`` took 151 s on this 2-core machine, shared (load average 4-5), 86 s of it the server's
start (the measured runs: benchmarks/RESULTS.md). There the server and the trainer share the cores: while the server
decodes, the trainer's steps slow (``train s``), and the continuous side generates while the trainer trains.

Timings depend on what else runs on the machine: every progress line (stderr) carries ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (ROOT, HERE):  # run from anywhere without PYTHONPATH; timing.py and long_tail_env.py beside it
    if path not in sys.path:
        sys.path.insert(0, path)

os.environ.setdefault("ACCELERATE_USE_CPU", "true")
from timing import passive_openmp  # noqa: E402  (benchmarks/timing.py)

passive_openmp()  # before torch loads OpenMP; both sides run under it

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from verifiers_rl.config.rl_config import RLConfig  # noqa: E402
from verifiers_rl.core.models import build_tiny_model, resolve_model, smollm2_dir  # noqa: E402
from verifiers_rl.core.rollout import NOT_SAMPLED  # noqa: E402
from verifiers_rl.envs.parsers import Parser  # noqa: E402
from verifiers_rl.inference.embedded import running_batch  # noqa: E402
from verifiers_rl.inference.factory import build_engine  # noqa: E402
from verifiers_rl.rollouts.generator import AsyncGenerator  # noqa: E402
from verifiers_rl.training.trainer import RLTrainer  # noqa: E402
from long_tail_env import build_env, force_lengths  # noqa: E402  (benchmarks/long_tail_env.py)
import long_tail_vllm  # noqa: E402  (benchmarks/long_tail_vllm.py)
from steps import StepRecorder, grpo_settings, watch_ours  # noqa: E402  (benchmarks/steps.py)
from timing import (  # noqa: E402  (benchmarks/timing.py)
    at_least, fill_in, load, log, model_name, once_each, quiet_start, writable_file,
)

SIDES = ("batch", "continuous", "groups", "trl")
DEFAULT_SIDES = {"embedded": ["batch", "continuous", "trl"], "vllm": ["batch", "continuous"]}
ENGINES = {"embedded": "embedded engine", "vllm": "vLLM server"}  # how the tables name each
EOS = {"embedded": "its eos list replaced by an id no token has", "vllm": 'every request "ignore_eos": true'}
DEFAULTS = dict(hidden=256, layers=4, rows=80, prompts=8, num_generations=4, median_tokens=16, steps=8, warmup=2)
QUICK = dict(hidden=64, layers=2, rows=20, prompts=4, num_generations=2, median_tokens=8, steps=2, warmup=1)
FIELDS = {"continuous": ("groups_in_flight", "continuous_batching_rows"), "groups": ("groups_in_flight",)}
VLLM_FIELDS = {"continuous": ("groups_in_flight",)}  # the server batches continuously itself
NO_TOKEN = -1  # an eos id no token has: every row decodes its asked length
DECODE_ROWS: list[int] = []  # rows of every decode step the engine ran in the current run (see instrument())


def fields_of(side: str, engine: str) -> tuple[str, ...]:
    """The RLConfig fields that make ``side`` on ``engine``."""
    return (VLLM_FIELDS if engine == "vllm" else FIELDS).get(side, ())


def missing_fields(side: str, engine: str = "embedded") -> list[str]:
    """The RLConfig fields ``side`` needs that this checkout's RLConfig lacks."""
    names = {f.name for f in dataclasses.fields(RLConfig)}
    return [name for name in fields_of(side, engine) if name not in names]


def steps_of(lengths: list[int]) -> list[int]:
    """Rows per decode step of one batch decoded to its end: it steps until its longest row ends (each row's first
    token from its prompt's forward), row r runs in its first length_r - 1 steps."""
    return [sum(n - 1 > step for n in lengths) for step in range(max(lengths, default=1) - 1)]


def instrument(engine) -> None:
    """Count the rows of every decode step: the batch engine's batches from their sample lengths (its ``_decode``
    seam), the running batch's from its own ``stats.rows_per_step`` (every ``RunningBatch.step``, wherever built)."""
    if hasattr(engine, "_decode"):
        decode = engine._decode

        def counted(*args, **kwargs):
            samples = decode(*args, **kwargs)
            DECODE_ROWS.extend(steps_of([len(s.token_ids) for s in samples]))
            return samples

        engine._decode = counted
    if not getattr(running_batch.RunningBatch.step, "counted", False):
        step = running_batch.RunningBatch.step

        def counted_step(self):
            before = len(self.stats.rows_per_step)
            out = step(self)
            DECODE_ROWS.extend(self.stats.rows_per_step[before:])
            return out

        counted_step.counted = True
        running_batch.RunningBatch.step = counted_step


class RunRecorder(StepRecorder):
    """Per step: the trained rollouts' rows and sampled tokens, the staleness of every trained token, and where the
    decode-step counter stood (ours); TRL's completion lengths per generation (filled in by ``run_trl``)."""

    def __init__(self, warmup: int, server_url: str | None = None):
        super().__init__()
        self.warmup = warmup
        self.trainer = None
        self.server_url = server_url  # vLLM: occupancy from the server's counters at the timed window's ends
        self.counters: list[dict[str, float]] = []
        self.tokens: list[int] = []  # sampled completion tokens trained at each step
        self.rows: dict[int, int] = {}  # row -> sampled tokens of each of its rollouts
        self.lag: Counter = Counter()  # over the timed steps: versions between a token's sampler and trainer
        self.decode_mark = 0  # DECODE_ROWS's length when the timed steps began
        self.window_rows: list[int] = []  # rows of each decode step over the timed window (at the last step)
        self.trl_lengths: list[list[int]] = []  # TRL: completion lengths of each generation
        self.trl_gen_s: list[float] = []  # TRL: seconds of each generation (and scoring)
        self.stale_dropped = 0.0  # continuous: groups dropped as staler than the bound (regenerated), timed steps
        self.parts: dict[str, list[float]] = {"wait": [], "train": [], "weight_sync": []}  # timed steps, as logged

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        DECODE_ROWS.clear()
        if self.server_url:
            self.counters = [long_tail_vllm.counters(self.server_url)]

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if state.global_step == self.warmup:
            self.decode_mark = len(DECODE_ROWS)
            if self.server_url:
                self.counters[:1] = [long_tail_vllm.counters(self.server_url)]
        if state.global_step == args.max_steps:
            # DECODE_ROWS is every side's in turn (cleared as the next begins): keep this run's timed window now
            self.window_rows = DECODE_ROWS[self.decode_mark:]
            if self.server_url:
                self.counters[1:] = [long_tail_vllm.counters(self.server_url)]
        if self.trainer is None:  # TRL: sampled on-policy, lengths recorded per generation
            self.tokens.append(sum(self.trl_lengths[-1]))
            if state.global_step > self.warmup:
                self.lag[0] += self.tokens[-1]
            return
        trained = state.global_step - 1  # the version of the weights this step trained
        total = 0
        for rollout in self.trainer.steps.latest_rollouts:
            sampled = sum(rollout.completion_mask)
            asked = int(rollout.metrics["asked_tokens"])
            if sampled != asked:
                raise SystemExit(f"step {state.global_step}: a rollout of row {int(rollout.metrics['row'])} sampled "
                                 f"{sampled} tokens, its row asks {asked}: the comparison is void")
            self.rows[int(rollout.metrics["row"])] = sampled
            total += sampled
            if state.global_step > self.warmup:
                versions = rollout.completion_versions or [
                    rollout.policy_version if m else NOT_SAMPLED for m in rollout.completion_mask]
                self.lag.update(trained - v for v, m in zip(versions, rollout.completion_mask)
                                if m and v != NOT_SAMPLED)
        self.tokens.append(total)

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=logs, **kwargs)
        if logs and state.global_step > self.warmup:
            self.stale_dropped += float(logs.get("groups_stale_dropped", 0.0))
            for part in self.parts:
                if f"{part}_time" in logs:
                    self.parts[part].append(float(logs[f"{part}_time"]))


def common(args, out: str, env) -> dict:
    """What our trainer and TRL's share (vs_trl.py's settings at learning rate 0)."""
    return grpo_settings(out, args.warmup + args.steps, 0.0, args.prompts * args.num_generations,
                         args.num_generations, env.max_new_tokens)


def run_ours(args, model_dir, tokenizer, env, side: str, out: str, server_url: str | None = None) -> RunRecorder:
    values = {"groups_in_flight": args.groups_in_flight, "continuous_batching_rows": args.continuous_rows}
    extra = {name: values[name] for name in fields_of(side, args.engine)}
    if server_url:  # a server lost mid-run voids the run: no reconnection (nor its reference probe per load)
        extra.update(vllm_server_url=server_url, vllm_reconnect_timeout_s=0.0)
    config = RLConfig(**common(args, out, env), rollouts_per_step=args.prompts * args.num_generations,
                      max_seq_len=env.max_seq_len, max_off_policy_steps=args.k, generation_timeout_s=300.0,
                      **extra)
    engine = build_engine(config, model_dir, tokenizer)
    if server_url:
        long_tail_vllm.ignore_eos(engine)  # every row decodes its asked length
        long_tail_vllm.reset_prefix_cache(engine)
    elif not hasattr(engine, "eos_token_ids"):
        raise SystemExit(f"{type(engine).__name__}: no eos list to suppress; --engine embedded needs our embedded "
                         "engine")
    else:
        engine.eos_token_ids[:] = [NO_TOKEN]  # the list its decoders hold: every row decodes its asked length
        instrument(engine)
    recorder = RunRecorder(args.warmup, server_url)
    trainer = RLTrainer(model_dir, config, processing_class=tokenizer, environment=env, engine=engine)
    watch_ours(trainer, recorder)
    try:
        trainer.train()
    finally:
        engine.close()
    return recorder


def trl_variety(completions, **kwargs) -> list[float]:
    """long_tail_env.variety in TRL's calling convention (conversational completions)."""
    parser = Parser()
    out = []
    for completion in completions:
        text = parser.parse_answer(completion) or ""
        out.append(len(set(text)) / max(len(text), 1))
    return out


def run_trl(args, model_dir, tokenizer, env, out: str) -> tuple[RunRecorder, list[list[int]]]:
    """TRL on our generator's prompts in its order; also the lengths each of its generations must have."""
    order = AsyncGenerator(env, engine=None, rollouts_per_step=args.prompts * args.num_generations,
                           num_generations=args.num_generations, seed=0)
    batches = [[env.dataset[i] for _, i in order._rows_of(b)] for b in range(args.warmup + args.steps)]
    totals = {row.info["row"]: sum(row.info["lengths"]) for row in env.dataset}
    expected = [sorted(totals[row.info["row"]] for row in batch for _ in range(args.num_generations))
                for batch in batches]
    dataset = Dataset.from_list([{"prompt": row.prompt} for batch in batches for row in batch])
    config = GRPOConfig(**common(args, out, env), steps_per_generation=1, use_vllm=False, shuffle_dataset=False,
                        log_completions=False, mask_truncated_completions=False)
    recorder = RunRecorder(args.warmup)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=trl_variety, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    gen = trainer.model.generation_config.eos_token_id
    eos = sorted({*([gen] if isinstance(gen, int) else gen or []), tokenizer.eos_token_id} - {None})
    force_lengths(trainer.model, tokenizer, totals, eos)
    generate = trainer._generate_and_score_completions

    def recorded(*a, **kw):
        started = time.perf_counter()
        result = generate(*a, **kw)
        recorder.trl_gen_s.append(time.perf_counter() - started)
        lengths = [int(m.sum()) for m in result["completion_mask"]]
        recorder.trl_lengths.append(lengths)
        DECODE_ROWS.extend(steps_of(lengths))
        return result

    trainer._generate_and_score_completions = recorded
    trainer.train()
    return recorder, expected


def check_equal(runs: dict, expected_trl) -> None:
    """A row trained on two of our sides has the same length on both; TRL's generations have their rows' lengths."""
    ours = {side: r.rows for side, r in runs.items() if side != "trl"}
    for a in ours:
        for b in ours:
            bad = [row for row in ours[a].keys() & ours[b].keys() if ours[a][row] != ours[b][row]]
            if bad:
                raise SystemExit(f"rows {bad[:10]} have different lengths on {a} and {b}: the comparison is void")
    if "trl" in runs:
        got = [sorted(lengths) for lengths in runs["trl"].trl_lengths]
        if got != expected_trl[: len(got)] or len(got) != len(expected_trl):
            raise SystemExit("TRL's completion lengths are not its rows' asked lengths: the comparison is void")


def occupancy_of(recorder: RunRecorder) -> dict:
    """Decode steps over the timed window and the mean rows each ran (vLLM: engine steps, from its counters)."""
    if recorder.server_url:
        steps, rows_per_step = long_tail_vllm.occupancy(*recorder.counters)
        return {"decode_steps": steps, "rows_per_step": rows_per_step}
    rows = recorder.window_rows
    return {"decode_steps": len(rows), "rows_per_step": statistics.mean(rows) if rows else float("nan")}


def summarise(args, recorder: RunRecorder) -> dict:
    timed = recorder.intervals()[args.warmup:]
    tokens = recorder.tokens[args.warmup:]
    lag_total = sum(recorder.lag.values()) or 1
    parts = recorder.parts
    if recorder.trainer is None:  # TRL generates, then trains: its wait is its generation
        gen = recorder.trl_gen_s[args.warmup:]
        parts = {"wait": gen, "train": [step - g for step, g in zip(timed, gen)], "weight_sync": []}
    median = lambda values: statistics.median(values) if values else float("nan")  # noqa: E731
    return {
        "step_s": timed, "tokens_per_step": tokens, "step_s_median": statistics.median(timed), "step_s_min": min(timed),
        "step_s_max": max(timed), "tokens": sum(tokens), "tokens_per_s": sum(tokens) / sum(timed),
        "run_tokens_per_s": sum(recorder.tokens) / sum(recorder.intervals()),
        **occupancy_of(recorder),
        "lag": {int(k): v / lag_total for k, v in sorted(recorder.lag.items())},
        "rows_trained": len(recorder.rows) if recorder.trainer is not None else None,
        "groups_stale_dropped": recorder.stale_dropped,
        "wait_s_median": median(parts["wait"]), "train_s_median": median(parts["train"]),
        "sync_s_median": median(parts["weight_sync"]),
        "cores": recorder.cores(args.warmup),
    }


def run_case(args, model_dir, tokenizer, turns: int, lengths: str, sides: list[str], flip: bool,
             server_url: str | None = None) -> dict:
    def env():
        return build_env(tokenizer, args.rows, args.median_tokens, args.tail_fraction, args.tail_factor, lengths,
                         turns)

    case = "single" if turns == 1 else f"multi ({turns} turns)"
    runs, expected_trl = {}, None
    for side in (sides[::-1] if flip else sides):
        log(f"[{case}, {lengths}] [{side}] {args.warmup} warm-up + {args.steps} timed steps (load {load()}) ...")
        out = tempfile.mkdtemp(prefix=f"bench_long_tail_{side}_")
        with contextlib.redirect_stdout(sys.stderr):  # the trainers' progress lines; the tables go to stdout
            if side == "trl":
                runs[side], expected_trl = run_trl(args, model_dir, tokenizer, env(), out)
            else:
                runs[side] = run_ours(args, model_dir, tokenizer, env(), side, out, server_url)
        timed = runs[side].intervals()[args.warmup:]
        log(f"[{case}, {lengths}] [{side}] {sum(timed):.1f} s for {len(timed)} steps "
            f"({', '.join(f'{s:.2f}' for s in timed)}); load {load()}")
    check_equal(runs, expected_trl)
    totals = [sum(r.info["lengths"]) for r in env().dataset]
    return {"workload": case, "turns": turns, "lengths": lengths, "engine": args.engine,
            "asked": {"median": statistics.median(totals), "mean": statistics.mean(totals), "max": max(totals)},
            "sides": {side: summarise(args, runs[side]) for side in sides}}


def warm_up(args, model_dir, tokenizer, case: tuple[int, str], side: str, server_url: str | None) -> None:
    """One untimed step of the first case's first side before any side runs: the process's one-off costs (the first
    forwards, thread pools, allocations) fell in that side's first step (2.4 s against 0.17 s for the next side in a
    --quick run), which tilted the whole-run ratios of the first case towards the side run second."""
    turns, lengths = case
    env = build_env(tokenizer, args.rows, args.median_tokens, args.tail_fraction, args.tail_factor, lengths, turns)
    once = argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0})
    log(f"warm-up: one untimed step of [{side}] (load {load()}) ...")
    with contextlib.redirect_stdout(sys.stderr):
        run_ours(once, model_dir, tokenizer, env, "batch" if side == "trl" else side,
                 tempfile.mkdtemp(prefix="bench_long_tail_warm_"), server_url)


def print_case(result: dict) -> None:
    asked = result["asked"]
    print(f"\n**{result['workload']}, {result['lengths']}, {ENGINES[result['engine']]}** (tokens per episode: median "
          f"{asked['median']:.0f}, mean {asked['mean']:.1f}, max {asked['max']})\n")
    print("| side | s/step (median) | s/step (min-max) | wait s | sync s | train s | tokens trained | tokens/s | "
          "x batch (tokens/s) | whole run tokens/s | x batch (whole run) | decode steps | rows/step | "
          "lag (share of trained tokens) | stale groups dropped | rows trained | cores busy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    base = result["sides"].get("batch")
    nan = lambda v: "n/a" if v != v else f"{v:.2f}"  # noqa: E731  (NaN: TRL loads no weights; no decode step)
    for side, s in result["sides"].items():
        ratio = f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "n/a"
        run_ratio = f"{s['run_tokens_per_s'] / base['run_tokens_per_s']:.2f}x" if base else "n/a"
        lag = ", ".join(f"{k}: {v:.0%}" for k, v in s["lag"].items())
        print(f"| {side} | {s['step_s_median']:.2f} | {s['step_s_min']:.2f}-{s['step_s_max']:.2f} | "
              f"{s['wait_s_median']:.2f} | {nan(s['sync_s_median'])} | {s['train_s_median']:.2f} | {s['tokens']} | "
              f"{s['tokens_per_s']:.1f} | {ratio} | {s['run_tokens_per_s']:.1f} | {run_ratio} | "
              f"{s['decode_steps']} | {nan(s['rows_per_step'])} | {lag} | "
              f"{s['groups_stale_dropped']:.0f} | "
              f"{'-' if s['rows_trained'] is None else s['rows_trained']} | {s['cores']:.2f} |")
    idle = [side for side, s in result["sides"].items() if s["decode_steps"] == 0]
    if idle:
        print(f"\n{', '.join(idle)}: no decode step in the timed window (its groups were all generated before it): "
              f"its timed tokens/s is training alone; the whole run is the equal-work comparison.")


def print_ratios(results: list[dict]) -> None:
    """Each side's completion tokens/s and median s/step over batch's, measured in the same run."""
    others = [side for side in SIDES if side != "batch" and any(side in r["sides"] for r in results)]
    if not others or not any("batch" in r["sides"] for r in results):
        return
    print(f"\nAgainst batch-at-a-time, same run, {ENGINES[results[0]['engine']]} (tokens/s ratio over the timed steps "
          "and over the whole run; median s/step ratio, batch / side):\n")
    print("| workload | lengths | " + " | ".join(f"{side} / batch tokens/s | (whole run) | batch / {side} s/step"
                                                 for side in others) + " |")
    print("|---|---|" + "---:|---:|---:|" * len(others))
    for r in results:
        base = r["sides"].get("batch")
        if base is None:
            continue
        cells = []
        for side in others:
            s = r["sides"].get(side)
            cells += ["n/a"] * 3 if s is None else [f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                                                    f"{s['run_tokens_per_s'] / base['run_tokens_per_s']:.2f}x",
                                                    f"{base['step_s_median'] / s['step_s_median']:.2f}x"]
        print(f"| {r['workload']} | {r['lengths']} | " + " | ".join(cells) + " |")


def our_settings(args) -> str:
    """The header's words on our sides' settings: those of the sides that run (TRL's side takes none of them)."""
    ours = [side for side in args.sides if side != "trl"]
    if not ours:
        return "TRL's side alone"
    text = f"our sides on the {ENGINES[args.engine]} (eos: {EOS[args.engine]}), k = {args.k}"
    ahead = [side for side in ours if side in FIELDS]
    if ahead:
        text += f", {' and '.join(ahead)}: groups_in_flight {args.groups_in_flight}"
    if "continuous" in ahead:
        text += (f", continuous_batching_rows {args.continuous_rows}" if args.engine == "embedded" else
                 ", the server batching continuously itself")
    return text


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (a random Llama of --hidden x --layers), 'smollm2' or a model folder")
    parser.add_argument("--hidden", type=int, default=None, help="tiny model only (256; --quick 64)")
    parser.add_argument("--layers", type=int, default=None, help="tiny model only (4; --quick 2)")
    parser.add_argument("--workloads", nargs="+", choices=["single", "multi"], default=["single", "multi"])
    parser.add_argument("--lengths", nargs="+", choices=["longtail", "uniform"], default=["longtail", "uniform"])
    parser.add_argument("--engine", choices=list(ENGINES), default="embedded",
                        help="our sides generate with the embedded engine, or through a vLLM server this benchmark "
                        "starts from the model folder (.venv-vllm) and stops at the end; vllm runs batch and "
                        "continuous (--groups_in_flight alone: the server batches continuously itself)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=None,
                        help="default: batch continuous trl (--engine vllm: batch continuous); groups (not by "
                        "default): --groups_in_flight alone, the engine batching as today")
    parser.add_argument("--turns", type=int, default=None, help="model turns of the multi-turn workload (3)")
    parser.add_argument("--rows", type=int, default=None, help="prompts in the dataset (80; --quick 20)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per optimizer step (8; --quick 4)")
    parser.add_argument("--num_generations", type=int, default=None, help="(4; --quick 2)")
    parser.add_argument("--median_tokens", type=int, default=None, help="(16; --quick 8)")
    parser.add_argument("--tail_fraction", type=float, default=0.1)
    parser.add_argument("--tail_factor", type=int, default=8)
    parser.add_argument("--k", type=int, default=None, help="max_off_policy_steps of our sides (1)")
    parser.add_argument("--groups_in_flight", type=int, default=None, help="continuous: default 2 x --prompts")
    parser.add_argument("--continuous_rows", type=int, default=None,
                        help="continuous: --continuous_batching_rows, default the rollouts of one step")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per side (8; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps at the start of each side's run (2; --quick 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--json", default=None, help="also write every number (and each step's time) here")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test of every side and table: tiny model 64 x 2, 20 rows, 4 x 2 per step, "
                        "median 8, 1 warm-up + 2 timed steps")
    args = parser.parse_args(argv)
    if args.sides is None:
        args.sides = list(DEFAULT_SIDES[args.engine])
    unused = {"--hidden": args.model != "tiny" and (args.hidden, args.layers) != (None, None),
              "--turns": "multi" not in args.workloads and args.turns is not None,
              "--groups_in_flight": args.groups_in_flight is not None and not {"continuous", "groups"} & {*args.sides},
              "--continuous_rows": "continuous" not in args.sides and args.continuous_rows is not None,
              "--k": args.k is not None and not {"batch", "continuous", "groups"} & {*args.sides}}
    for flag, given in unused.items():
        if given:
            parser.error(f"{flag} does not act here: --hidden/--layers shape the tiny model only, --turns the multi "
                         "workload, --groups_in_flight the continuous and groups sides, --continuous_rows the "
                         "continuous side, --k our sides (all but trl)")
    if args.engine == "vllm":
        refused = {"--continuous_rows": (args.continuous_rows is not None, "--continuous_batching_rows sets the "
                                         "embedded engine's running batch; a vLLM server batches continuously "
                                         "itself, so its continuous side is --groups_in_flight alone"),
                   "--sides trl": ("trl" in args.sides, "TRL's side generates on its policy (generate), never "
                                   "through our vLLM server: run it with --engine embedded"),
                   "--sides groups": ("groups" in args.sides, "on a vLLM server it is the continuous side "
                                      "(--groups_in_flight alone)")}
        for flag, (given, reason) in refused.items():
            if given:
                parser.error(f"{flag} does not combine with --engine vllm: {reason}")
    fill_in(args, QUICK if args.quick else DEFAULTS)
    args.turns = 3 if args.turns is None else args.turns
    args.k = 1 if args.k is None else args.k
    if args.groups_in_flight is None:
        args.groups_in_flight = 2 * args.prompts
    if args.continuous_rows is None and args.engine == "embedded":
        args.continuous_rows = args.prompts * args.num_generations
    at_least(parser, args, 1, "groups_in_flight", "continuous_rows", why="0 is batch-at-a-time: the batch side")
    at_least(parser, args, 1, "rows", "prompts", "num_generations", "steps", "turns", "threads", "tail_factor")
    at_least(parser, args, 2, "median_tokens")
    at_least(parser, args, 0, "warmup")
    once_each(parser, args, "workloads", "lengths", "sides")
    # The continuous and groups sides generate while the trainer trains, a batch up to k >= 1 steps old; batch: k 0.
    ahead = [side for side in args.sides if side in FIELDS]
    why = f"the {ahead[0]} side generates while the trainer trains (k 0: --sides batch)" if ahead else ""
    at_least(parser, args, 1 if ahead else 0, "k", why=why)
    if not 0 <= args.tail_fraction <= 1:
        parser.error(f"--tail_fraction must be in [0, 1] (got {args.tail_fraction})")
    if args.rows < args.prompts:
        parser.error("--rows must be >= --prompts (one step's prompts)")
    writable_file(parser, args.json, "--json")
    model_name(parser, args.model)
    return args


@contextlib.contextmanager
def serve(args, model_dir: str, tokenizer, cases: list[tuple[int, str]]):
    """``--engine vllm``: a vLLM server of ``model_dir`` for the whole run (its URL; long enough for every case's
    episodes), stopped at the end; ``embedded``: None."""
    if args.engine != "vllm":
        yield None
        return
    longest = max(build_env(tokenizer, args.rows, args.median_tokens, args.tail_fraction, args.tail_factor, lengths,
                            turns).max_seq_len for turns, lengths in cases)
    with long_tail_vllm.served(model_dir, max(longest, 512)) as server:
        yield server.url


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = quiet_start()
    if args.model == "tiny":
        model_dir = os.path.join(tempfile.mkdtemp(prefix="bench_long_tail_"), "model")
        build_tiny_model(model_dir, hidden_size=args.hidden, num_layers=args.layers)
        name = f"random Llama hidden {args.hidden} x {args.layers} layers"
    else:
        model_dir = str(smollm2_dir()) if args.model == "smollm2" else resolve_model(args.model)
        name = args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sides = list(args.sides)
    notes = []
    for side in [s for s in sides if missing_fields(s, args.engine)]:
        sides.remove(side)
        notes.append(f"{side}: not run, RLConfig has no {' / '.join(missing_fields(side, args.engine))} yet")
    cases = [(1 if w == "single" else args.turns, lengths) for w in args.workloads for lengths in args.lengths]
    results = []
    with serve(args, model_dir, tokenizer, cases) as server_url:
        warm_up(args, model_dir, tokenizer, cases[0], sides[0], server_url)
        for turns, lengths in cases:
            case_sides = [s for s in sides if s != "trl" or turns == 1]
            if turns > 1 and "trl" in sides:
                notes.append("trl: single-turn only (TRL's GRPOTrainer cannot run our multi-turn environment)")
            results.append(run_case(args, model_dir, tokenizer, turns, lengths, case_sides, len(results) % 2 == 1,
                                    server_url))
    elapsed = time.perf_counter() - started
    log(f"load average at end: {load()}")
    print(f"\nLong-tail benchmark through the trainer: {name}, {args.rows} prompts, {args.prompts} prompts x "
          f"{args.num_generations} samples per step, median {args.median_tokens} tokens, {args.tail_fraction:.0%} of "
          f"prompts at {args.tail_factor}x, learning rate 0, eos suppressed (every row decodes its asked length, "
          f"checked), {our_settings(args)}; {args.steps} timed steps after {args.warmup} "
          f"warm-up per side, {args.threads} torch threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, CPU "
          f"({os.cpu_count()} cores). Total {elapsed:.0f} s; load average at end {load()}.")
    for note in dict.fromkeys(notes):
        print(f"- {note}")
    for result in results:
        print_case(result)
    print_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "notes": list(dict.fromkeys(notes)), "seconds": elapsed,
                       "cpu_count": os.cpu_count(), "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                       "load_average_end": os.getloadavg(), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
