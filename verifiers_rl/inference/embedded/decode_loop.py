"""The embedded engine serving continuously (``EmbeddedEngine(continuous_rows=N)``): one ``RunningBatch`` of at most N
rows decodes on a thread of its own, and requests from any event loop or thread join it between decode steps.

A request waits in the loop's queue until the batch has a free row, then is handed to the batch, which prefills it
and admits it at its next step; an episode's later turn (its rollout sampled before) waits ahead of first turns. A
finished row's future is resolved in its caller's event loop. A step that raises fails the requests the batch holds
(running and just admitted) with that error; the loop starts a fresh batch for the requests still waiting and later
ones. A cancelled caller's row leaves the batch at the next step boundary.
``close`` stops the thread and fails every waiting or held request with ``EngineClosedError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from verifiers_rl.core.engine import EngineClosedError, Sample
from verifiers_rl.core.sampling import rollout_sampling
from verifiers_rl.inference.embedded.prefill import KeptTurns
from verifiers_rl.inference.embedded.running_batch import DecodeRequest, RunningBatch

# The idle thread wakes at least this often to check whether it was stopped (a missed notify cannot hang it).
IDLE_WAIT_S = 0.1
# ``close`` waits this long for the step in progress to end (a decode step is far shorter).
JOIN_TIMEOUT_S = 30.0


# A waiting weight load gets the engine's lock before the loop's next step; the loop waits for it at most this long.
LOAD_PRIORITY_WAIT_S = 5.0


class LoadGate:
    """Lets a weight load that waits for the engine's lock have it before the next decode step: a thread that
    releases a lock and takes it again at once may keep it from the thread waiting for it."""

    def __init__(self):
        self._cond = threading.Condition()
        self._loads = 0

    @contextlib.contextmanager
    def loading(self):
        """Around a load's wait for the lock and its apply."""
        with self._cond:
            self._loads += 1
        try:
            yield
        finally:
            with self._cond:
                self._loads -= 1
                self._cond.notify_all()

    def wait_turn(self) -> None:
        """Before a decode step: wait (bounded) until no load waits."""
        with self._cond:
            self._cond.wait_for(lambda: not self._loads, timeout=LOAD_PRIORITY_WAIT_S)


@dataclass(eq=False)
class Ticket:
    """One caller's request: where to answer it, and its id in the running batch once handed to it."""

    request: DecodeRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    rid: int | None = None


def _settle(ticket: Ticket, result: Sample | None = None, error: BaseException | None = None) -> None:
    """Resolve ``ticket``'s future in its own event loop (futures are not thread-safe)."""
    def settle():
        if ticket.future.done():  # the caller gave up (cancelled)
            return
        if error is not None:
            ticket.future.set_exception(error)
        else:
            ticket.future.set_result(result)

    try:
        ticket.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # its loop is closed: nobody waits for the answer
        pass


class DecodeLoop:
    """Serves ``submit``ted requests from one running batch of at most ``max_rows`` rows, on its own thread.

    ``new_batch()``: an empty ``RunningBatch`` (raises ``EngineClosedError`` once the engine is closed);
    ``step(batch)``: ``batch.step()`` under the engine's lock (so a weight load lands between two steps). The
    thread starts with the first request.
    """

    def __init__(self, new_batch: Callable[[], RunningBatch], step: Callable[[RunningBatch], dict[int, Sample]],
                 max_rows: int):
        if max_rows < 1:
            raise ValueError(f"continuous_rows must be >= 1 to serve continuously, got {max_rows}.")
        self.max_rows = max_rows
        self._new_batch, self._step = new_batch, step
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        # An episode's later turns go first: its last turn's keys/values are kept for it (``prefill.KeptTurns``) only
        # while few rows finish after it, and an episode begun finishes sooner.
        self._next_turns: deque[Ticket] = deque()
        self._cancelled: list[Ticket] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Touched by the loop's thread only:
        self._batch: RunningBatch | None = None
        self._kept: KeptTurns | None = None  # an emptied batch's finished rows' keys/values, for the next batch
        self._held: dict[int, Ticket] = {}
        self.steps = self.row_steps = self.admissions = self.served = self.continued = 0  # since the engine was built

    async def submit(self, request: DecodeRequest) -> Sample:
        """Queue ``request`` and wait for its sample (its batch's error is raised here)."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(request, loop, loop.create_future())
        with self._cond:
            if self._stopping:
                raise EngineClosedError("The engine is closed.")
            rollout = rollout_sampling()
            (self._next_turns if rollout is not None and rollout.versions else self._waiting).append(ticket)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="decode-loop", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            self._cancel(ticket)
            raise

    def counters(self) -> dict[str, int]:
        """Decode steps, rows decoded over them (their occupancy), rows admitted into a running batch, samples
        served, requests prefilled from a finished row's keys/values (an episode's next turn)."""
        return {"steps": self.steps, "row_steps": self.row_steps, "admissions": self.admissions,
                "served": self.served, "continued": self.continued}

    def pending(self) -> int:
        """Requests waiting for a row or decoding."""
        with self._cond:
            return len(self._next_turns) + len(self._waiting) + len(self._held)

    def _cancel(self, ticket: Ticket) -> None:
        with self._cond:
            queue = next((q for q in (self._next_turns, self._waiting) if ticket in q), None)
            if queue is not None:
                queue.remove(ticket)
            else:  # held by the batch (or finished meanwhile): the loop drops its row between two steps
                self._cancelled.append(ticket)
                self._cond.notify()

    def close(self) -> None:
        """Stop the thread (after the step in progress) and fail every request with ``EngineClosedError``."""
        with self._cond:
            self._stopping = True
            waiting, self._waiting, self._next_turns = [*self._next_turns, *self._waiting], deque(), deque()
            self._cond.notify_all()
            thread = self._thread
        error = EngineClosedError("The engine was closed while requests were waiting.")
        for ticket in waiting:
            _settle(ticket, error=error)
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)  # the thread fails what it holds as it stops

    # --- the loop's thread --------------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while self._next_round():
                if self._batch is not None and self._batch.pending:
                    self._decode_step()
                if self._batch is not None and not self._batch.pending:
                    # A fresh batch (its statistics, sampler rows) for the next requests; an episode's next turn may
                    # come after a pause (a tool call), so the finished rows' keys/values carry over.
                    self._kept, self._batch = self._batch.prefill.kept, None
        finally:
            self._fail_held(EngineClosedError("The engine was closed while requests were decoding."))

    def _next_round(self) -> bool:
        """Wait (bounded) for work, then take the cancellations and as many waiting requests as there are free
        rows; False once stopped."""
        with self._cond:
            while not (self._stopping or self._cancelled or self._held or self._next_turns or self._waiting):
                self._cond.wait(IDLE_WAIT_S)
            if self._stopping:
                return False
            cancelled, self._cancelled = self._cancelled, []
            free = self.max_rows - len(self._held)
            taken: list[Ticket] = []
            for queue in (self._next_turns, self._waiting):
                while queue and len(taken) < free:
                    taken.append(queue.popleft())
        for ticket in cancelled:
            if ticket.rid is not None and self._held.get(ticket.rid) is ticket:
                del self._held[ticket.rid]
                self._batch.cancel(ticket.rid)
        if taken:
            try:
                if self._batch is None:
                    self._batch = self._new_batch()
                    if self._kept is not None:
                        self._batch.prefill.kept = self._kept
            except Exception as error:  # noqa: BLE001 - the engine is closed or broken: these callers learn why
                for ticket in taken:
                    _settle(ticket, error=error)
                return True
            for ticket in taken:
                ticket.rid = self._batch.add(ticket.request)
                with self._cond:
                    self._held[ticket.rid] = ticket
        return True

    def _decode_step(self) -> None:
        stats = self._batch.stats.rows_per_step
        decoded, admitted, continued = len(stats), self._batch.stats.admissions, self._batch.stats.continued
        try:
            finished = self._step(self._batch)
        except Exception as error:  # noqa: BLE001 - the requests it held get it; later requests get a fresh batch
            self._fail_held(error)
            self._batch = None
            return
        self.admissions += self._batch.stats.admissions - admitted
        self.continued += self._batch.stats.continued - continued
        if len(stats) > decoded:  # a step whose rows all finished at their prefill decodes nothing
            self.steps += 1
            self.row_steps += stats[-1]
        for rid, sample in finished.items():
            with self._cond:
                ticket = self._held.pop(rid, None)
            if ticket is not None:
                self.served += 1
                _settle(ticket, sample)

    def _fail_held(self, error: BaseException) -> None:
        with self._cond:
            held, self._held = list(self._held.values()), {}
        for ticket in held:
            _settle(ticket, error=error)
