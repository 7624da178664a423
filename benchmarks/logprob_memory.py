"""Peak memory of chunked vs unchunked per-token log-probs at a 49,152-token vocabulary, forward + backward.

What it measures: ``verifiers_rl.training.forward.target_logprobs(hidden[N, H], weight[V, H], targets[N])`` with
V = 49,152 (SmolLM2's vocabulary), H = 576 (SmolLM2-135M's hidden size), N = 4,096 tokens, fp32 on CPU,
then ``logps.sum().backward()`` into both ``hidden`` and ``weight``. ``chunk_size=None`` materialises all
N x V logits through autograd (the reference); a chunk size keeps logits for that many tokens at a time and
recomputes them in the backward, all but the last chunk's (kept from the forward). Each configuration runs in a
fresh subprocess (this script with the hidden ``--child`` flag), which records the resident set after allocating the
inputs, its peak reset to it (Linux: VmRSS / VmHWM; ``ru_maxrss`` elsewhere), and the peak after forward + backward;
the table gives the increase, the part of it that
is the unavoidable V x H fp32 gradient of ``weight``, the ratio to the unchunked increase, and the forward + backward
wall time (best of 2 runs, the first being the measured one; 1 with ``--quick``).

Every chunked child also checks its result against the unchunked computation on a smaller problem
(min(N, max(1000, min(1.5 x chunk, 1536))) tokens: a ragged last chunk, and several chunks for the smaller
chunk sizes; random upstream gradients): max |diff| over logps, d hidden and d weight, and the largest
relative difference max |diff| / max |reference| (pass: <= 1e-4).

Run (about 75 s on 2 cores; ``--quick``: N = 1,024, chunk sizes 256 and 1024, about 15 s):

    PYTHONPATH=. .venv/bin/python benchmarks/logprob_memory.py
    PYTHONPATH=. .venv/bin/python benchmarks/logprob_memory.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

from timing import at_least  # noqa: E402  (benchmarks/timing.py)

VOCAB = 49_152
HIDDEN = 576
RELATIVE_TOLERANCE = 1e-4


def _maxrss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _status_kib(key: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` (KiB) from /proc/self/status; None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(f"{key}:"))
    except (OSError, StopIteration):
        return None


def _reset_peak_kib() -> int:
    """The resident size now, with the peak (VmHWM) reset to it (Linux's clear_refs 5), so the peak read after a
    run is that run's: the peak so far (imports, the warm-up) may lie above what is resident, and memory freed since
    is reused by the run unseen. Elsewhere the peak so far, as before."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return _maxrss_kib()
    return _status_kib("VmRSS") or _maxrss_kib()


def _peak_kib() -> int:
    return _status_kib("VmHWM") or _maxrss_kib()


def _inputs(torch, n, vocab, hidden_size, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=generator).requires_grad_()
    # Scaled in place: a temporary V x H copy would raise the baseline peak, and the weight gradient would reuse it.
    weight = torch.randn(vocab, hidden_size, generator=generator).mul_(0.05).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=generator)
    return hidden, weight, targets


def _check(torch, target_logprobs, chunk_size, n, vocab, hidden_size):
    """Chunked vs unchunked logps and gradients on n tokens; returns (max |diff|, max relative diff)."""
    hidden, weight, targets = _inputs(torch, n, vocab, hidden_size, seed=1)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(2))
    results = []
    for chunk in (None, chunk_size):
        hidden.grad = None
        weight.grad = None
        logps, _ = target_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=chunk)
        (logps * upstream).sum().backward()
        results.append((logps.detach(), hidden.grad.clone(), weight.grad.clone()))
    max_abs, max_rel = 0.0, 0.0
    for reference, chunked in zip(*results):
        diff = (chunked - reference).abs().max().item()
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / max(reference.abs().max().item(), 1e-30))
    return max_abs, max_rel


def child(args) -> None:
    import torch

    from verifiers_rl.training.forward import target_logprobs

    torch.set_num_threads(2)
    chunk = args.chunk or None
    # Warm up the kernels on a tiny, separate problem so one-off library allocations are not counted.
    small = _inputs(torch, 16, 64, args.hidden, seed=3)
    target_logprobs(*small, chunk_size=chunk and 8)[0].sum().backward()
    del small

    hidden, weight, targets = _inputs(torch, args.tokens, args.vocab, args.hidden, seed=0)
    baseline = _reset_peak_kib()
    start = time.perf_counter()
    logps, _entropy = target_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=chunk)
    logps.sum().backward()
    seconds = time.perf_counter() - start
    after = _peak_kib()
    del logps, _entropy
    for _ in range(args.child_repeats - 1):  # further timed runs; the peak is already recorded
        hidden.grad = None
        weight.grad = None
        start = time.perf_counter()
        target_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=chunk)[0].sum().backward()
        seconds = min(seconds, time.perf_counter() - start)
    result = {
        "chunk": args.chunk,
        "tokens": args.tokens,
        "baseline_kib": baseline,
        "increase_kib": after - baseline,
        "weight_grad_bytes": weight.grad.numel() * weight.grad.element_size(),
        "seconds": seconds,
    }
    if chunk and args.child_check:
        n_check = min(args.tokens, max(1000, min(chunk + chunk // 2, 1536)))
        max_abs, max_rel = _check(torch, target_logprobs, chunk, n_check, args.vocab, args.hidden)
        result.update(check_tokens=n_check, max_abs=max_abs, max_rel=max_rel)
    print(json.dumps(result))


def run_child(tokens: int, chunk: int, vocab: int, hidden: int, check: bool, repeats: int) -> dict:
    command = [
        sys.executable, os.path.abspath(__file__), "--child", "--tokens", str(tokens), "--chunk", str(chunk),
        "--vocab", str(vocab), "--hidden", str(hidden), "--child-repeats", str(repeats),
    ]
    if check:
        command.append("--child-check")
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"child {command} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 1024 tokens, fewer chunk sizes (smoke test)")
    parser.add_argument("--tokens", type=int, default=None, help="N, tokens whose log-probs are computed")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per configuration (the minimum is shown)")
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the chunked == unchunked check")
    # Internal: one measurement in a fresh process.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-repeats", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # 0 silently meant the default here (and a zero-sized problem in a child): refused by name instead.
    at_least(parser, args, 1, "tokens", "vocab", "hidden", "repeats")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        args.tokens = args.tokens or 4096
        child(args)
        return

    tokens = args.tokens or (1024 if args.quick else 4096)
    chunks = [256, 1024] if args.quick else [256, 1024, 4096]
    repeats = args.repeats or (1 if args.quick else 2)
    rows = [run_child(tokens, 0, args.vocab, args.hidden, check=False, repeats=repeats)]
    rows += [run_child(tokens, c, args.vocab, args.hidden, check=args.check, repeats=repeats) for c in chunks]

    mib = 1024 * 1024
    reference = rows[0]
    ref_increase = reference["increase_kib"] * 1024
    weight_grad = reference["weight_grad_bytes"]
    print(
        f"\ntarget_logprobs forward + backward, N = {tokens} tokens, V = {args.vocab}, H = {args.hidden}, fp32, CPU, "
        f"2 threads; peak RSS increase over the inputs (hidden {tokens * args.hidden * 4 / mib:.1f} MiB, weight "
        f"{args.vocab * args.hidden * 4 / mib:.1f} MiB), each row a fresh process.\n"
    )
    print(
        "| chunk_size | peak increase (MiB) | of which weight grad (MiB) | increase excl. weight grad (MiB) "
        "| ratio vs unchunked | ratio excl. weight grad | fwd+bwd s | check: max abs diff (max rel) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        increase = row["increase_kib"] * 1024
        if "max_abs" in row:
            ok = "ok" if row["max_rel"] <= RELATIVE_TOLERANCE else "FAIL"
            check = f"{row['max_abs']:.2e} ({row['max_rel']:.1e}, {row['check_tokens']} tok) {ok}"
        else:
            check = "reference" if not row["chunk"] else "skipped"
        print(
            f"| {row['chunk'] or 'None (unchunked)'} | {increase / mib:,.1f} | {weight_grad / mib:.1f} | "
            f"{(increase - weight_grad) / mib:,.1f} | {increase / ref_increase:.3f} | "
            f"{(increase - weight_grad) / (ref_increase - weight_grad):.3f} | {row['seconds']:.2f} | {check} |"
        )
    ratios = ", ".join(f"{r['chunk']}: {r['increase_kib'] * 1024 / ref_increase:.3f}" for r in rows[1:])
    print(
        f"\nchunked/unchunked peak increase by chunk_size: {ratios} (target <= 0.25). The weight gradient "
        f"({weight_grad / mib:.1f} MiB) is in every row; a chunk_size >= N is one chunk, so no saving is expected "
        f"there. Times: best of {repeats} run(s)."
    )


if __name__ == "__main__":
    main()
