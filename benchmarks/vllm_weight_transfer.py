"""Weight loads into a real vLLM server (CPU build): snapshot files vs broadcasts through vLLM's weight-transfer
engine (gloo, the CPU twin of its NCCL backend).

What it measures: ``VLLMEngine.load_weights`` of a model's full state dict, end to end (client side + the server's
in-place reload, until the call returns), for

- ``files``: each tensor written to a safetensors snapshot, then one ``collective_rpc`` that reloads it;
- ``gloo``: vLLM's ``/start_weight_update`` + ``/update_weights`` per round (rounds of 256 MiB, or 16 MiB) while the
  tensors are broadcast to the server's worker, + ``/finish_weight_update``.

One server per model (started with the gloo backend; both transfers run against it), modes round-robin, N loads
each after one warm-up load; the table gives the median (and fastest) seconds per load and the median's ratio to
``files``. Models: the tiny test Llama (hidden 64, 2 layers) and SmolLM2-135M-Instruct (offline copy). A load is
checked (the server's log-probs of a probe equal the loaded weights' within 1e-4) before anything is timed.

Run (about 3 minutes on 2 idle cores; ``--quick``: the tiny model only, 3 loads):

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_weight_transfer.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, ROOT)

from timing import at_least, log  # noqa: E402  (benchmarks/timing.py)

MODES = [("files", "files", 256.0), ("gloo 256 MiB", "gloo", 256.0), ("gloo 16 MiB", "gloo", 16.0)]
PROBE = [11, 40, 7, 93, 150, 22, 301, 64, 5, 17, 250, 3, 99]


def probe_logprobs(model, ids):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def bench_model(label: str, folder: str, repeats: int) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    from verifiers_rl.inference.vllm.engine import VLLMEngine
    from verifiers_rl.inference.vllm.server import VLLMServer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Perturbed weights, so every load really changes what the server holds.
    state = [(name, tensor.detach() + 1e-3) for name, tensor in model.state_dict().items()]
    if model.config.tie_word_embeddings:
        state = [(n, t) for n, t in state if n != "lm_head.weight"]
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    with torch.no_grad():
        for (name, tensor) in state:
            model.get_parameter(name).copy_(tensor)
    expected = probe_logprobs(model, PROBE)
    times = {mode: [] for mode, _, _ in MODES}
    with VLLMServer(folder, max_model_len=512, weight_transfer="gloo", startup_timeout_s=600) as server:
        # One client per transfer (one gloo group per server: a second gloo client would take it over each time).
        clients = {transfer: VLLMEngine(server.url, model=folder, weight_transfer=transfer)
                   for transfer in {transfer for _, transfer, _ in MODES}}

        def load(mode: str, version: int):
            _, transfer, mb = next(m for m in MODES if m[0] == mode)
            if transfer != "files":
                clients[transfer].transfer.bucket_bytes = int(mb * 2**20)
            clients[transfer].load_weights(state, version=version)
            return clients[transfer]

        for mode, _, _ in MODES:  # warm-up load, checked
            engine = load(mode, 1)
            served = torch.tensor(engine.prompt_logprobs(PROBE))
            gap = (served - expected).abs().max().item()
            assert gap < 1e-4, f"{label} {mode}: the server's log-probs differ from the loaded weights' by {gap}"
        for repeat in range(repeats):
            for mode, _, _ in MODES:
                started = time.perf_counter()
                load(mode, 2 + repeat)
                times[mode].append(time.perf_counter() - started)
            log(f"  {label}: round {repeat + 1}/{repeats} done")
        for engine in clients.values():
            engine.close()
    base = statistics.median(times["files"])
    rows = []
    for mode, _, _ in MODES:
        median = statistics.median(times[mode])
        rows.append(
            f"| {label} ({len(state)} tensors, {nbytes / 2**20:.0f} MiB) | {mode} | {median:.3f} s "
            f"(fastest {min(times[mode]):.3f}) | {median / base:.2f}x |"
        )
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="timed loads per mode (5; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="the tiny model only, 3 loads per mode")
    args = parser.parse_args(argv)
    if args.repeats is None:  # a --repeats given keeps its value, also with --quick
        args.repeats = 3 if args.quick else 5
    at_least(parser, args, 1, "repeats")  # checked before a server starts: the table's medians need a timed load
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from verifiers_rl.core.models import build_tiny_model, smollm2_dir

    repeats = args.repeats
    rows = ["| model | transfer | median per load | vs files |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        models = [("tiny llama", str(build_tiny_model(os.path.join(tmp, "tiny"), tie_word_embeddings=False)))]
        if not args.quick:
            models.append(("smollm2-135M", str(smollm2_dir())))
        for label, folder in models:
            log(f"[vllm_weight_transfer] {label}: starting a server ...")
            rows += bench_model(label, folder, repeats)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
