"""Episodes per second through a verifiers 0.4 (v1) environment against the same task as one of our own.

What it measures: one batch (``--groups`` groups x ``--group_size`` rollouts, every group at once through
``asyncio.gather``, as the trainer's generator runs a batch) of the reversal task of ``tests/v1/envs/reverse_v1.py``
(a taskset written from ``vf-init``'s template; prompt "Reverse the text: <word>", reward 1 when the reply, stripped,
is the reversed word), run three ways on one ``EmbeddedEngine``:

- ``ours``: a ``SingleTurnEnv`` whose rows are the v1 taskset's prompts and answers (read from the v1 side, so
  they are the same by construction) with the same reward, all in this process;
- ``v1 inprocess``: ``V1Env`` with ``harness="inprocess"``: v1's episodes run in the worker process (the
  ``.venv-verifiers-v1`` venv, JSON lines over a pipe); the harness's model call goes over loopback HTTP to v1's
  interception server, whose train client renders the prompt and calls our endpoint over loopback HTTP
  (``inference/generate_endpoint.py``); the taskset scores the trace;
- ``v1 null``: the same with v1's default chat harness, which runs each episode's chat program in a subprocess of
  its own (``uv sync --script``, then a Python interpreter) talking to v1's interception server.

The work is equal on every side, and checked: both render the same chat template and rollout i of a group samples
under the seed ``derive_seed(group seed, i)`` on every side, so the engine samples the same tokens; every repeat
asserts that each rollout's prompt ids, completion ids and reward are the same on all sides. What differs is only
the machinery around the model call. Each side runs one untimed warm-up batch, then ``--repeats`` timed batches,
the sides interleaved within each repeat (their order rotating) so that load from elsewhere hits them alike.
Reported per side: the median seconds per batch, episodes/s and completion tokens/s at that median, the engine's
``generate`` calls per batch (concurrent requests that reach the engine together share one call; requests that
arrive spread out over HTTP make more, smaller calls), CPU seconds per batch of this process and of the worker
with its subprocesses, and each side's time against ours.

Run (about 2 minutes each on 2 cores; the null side takes most of it; ``--model smollm2`` with the defaults took
9 minutes on a busy machine, hence the small settings below):

    PYTHONPATH=. .venv/bin/python benchmarks/v1_episodes.py
    PYTHONPATH=. .venv/bin/python benchmarks/v1_episodes.py --model smollm2 --groups 4 --group_size 4 --max_new_tokens 16

Needs ``scripts/install_verifiers_v1.sh`` (the v1 venv and uv). Progress lines (stderr) carry the load average.
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

os.environ.setdefault("ACCELERATE_USE_CPU", "true")

import torch  # noqa: E402

from verifiers_rl.envs import Rubric, SingleTurnEnv, derive_seed, load_environment  # noqa: E402
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig  # noqa: E402
from verifiers_rl.core.models import load_tokenizer, resolve_model  # noqa: E402
from timing import at_least, load, log, quiet_start  # noqa: E402  (benchmarks/timing.py)

V1_ENV = os.path.join(ROOT, "tests", "v1", "envs", "reverse_v1.py")
SIDES = ("ours", "v1 inprocess", "v1 null")
WHAT_DIFFERS = {
    "ours": "SingleTurnEnv in this process: render, engine.sample, decode, rubric",
    "v1 inprocess": "+ the worker process (JSON lines over a pipe); per model call two loopback HTTP hops (the "
                    "harness's OpenAI client -> v1's interception server -> v1's train client -> our endpoint); v1 "
                    "renders and scores",
    "v1 null": "+ per episode a subprocess (uv sync --script, then a Python chat program) calling the interception server",
}


def exact_reversal(completion, answer, parser) -> float:
    """reverse_v1.py's reward: 1 when the reply, stripped, is the reversed word."""
    return float((parser.parse_answer(completion) or "") == answer)  # Parser.parse strips, as the v1 reward does


def worker_cpu_s(env) -> float:
    """CPU seconds of the v1 worker and of the children it has waited for (each null episode's subprocess tree)."""
    process = getattr(getattr(env, "worker", None), "process", None)
    if process is None:
        return 0.0
    with open(f"/proc/{process.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after the name
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def run_batch(loop, env, engine, rows, group_size: int, seeds: list[int]):
    """One batch, every group at once; returns (rollouts per group, wall s, this process's CPU s, worker CPU s,
    engine generate calls)."""
    async def batch():
        return await asyncio.gather(*(env.rollout_group(engine, row, f"g{i}", group_size, seed=seed)
                                      for i, (row, seed) in enumerate(zip(rows, seeds))))

    calls, cpu, worker = engine.generate_calls, time.process_time(), worker_cpu_s(env)
    start = time.perf_counter()
    groups = loop.run_until_complete(batch())
    wall = time.perf_counter() - start
    return groups, wall, time.process_time() - cpu, worker_cpu_s(env) - worker, engine.generate_calls - calls


def same_work(batches: dict[str, list]) -> None:
    """Every side's rollout (group g, rollout i) has the same prompt ids, completion ids and reward as ours."""
    ours = batches["ours"]
    for side, groups in batches.items():
        for g, (mine, theirs) in enumerate(zip(ours, groups)):
            for i, (a, b) in enumerate(zip(mine, theirs)):
                where = f"{side}, group {g}, rollout {i}"
                assert a.prompt_ids == b.prompt_ids, f"{where}: prompt ids differ from ours"
                assert a.completion_ids == b.completion_ids, f"{where}: completion ids differ from ours"
                assert a.reward == b.reward, f"{where}: reward {b.reward} != ours {a.reward}"


def ratio(x: float) -> str:
    """Two decimals, or two significant digits below 0.1 (a null episode can be hundreds of times slower)."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--max_seq_len", type=int, default=256)
    parser.add_argument("--groups", type=int, default=8, help="groups per batch (one task each)")
    parser.add_argument("--group_size", type=int, default=4, help="rollouts per group")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per side")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # Checked before the v1 worker starts: --repeats 0 or --groups 0 ran the warm-up, then failed on an empty median.
    at_least(parser, args, 1, "max_new_tokens", "groups", "group_size", "repeats")
    if args.max_seq_len <= args.max_new_tokens:
        parser.error(f"--max_seq_len ({args.max_seq_len}) must exceed --max_new_tokens ({args.max_new_tokens}): the "
                     "prompt needs room")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)

    started = quiet_start()
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    engine = EmbeddedEngine(model_dir, tokenizer,
                            sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens))
    envs = {}
    for side, harness in (("v1 inprocess", "inprocess"), ("v1 null", "null")):
        log(f"loading {side} (load {load()}) ...")
        envs[side] = load_environment(V1_ENV, tokenizer=tokenizer, harness=harness,
                                      taskset={"num_tasks": args.groups})
    # Our rows are the tasks the v1 worker loaded: the same prompts and answers by construction.
    v1_rows = envs["v1 inprocess"].dataset
    envs["ours"] = SingleTurnEnv([{"prompt": row.prompt, "answer": row.answer} for row in v1_rows],
                                 Rubric([exact_reversal]), tokenizer, name="reverse_ours")
    for env in envs.values():
        env.adopt_limits(max_seq_len=args.max_seq_len, max_new_tokens=args.max_new_tokens)
    rows = {side: env.dataset for side, env in envs.items()}
    assert all(len(r) == args.groups for r in rows.values()), {side: len(r) for side, r in rows.items()}
    loop = asyncio.new_event_loop()  # one loop for every batch, as the generator's thread keeps

    results = {side: [] for side in SIDES}  # (wall, cpu, worker cpu, generate calls, completion tokens)
    try:
        for repeat in range(-1, args.repeats):  # repeat -1 is the warm-up
            seeds = [derive_seed(args.seed, "v1_episodes", repeat, g) for g in range(args.groups)]
            batches = {}
            order = SIDES[repeat % 3:] + SIDES[:repeat % 3]  # rotate, so no side always runs first
            for side in order:
                groups, wall, cpu, worker, calls = run_batch(loop, envs[side], engine, rows[side], args.group_size,
                                                             seeds)
                batches[side] = groups
                tokens = sum(len(r.completion_ids) for group in groups for r in group)
                log(f"[{'warm-up' if repeat < 0 else f'repeat {repeat + 1}/{args.repeats}'}] {side}: {wall:.2f} s, "
                    f"{tokens} completion tokens, {calls} generate calls (load {load()})")
                if repeat >= 0:
                    results[side].append((wall, cpu, worker, calls, tokens))
            same_work({side: batches[side] for side in SIDES})
    finally:
        for side in ("v1 inprocess", "v1 null"):
            envs[side].close()
        engine.close()
        loop.close()
    elapsed = time.perf_counter() - started
    log(f"load average at end: {load()}")

    episodes = args.groups * args.group_size
    rewards = [r.reward for group in batches["ours"] for r in group]
    print(f"\nreverse_v1 ({V1_ENV.removeprefix(ROOT + os.sep)}) tasks, {args.model} model ({model_dir}), one "
          f"EmbeddedEngine (temperature 1.0, max_new_tokens {args.max_new_tokens}, torch threads "
          f"{torch.get_num_threads()}), {args.groups} groups x {args.group_size} = {episodes} episodes per batch "
          f"(all groups at once), {args.repeats} timed batches per side after one warm-up, sides interleaved; CPU "
          f"({os.cpu_count()} cores). Same prompt ids, completion ids and reward on every side for every rollout "
          f"(asserted each repeat); mean reward of the last batch {statistics.mean(rewards):.2f}. "
          f"Total {elapsed:.0f} s; load average at end {load()}.\n")
    print("| side | what runs besides the engine | completion tokens / batch | median s / batch | episodes/s "
          "| completion tokens/s | generate calls / batch | CPU s / batch: this process, worker (+ children) "
          "| s / batch vs ours | episodes/s vs ours |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(w for w, *_ in results["ours"])
    for side in SIDES:
        walls = [w for w, *_ in results[side]]
        wall = statistics.median(walls)
        tokens = statistics.median(t for *_, t in results[side])
        calls = statistics.mean(c for _, _, _, c, _ in results[side])
        cpu = statistics.mean(c for _, c, *_ in results[side])
        worker = statistics.mean(w for _, _, w, *_ in results[side])
        print(f"| {side} | {WHAT_DIFFERS[side]} | {tokens:.0f} | {wall:.2f} ({min(walls):.2f}-{max(walls):.2f}) "
              f"| {episodes / wall:.1f} | {tokens / wall:.0f} | {calls:.1f} | {cpu:.2f}, {worker:.2f} "
              f"| {wall / base:.2f}x | {ratio(base / wall)}x |")


if __name__ == "__main__":
    main()
