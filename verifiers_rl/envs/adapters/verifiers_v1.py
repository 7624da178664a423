"""verifiers 0.4 (``verifiers.v1``) environments, run unchanged in their own venv: the trainer's side of the episode
worker (``verifiers_rl/v1_worker/episode_worker.py``, its protocol documented there).

The worker process runs v1's ``Env.run_episode``; its model calls reach the engine through the loopback
``GenerateEndpoint`` (``inference/generate_endpoint.py``), one base URL per rollout, so each rollout samples under
its own ``RolloutSampling``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
WORKER_SCRIPT = Path(__file__).resolve().parents[2] / "v1_worker" / "episode_worker.py"
API_KEY_VAR = "VERIFIERS_RL_V1_API_KEY"


def v1_python() -> Path:
    """The interpreter of the verifiers 0.4 venv: ``$VERIFIERS_RL_V1_VENV`` or ``<repo>/.venv-verifiers-v1``."""
    venv = Path(os.environ.get("VERIFIERS_RL_V1_VENV") or ROOT / ".venv-verifiers-v1")
    return venv / "bin" / "python"


class EpisodeWorkerError(RuntimeError):
    """A request the worker answered with an error (its message and traceback)."""


class EpisodeWorker:
    """``async with EpisodeWorker(api_key) as w: await w.load(env); await w.run(task, base_url, model)``."""

    def __init__(self, api_key: str, python: str | Path | None = None):
        self.api_key = api_key
        self.python = Path(python) if python else v1_python()
        self.process: asyncio.subprocess.Process | None = None
        self.loaded: dict | None = None
        self._ids = itertools.count()
        self._waiting: dict[Any, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def start(self) -> "EpisodeWorker":
        if not self.python.exists():
            raise FileNotFoundError(
                f"No verifiers 0.4 venv at {self.python.parent.parent}: run scripts/install_verifiers_v1.sh "
                "(or set VERIFIERS_RL_V1_VENV).")
        env = {**os.environ, API_KEY_VAR: self.api_key, "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)  # the trainer's packages must not shadow the worker venv's
        # The venv's uv first on PATH: v1's `null` harness runs its program with `uv sync --script` (and would
        # download uv if none were found).
        env["PATH"] = f"{self.python.parent}{os.pathsep}{env.get('PATH', '')}"
        self.process = await asyncio.create_subprocess_exec(
            str(self.python), str(WORKER_SCRIPT), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env, limit=256 * 1024 * 1024)
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        while line := await self.process.stdout.readline():
            message = json.loads(line)
            future = self._waiting.pop(message.get("id"), None)
            if future is not None and not future.done():
                future.set_result(message)
        code = await self.process.wait()
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(EpisodeWorkerError(f"the episode worker exited (code {code})"))
        self._waiting.clear()

    async def _request(self, request: dict) -> dict:
        if self.process is None or self.process.returncode is not None:
            raise EpisodeWorkerError("the episode worker is not running")
        request_id = request.setdefault("id", f"r{next(self._ids)}")
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        await self.process.stdin.drain()
        answer = await future
        if answer.get("op") == "error":
            raise EpisodeWorkerError(f"{answer['error']}\n{answer.get('traceback', '')}")
        return answer

    async def load(self, env: str, env_config: dict | None = None, harness: str = "null") -> dict:
        self.loaded = await self._request({"op": "load", "env": str(env), "env_config": env_config or {},
                                           "harness": harness})
        return self.loaded

    async def run(self, task: int, base_url: str, model: str, renderer_model: str | None = None) -> dict:
        return await self._request({"op": "run", "task": int(task), "base_url": base_url, "model": model,
                                    "renderer_model": renderer_model})

    async def close(self) -> None:
        if self.process is None:
            return
        if self.process.returncode is None:
            try:
                self.process.stdin.write(b'{"op": "close"}\n')
                await self.process.stdin.drain()
                self.process.stdin.close()
                await asyncio.wait_for(self.process.wait(), 30)
            except (asyncio.TimeoutError, ConnectionError):
                self.process.kill()
                await self.process.wait()
        if self._reader is not None:
            await self._reader
        self.process = None

    async def __aenter__(self) -> "EpisodeWorker":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()
