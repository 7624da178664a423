"""An event loop run on a thread of its own while the calling thread keeps its time bound.

A timeout inside the loop (``asyncio.wait_for``) cannot fire while synchronous code blocks that loop: a reward
function or tool that hangs in plain Python. Evaluation and generation without a generator thread run their
rollouts here, so ``--generation_timeout_s`` holds whatever the environment's code does.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def run_watched(make: Callable[[Callable[[], None]], Awaitable[T]], timeout_s: float,
                timed_out: Callable[[], BaseException], name: str = "verifiers_rl-watched") -> T:
    """``make(progress)``'s result, awaited in a new event loop on a daemon thread (in this thread's context);
    raises what it raised, or ``timed_out()`` when ``progress()`` was not called for ``timeout_s`` seconds (then the
    loop's tasks are cancelled where the loop still runs; a thread blocked in synchronous code stays blocked)."""
    progressed, finished, result = threading.Event(), threading.Event(), {}

    def progress() -> None:
        progressed.set()

    async def main() -> T:
        result["loop"] = asyncio.get_running_loop()
        return await make(progress)

    def run() -> None:
        try:
            result["value"] = asyncio.run(main())
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            result["error"] = error
        finally:
            finished.set()
            progressed.set()

    threading.Thread(target=contextvars.copy_context().run, args=(run,), daemon=True, name=name).start()
    while not finished.is_set():
        if not progressed.wait(timeout_s) and not finished.is_set():
            with contextlib.suppress(KeyError, RuntimeError):  # a loop not started yet, or just ended
                loop = result["loop"]
                loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(loop)])
            raise timed_out()
        progressed.clear()
    if "error" in result:
        raise result["error"]
    return result["value"]
