"""Per-event-loop request batching: concurrent ``sample`` calls of one event loop become one batch for the model.

Each event loop (the trainer's generator opens one per batch) has its own queue; the first request starts a task that
yields to the loop until every coroutine about to ask has asked, then hands up to ``max_batch_size`` requests to
``run`` (in a worker thread, or on the loop's own thread), and resolves each caller's future with its result or the
batch's error.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from verifiers_rl import compat

# A flush waits at most this many event-loop rounds for more requests (bounds the wait if something keeps the loop
# busy forever).
MAX_SETTLE_ROUNDS = 64


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    future: asyncio.Future
    temperature: float
    seed: int | None


class _LoopQueue:
    """Requests waiting in one event loop, and the task that feeds them to the model."""

    def __init__(self):
        self.pending: list[Request] = []
        self.task: asyncio.Task | None = None


class RequestBatcher:
    """Batches the requests of each event loop for ``run(requests) -> results`` (one result per request, in order).

    ``in_loop_thread``: run on the event loop's own thread (blocking it) instead of a worker thread (synchronous
    generation on the trainer's thread; see ``EmbeddedEngine``).
    """

    def __init__(self, run: Callable[[list[Request]], list[Any]], max_batch_size: int, in_loop_thread: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        self.run = run
        self.max_batch_size = max_batch_size
        self.in_loop_thread = in_loop_thread
        self._lock = threading.Lock()
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopQueue] = weakref.WeakKeyDictionary()

    async def submit(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int | None) -> Any:
        """Queue one request in the running loop and wait for its result (an error of its batch is raised here)."""
        loop = asyncio.get_running_loop()
        queue = self._queue_for(loop)
        future = loop.create_future()
        queue.pending.append(Request(prompt_ids, max_new_tokens, future, temperature, seed))
        if queue.task is None or queue.task.done():
            queue.task = loop.create_task(self._drain(queue))
        return await future

    def pending(self) -> int:
        with self._lock:
            return sum(len(q.pending) for q in self._queues.values())

    def _queue_for(self, loop: asyncio.AbstractEventLoop) -> _LoopQueue:
        with self._lock:
            queue = self._queues.get(loop)
            if queue is None:
                queue = self._queues[loop] = _LoopQueue()
            return queue

    async def _drain(self, queue: _LoopQueue) -> None:
        batch: list[Request] = []
        try:
            while queue.pending:
                await self._settle(queue)
                batch = queue.pending[: self.max_batch_size]
                del queue.pending[: len(batch)]
                batch = [r for r in batch if not r.future.done()]  # callers that gave up (cancelled)
                if not batch:
                    continue
                try:
                    results = self.run(batch) if self.in_loop_thread else await asyncio.to_thread(self.run, batch)
                except Exception as error:  # noqa: BLE001 - every caller of the batch gets it
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(error)
                else:
                    for request, result in zip(batch, results):
                        if not request.future.done():
                            request.future.set_result(result)
                batch = []
        except BaseException:
            # Cancelled (the loop is shutting down) or worse: nobody may be left waiting.
            for request in batch + queue.pending:
                if not request.future.done():
                    request.future.cancel()
            queue.pending.clear()
            raise

    async def _settle(self, queue: _LoopQueue) -> None:
        """Yield to the event loop until no other work is ready to run (everyone about to ask has asked)."""
        for _ in range(MAX_SETTLE_ROUNDS):
            if len(queue.pending) >= self.max_batch_size:
                return
            before = len(queue.pending)
            await asyncio.sleep(0)
            idle = compat.loop_is_idle(asyncio.get_running_loop())
            if idle if idle is not None else len(queue.pending) == before:
                return
