"""Shared by the benchmarks: progress lines with the load average and the checks of their size flags. It loads
neither transformers nor torch (a process that only starts children, as logprob_memory.py's, need not pay for them):
a trainer's per-step times are steps.py's."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def quiet() -> None:
    """Transformers' log at errors only and no Python warnings, so the progress lines and tables stay readable."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def quiet_start() -> float:
    """``quiet()``, then the load average at the start on stderr; the start instant (``time.perf_counter``)."""
    quiet()
    started = time.perf_counter()
    log(f"load average at start: {load()}")
    return started


def passive_openmp() -> str:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the environment names a policy (``ACTIVE`` measures OpenMP's default); the
    policy in force, for the header line. Call it before torch loads OpenMP: idle OpenMP threads then sleep instead of
    spinning, so a decode thread and training, each with its own OpenMP team, do not take the cores from each other,
    as the README asks of a continuous run on the CPU."""
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def fill_in(args: argparse.Namespace, sizes: dict) -> None:
    """Each of ``sizes`` (a script's defaults, or its ``--quick`` sizes) that its flag did not give: ``--quick`` only
    fills in, so ``--quick --steps 2`` times 2 steps."""
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, minimum: int, *names: str,
             why: str = "") -> None:
    """Refuse by ``parser.error`` the first of ``names`` (attributes of ``args``, each its flag without ``--``; a list
    for ``nargs="+"``) below ``minimum``, naming the flag and its value; a flag not given (None) passes. Called before
    any model or server starts: a size below it ran for minutes, then failed on an empty median, or meant a default."""
    for name in names:
        value = getattr(args, name)
        for item in value if isinstance(value, list) else [value]:
            if item is not None and not item >= minimum:  # NaN too: it compares false with every bound
                parser.error(f"--{name} must be >= {minimum} (got {item})" + (f": {why}" if why else ""))


def once_each(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Refuse by ``parser.error`` a value given twice to one of ``names`` (``nargs="+"`` flags, each its attribute of
    ``args``): each value is a run of its own, so a repeat ran again and doubled or replaced its row in the tables."""
    for name in names:
        values = getattr(args, name) or []
        repeated = list(dict.fromkeys(str(value) for value in values if values.count(value) > 1))
        if repeated:
            parser.error(f"--{name} {' '.join(map(str, values))}: {', '.join(repeated)} given more than once; each "
                         "value runs once (name it once)")


def model_name(parser: argparse.ArgumentParser, model: str) -> None:
    """Refuse by ``parser.error`` a ``--model`` that is no folder here and no Hub id either: resolved in the run, it
    failed with a traceback."""
    from verifiers_rl.core.models import check_model_name

    try:
        check_model_name(model)
    except FileNotFoundError as error:
        parser.error(str(error))


def writable_file(parser: argparse.ArgumentParser, path: str | None, flag: str) -> None:
    """Refuse by ``parser.error`` a ``path`` the run could not write once it has its numbers: a folder, a file in a
    folder that is not there, or one this user cannot create (``open`` failed with a traceback after the whole run).
    None (not given) passes."""
    if path is None:
        return
    if os.path.isdir(path) or not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        parser.error(f"{flag} {path}: a folder, or in a folder that does not exist: name a file in an existing folder")
    from verifiers_rl.core.paths import unwritable  # the command's and RLTrainer's check: a /proc path, read-only

    why = unwritable(path, is_file=True)
    if why:
        parser.error(f"{flag} {path}: {why}")

