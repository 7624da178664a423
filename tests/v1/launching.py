"""The v1 tests' run of the training command (``examples/train.py``, or ``-m module``) in a subprocess: its stdout
lines."""

import subprocess
import sys
from pathlib import Path

from tests.helpers.launches import ROOT, launch_env


def run(args: list[str], cwd: Path, cache: Path | None = None, module: str | None = None):
    env = launch_env()
    if cache is not None:
        env["VERIFIERS_RL_CACHE"] = str(cache)
    program = ["-m", module] if module else [str(ROOT / "examples" / "train.py")]
    result = subprocess.run([sys.executable, *program, *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result.stdout.splitlines()
