"""Math answers compared with math-verify, in a pool of worker processes; a worker is killed when a comparison hangs.

SymPy can run for ever on a model's answer (``\\boxed{9^{9^{9}}}``), inside C code that no signal interrupts;
math-verify's own timeout uses ``signal.alarm``, which also fails off the main thread, where environments run.
The worker is a plain subprocess (not multiprocessing), so it never re-imports the user's main script.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from verifiers_rl.envs.messages import Messages
from verifiers_rl.envs.parsers import Parser

_STARTUP_TIMEOUT_S = 120.0
_WORKER = Path(__file__).with_name("math_worker.py")


class _Worker:
    """One math-verify worker process: started on first use, answers one request at a time, restarted after a
    timeout or a crash."""

    def __init__(self):
        self.process: subprocess.Popen | None = None

    def request(self, gold: str, predicted: str, timeout_s: float) -> dict[str, Any]:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen([sys.executable, "-c", _WORKER.read_text()], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True)
            self._read(_STARTUP_TIMEOUT_S, "start")
        self.process.stdin.write(json.dumps([gold, predicted]) + "\n")
        self.process.stdin.flush()
        return self._read(timeout_s, f"compare {predicted!r} with {gold!r}")

    def close(self) -> None:
        process = self.process  # killing it also ends a request blocked on it
        if process is not None:
            process.kill()
            process.wait()

    def _read(self, timeout_s: float, doing: str) -> dict[str, Any]:
        process, expired = self.process, threading.Event()

        def stop() -> None:
            expired.set()
            process.kill()  # ends the blocking readline below

        timer = threading.Timer(timeout_s, stop)
        timer.start()
        try:
            line = process.stdout.readline()
        finally:
            timer.cancel()
        if line:
            return json.loads(line)
        process.kill()
        process.wait()
        self.process = None
        if expired.is_set():
            raise TimeoutError(f"math-verify took over {timeout_s:g} s to {doing}; its worker process was stopped.")
        raise RuntimeError(f"math-verify's worker process exited (code {process.returncode}) when asked to {doing}.")


class MathChecker:
    """``await checker.equal(gold, predicted)``: whether two answers are mathematically equal (``"1/2"`` and
    ``"0.5"`` are). Comparisons run in a pool of ``workers`` processes (default: one per core, at most 4), started
    as needed, so a batch's answers are checked in parallel. A comparison taking over ``timeout_s`` raises
    TimeoutError; its worker restarts on its next request.
    """

    def __init__(self, timeout_s: float = 10.0, workers: int | None = None):
        self.timeout_s = timeout_s
        self.workers = workers or min(4, os.cpu_count() or 1)
        if self.workers < 1:
            raise ValueError(f"MathChecker needs at least one worker, got {self.workers}.")
        self._pool = [_Worker() for _ in range(self.workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for worker in self._pool:
            self._idle.put(worker)
        atexit.register(self.close)

    async def equal(self, gold: str, predicted: str) -> bool:
        reply = await asyncio.to_thread(self._request, gold, predicted)
        if "error" in reply:
            raise RuntimeError(f"math-verify failed comparing {predicted!r} with {gold!r}: {reply['error']}")
        return reply["equal"]

    def close(self) -> None:
        """Stop the worker processes that run."""
        for worker in self._pool:
            worker.close()

    def _request(self, gold: str, predicted: str) -> dict[str, Any]:
        worker = self._idle.get()  # waits while every worker is busy
        try:
            return worker.request(gold, predicted, self.timeout_s)
        finally:
            self._idle.put(worker)


MATH_CHECKER = MathChecker()


async def correct_answer(completion: Messages, answer: Any, parser: Parser) -> float:
    """Reward 1.0 if the parsed answer of ``completion`` equals ``answer`` according to math-verify, else 0.0."""
    if answer is None:
        raise ValueError("the dataset row has no answer to compare with")
    predicted = parser.parse_answer(completion)
    if predicted is None or not predicted.strip():
        return 0.0
    return float(await MATH_CHECKER.equal(str(answer), predicted))
