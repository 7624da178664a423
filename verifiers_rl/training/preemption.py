"""SIGTERM / SIGINT during training: finish the optimizer step, write a checkpoint, stop every rank.

The first signal only raises a flag; the trainer reads it at the end of each optimizer step (all ranks agree on it
with one all-reduce, so a signal that reached one rank stops them all at the same step). A second signal exits at
once (the signal's default action). Signals within ``DEBOUNCE_S`` of the first count as the same one: a job
scheduler (SLURM's scancel) and a launcher forwarding it (``accelerate launch`` / torchrun) deliver SIGTERM to a
worker twice in a few milliseconds, and Ctrl-C in a terminal reaches the launcher and the workers alike.

A SIGTERM that finds a process of the launch already dead is the launcher (torchrun) ending the launch after that
death: no step can finish without the dead process, so the survivor says which one died and how to resume, and
exits at once (else it would sit in its step until the launcher's SIGKILL, TORCH_ELASTIC_SHUTDOWN_TIMEOUT later).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from transformers import TrainerCallback

from verifiers_rl.training.distributed import agreed_max

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEBOUNCE_S = 1.0


class TrainingPreempted(RuntimeError):
    """Training stopped on a signal after writing ``checkpoint``; the exit status a script should use is
    ``exit_code`` (128 + the signal's number, the shell's convention for a process ended by that signal)."""

    def __init__(self, signum: int, checkpoint: str | None, step: int):
        self.signum = signum
        self.checkpoint = checkpoint
        self.step = step
        self.exit_code = 128 + signum
        where = f"checkpoint saved to {checkpoint}" if checkpoint else "no checkpoint was written"
        resume = f"; resume with --resume_from_checkpoint {checkpoint} (or latest)" if checkpoint else ""
        super().__init__(f"Training stopped by {signal.Signals(signum).name} after step {step}: {where}{resume}.")


class PreemptionSignal:
    """Catches SIGTERM and SIGINT while installed (main thread only; elsewhere signals cannot be caught)."""

    def __init__(self, lost_peer: Callable[[], str | None] | None = None):
        self.lost_peer = lost_peer  # the line to print when a peer has died, or None (``lost_peer_note``)
        self.received: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.info("Not on the main thread: SIGTERM/SIGINT keep their default action (no checkpoint on preemption).")
            return
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            note = self._lost_peer()
            if note is not None:
                sys.stderr.write(f"\n{note} {signal.Signals(signum).name} from the launcher: exiting now.\n")
                sys.stderr.flush()
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            self.received, self._first_at = signum, now
            sys.stderr.write(
                f"\n[verifiers_rl] {signal.Signals(signum).name}: finishing the current optimizer step, then a checkpoint "
                "and exit (send it again to exit at once).\n"
            )
            sys.stderr.flush()
        elif now - self._first_at > DEBOUNCE_S:
            sys.stderr.write(f"\n[verifiers_rl] {signal.Signals(signum).name} again: exiting now, without a checkpoint.\n")
            sys.stderr.flush()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _lost_peer(self) -> str | None:
        try:
            return self.lost_peer() if self.lost_peer is not None else None
        except Exception:  # noqa: BLE001 - a signal handler must not fail; the usual path follows
            return None


class PreemptionCallback(TrainerCallback):
    """At the end of each optimizer step: if any rank got SIGTERM/SIGINT (one all-reduce, so every rank agrees),
    ask for a checkpoint and stop; ``stopped_by`` is the signal."""

    def __init__(self, signal: PreemptionSignal, device):
        self.signal = signal
        self.device = device
        self.stopped_by: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.stopped_by = None

    def on_step_end(self, args, state, control, **kwargs):
        signum = agreed_max(self.signal.received or 0, self.device)
        if signum:
            self.stopped_by = signum
            control.should_save = True
            control.should_training_stop = True
