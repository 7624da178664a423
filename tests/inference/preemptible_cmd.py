"""A stand-in for a trainer under a job scheduler, for the launcher's preemption tests (no trainer needed).

    python tests/inference/preemptible_cmd.py OUT [--delay S] [--exit CODE] [--ignore-term] [--exit-now]
        [--vllm_server_url URL]

Starts a child that ignores SIGTERM (something a command may leave behind), writes ``OUT/ready.json`` with both
pids, then waits. On SIGTERM / SIGINT it appends the signal to ``OUT/signals``; unless ``--ignore-term``, it then
sleeps ``--delay`` s ("finishes its step, writes a checkpoint"), checks that the vLLM server (if given) still answers
``/health``, writes ``OUT/stopped.json`` and exits with ``--exit``. ``--exit-now`` exits at once with ``--exit``
(no signal), leaving the child running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--delay", type=float, default=2.0)
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--exit-now", action="store_true")
    parser.add_argument("--vllm_server_url", default=None)
    args = parser.parse_args()
    received: list[int] = []

    def record(signum, frame):
        received.append(signum)
        with open(args.out / "signals", "a") as handle:
            handle.write(f"{signum}\n")

    signal.signal(signal.SIGTERM, record)
    signal.signal(signal.SIGINT, record)
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    (args.out / "ready.json").write_text(json.dumps({"cmd": os.getpid(), "child": child.pid}))
    if args.exit_now:
        return args.exit
    while not received or args.ignore_term:
        time.sleep(0.05)
    started = time.monotonic()
    time.sleep(args.delay)
    health = None
    if args.vllm_server_url:
        with urllib.request.urlopen(args.vllm_server_url + "/health", timeout=5) as response:
            health = response.status
    (args.out / "stopped.json").write_text(json.dumps(
        {"signal": received[0], "slept_s": time.monotonic() - started, "health_while_stopping": health}))
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
