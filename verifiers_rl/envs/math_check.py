"""Math answers compared with math-verify, in a worker process that is killed when a comparison hangs.

SymPy can run for ever on a model's answer (``\\boxed{9^{9^{9}}}``), inside C code that no signal interrupts;
math-verify's own timeout uses ``signal.alarm``, which also fails off the main thread, where environments run.
The worker is a plain subprocess (not multiprocessing), so it never re-imports the user's main script.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from .messages import Messages
from .parsers import Parser

_STARTUP_TIMEOUT_S = 120.0
_WORKER = Path(__file__).with_name("math_worker.py")


class MathChecker:
    """``await checker.equal(gold, predicted)``: whether two answers are mathematically equal (``"1/2"`` and
    ``"0.5"`` are). A comparison taking over ``timeout_s`` raises TimeoutError; the worker restarts on the next call.
    """

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()  # the worker answers one request at a time, in order
        atexit.register(self.close)

    async def equal(self, gold: str, predicted: str) -> bool:
        reply = await asyncio.to_thread(self._request, gold, predicted)
        if "error" in reply:
            raise RuntimeError(f"math-verify failed comparing {predicted!r} with {gold!r}: {reply['error']}")
        return reply["equal"]

    def close(self) -> None:
        """Stop the worker process, if one runs."""
        process = self._process  # not under the lock: killing it also ends a request blocked on it
        if process is not None:
            process.kill()
            process.wait()

    def _request(self, gold: str, predicted: str) -> dict[str, Any]:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                command = [sys.executable, "-c", _WORKER.read_text()]
                self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                self._read(_STARTUP_TIMEOUT_S, "start")
            self._process.stdin.write(json.dumps([gold, predicted]) + "\n")
            self._process.stdin.flush()
            return self._read(self.timeout_s, f"compare {predicted!r} with {gold!r}")

    def _read(self, timeout_s: float, doing: str) -> dict[str, Any]:
        process, expired = self._process, threading.Event()

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
        self._process = None
        if expired.is_set():
            raise TimeoutError(f"math-verify took over {timeout_s:g} s to {doing}; its worker process was stopped.")
        raise RuntimeError(f"math-verify's worker process exited (code {process.returncode}) when asked to {doing}.")


MATH_CHECKER = MathChecker()


async def correct_answer(completion: Messages, answer: Any, parser: Parser) -> float:
    """Reward 1.0 if the parsed answer of ``completion`` equals ``answer`` according to math-verify, else 0.0."""
    if answer is None:
        raise ValueError("the dataset row has no answer to compare with")
    predicted = parser.parse_answer(completion)
    if predicted is None or not predicted.strip():
        return 0.0
    return float(await MATH_CHECKER.equal(str(answer), predicted))
