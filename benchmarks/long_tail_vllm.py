"""The long-tail benchmark's vLLM side (benchmarks/long_tail.py ``--engine vllm``): the server it starts and stops,
the client patched to ignore eos, and the server's own counters for occupancy.

Equal work needs every row to decode exactly its asked length: the embedded engine's eos list is replaced, and a vLLM
request must carry ``"ignore_eos": true`` instead, which our client (``VLLMEngine``) never sends: ``ignore_eos``
wraps the client's sampling payload (every ``/v1/completions`` and ``/v1/chat/completions`` it sends, and the
generate route's sampling parameters under continuous generation) on that one engine, so ``FixedLengths`` (long_tail_env.py) still gets, and checks, each turn's exact length.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import tempfile
import urllib.request
from typing import Iterator

from verifiers_rl.inference.vllm.server import VLLMServer, default_venv

KEY_ENV = "VLLM_API_KEY"  # what VLLMServer and VLLMEngine both read
STARTUP_TIMEOUT_S = 600.0  # a cold CPU start on a busy 2-core machine takes minutes
METRICS_TIMEOUT_S = 10.0
# Prometheus counters: generated tokens, and engine steps (each step observes its token count once).
COUNTERS = {"generated": "vllm:generation_tokens_total", "engine_steps": "vllm:iteration_tokens_total_count"}


@contextlib.contextmanager
def served(model_dir: str, max_model_len: int) -> Iterator[VLLMServer]:
    """A vLLM server of ``model_dir`` (the project's ``.venv-vllm``, loopback, a fresh API key in ``$VLLM_API_KEY``
    for this process's clients), as the vLLM tests start theirs; stopped on exit, the key restored."""
    python = default_venv() / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"--engine vllm needs the vLLM venv ({python} is missing): run scripts/install_vllm.sh")
    saved = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = secrets.token_hex(16)
    log = os.path.join(tempfile.mkdtemp(prefix="bench_long_tail_vllm_"), "server.log")
    server = VLLMServer(model_dir, max_model_len=max_model_len, startup_timeout_s=STARTUP_TIMEOUT_S, log_path=log)
    try:
        server.start()  # waits at most STARTUP_TIMEOUT_S, stops the server itself on failure
        warm(server.url, server.served_model_name)
        yield server
    finally:
        server.stop()
        if saved is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = saved


def warm(url: str, model: str) -> None:
    """One short request before any side runs: a fresh CPU server's first request took ~17 s (its one-off set-up),
    which fell in the first side's first step and skewed the whole-run ratio ~9x towards the other side."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={
        "Authorization": f"Bearer {os.environ[KEY_ENV]}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=STARTUP_TIMEOUT_S) as response:
        response.read()


def ignore_eos(engine) -> None:
    """Make every request of this ``VLLMEngine`` carry ``"ignore_eos": true`` (see the module docstring)."""
    if not hasattr(engine, "_sampling_payload"):
        raise SystemExit(f"{type(engine).__name__}: no sampling payload to extend; --engine vllm needs one server "
                         "and our VLLMEngine")
    payload = engine._sampling_payload

    def without_eos(*args, **kwargs) -> dict:
        return {**payload(*args, **kwargs), "ignore_eos": True}

    engine._sampling_payload = without_eos


def reset_prefix_cache(engine) -> None:
    """Empty the server's prefix cache, so a side does not start on the prompts the previous side cached."""
    engine.http.request("POST", "/reset_prefix_cache")


def counters(url: str) -> dict[str, float]:
    """The server's ``COUNTERS`` now (summed over its engines), from ``/metrics``."""
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {os.environ[KEY_ENV]}"})
    with urllib.request.urlopen(request, timeout=METRICS_TIMEOUT_S) as response:
        text = response.read().decode()
    out = {}
    for key, name in COUNTERS.items():
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, flags=re.MULTILINE)
        if not values:
            raise SystemExit(f"the vLLM server's /metrics has no {name}: rows/step cannot be measured")
        out[key] = sum(float(v) for v in values)
    return out


def occupancy(start: dict[str, float], end: dict[str, float]) -> tuple[int, float]:
    """Engine steps between two ``counters`` readings and the mean tokens generated per step (the rows a step ran;
    vLLM schedules prefills into the same steps, so a row's first token counts, unlike the embedded engine's)."""
    steps = int(end["engine_steps"] - start["engine_steps"])
    generated = end["generated"] - start["generated"]
    return steps, (generated / steps if steps else float("nan"))
