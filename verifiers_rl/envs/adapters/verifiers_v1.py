"""verifiers 0.4 (``verifiers.v1``) environments, run unchanged in their own venv: ``V1Env`` (the environment the
trainer sees) and ``EpisodeWorker`` (the trainer's side of ``verifiers_rl/v1_worker/episode_worker.py``, whose
protocol is documented there).

The worker process runs v1's ``Env.run_episode``; its model calls reach the engine through the loopback
``GenerateEndpoint`` (``inference/generate_endpoint.py``), one base URL per rollout, so each rollout samples under
its own ``RolloutSampling`` (a group's tokens are a function of the seed and the weights, as for any environment).
The worker and the endpoint live on a thread of their own with its own event loop, so they outlast the generator's
loops (one per batch at k = 0); each call samples in the loop of the rollout that made it.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from verifiers_rl.core.rollout import Rollout
from verifiers_rl.envs.awaitable import gather_or_cancel
from verifiers_rl.envs.environment import Environment, RolloutError, RolloutRefused, Row
from verifiers_rl.envs.rubric import Rubric
from verifiers_rl.core.sampling import RolloutSampling, Sampler, set_completion_versions

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
WORKER_SCRIPT = Path(__file__).resolve().parents[2] / "v1_worker" / "episode_worker.py"
API_KEY_VAR = "VERIFIERS_RL_V1_API_KEY"


def v1_python() -> Path:
    """The interpreter of the verifiers 0.4 venv: ``$VERIFIERS_RL_V1_VENV`` or ``<repo>/.venv-verifiers-v1``."""
    venv = Path(os.environ.get("VERIFIERS_RL_V1_VENV") or ROOT / ".venv-verifiers-v1")
    return venv / "bin" / "python"


class EpisodeWorkerError(RuntimeError):
    """A request the worker answered with an error: its ``type: message``; the worker's traceback is ``.traceback``
    (logged at debug level: it is the worker's code, not the user's)."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message)
        self.traceback = traceback
        if traceback:
            logger.debug("episode worker traceback:\n%s", traceback)


class EpisodeWorker:
    """``async with EpisodeWorker(api_key) as w: await w.load(env); await w.run(task, base_url, model)``.

    ``env``: variables merged last into the worker's environment (e.g. ``UV_CACHE_DIR``)."""

    def __init__(self, api_key: str, python: str | Path | None = None, env: dict[str, str] | None = None):
        self.api_key = api_key
        self.python = Path(python) if python else v1_python()
        self.env = dict(env or {})
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
        # Rollouts download nothing: scripts/install_verifiers_v1.sh put the null harness's script deps in uv's cache.
        env["UV_OFFLINE"] = "1"
        env.update(self.env)
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
        try:
            answer = await future
        except asyncio.CancelledError:  # e.g. its group failed: the worker stops the episode too, else it plays on
            self._waiting.pop(request_id, None)
            if self.process is not None and self.process.returncode is None:
                self.process.stdin.write((json.dumps({"op": "cancel", "id": request_id}) + "\n").encode())
            raise
        if answer.get("op") == "error":
            raise EpisodeWorkerError(answer["error"], answer.get("traceback", ""))
        return answer

    async def load(self, env: str, env_config: dict | None = None, harness: str | None = None) -> dict:
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


DEFAULT_MAX_SEQ_LEN = 1024
DEFAULT_MAX_NEW_TOKENS = 256
LOAD_TIMEOUT_S = 600.0  # the first load of the null harness may build its script's environment with uv


class V1Env(Environment):
    """A verifiers 0.4 environment (a module exporting a ``vf.Taskset``), trained unchanged.

    ``env`` is the module's ``.py`` file, package folder or importable id. Keyword arguments: ``harness``
    (``"null"``, v1's own chat harness, the default; ``"inprocess"``, the same single-call chat loop inside the
    worker, without a subprocess per episode; or a harness id; for the seats whose author pinned none, and refused
    where every seat pinned one), ``max_seq_len`` / ``max_new_tokens`` (v1 states
    neither: the trainer's ``--max_seq_len`` / ``--max_completion_length`` hold unless given here), and any other
    key merged into v1's env config as it is (e.g. ``taskset={"num_tasks": 8}``; v1 refuses what it does not know).

    Each task of the taskset is one row; a group is ``n`` episodes of one task; each trainable branch of an episode
    (``trainable_branches``) becomes one ``Rollout``: the tokens up to the first sampled one are
    the prompt, the rest the completion (mask 1 on the sampled tokens, 0 on the environment's turns between them).
    A multi-turn episode of one agent is one branch: for a model without a renderer of its own in v1's
    ``renderers`` package, its turns are joined by verifiers_rl's exact turn bridge
    (``v1_worker/bridge_renderer.py``), which keeps the sampled ids. An episode of several branches (sub-agents,
    rewritten history) is one rollout per branch, sharing ``episode_id`` and the episode's reward: it counts once
    in its group's advantage baseline (``training.batching.batch_advantages``), each branch a sequence of its own
    in the loss. What cannot train is refused (``RolloutRefused``: not retried, the same seeds would refuse it
    again). Each rollout carries the sampler's log-probs (the
    engine's, exactly), the trace's reward (sum of score x weight) and metrics (the taskset's metrics and each
    reward's score, under ``reward/<name>``). A failed episode is a ``RolloutError`` naming the task.
    """

    def __init__(self, env: str, tokenizer: Any, *, harness: str | None = None, max_seq_len: int | None = None,
                 max_new_tokens: int | None = None, model_name: str = "verifiers_rl-policy",
                 python: str | Path | None = None, **env_config: Any):
        self.spec = str(env)
        self.model_name = model_name
        self.renderer_model = getattr(tokenizer, "name_or_path", None) or None
        self.unstated_limits = frozenset(
            limit for limit, value in (("max_seq_len", max_seq_len), ("max_new_tokens", max_new_tokens)) if value is None)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="verifiers_rl-v1", daemon=True)
        self._thread.start()
        self._closed = False
        atexit.register(self.close)
        from verifiers_rl.envs.adapters.generate_endpoint import GenerateEndpoint

        self.endpoint = GenerateEndpoint(max_model_len=max_seq_len or DEFAULT_MAX_SEQ_LEN,
                                         max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                                         model_name=model_name)
        self.worker = EpisodeWorker(self.endpoint.api_key, python)
        try:
            loaded = self._call(self._start(harness, env_config), LOAD_TIMEOUT_S)
        except EpisodeWorkerError as error:
            self.close()
            raise ValueError(f"verifiers v1 environment {self.spec!r} failed to load: {error}") from error
        except BaseException:
            self.close()
            raise
        self.harness = loaded["harness"]
        super().__init__(
            [self._record(task) for task in loaded["tasks"]],
            Rubric(),  # unused: the taskset's own rewards score each trace
            tokenizer,
            max_seq_len=max_seq_len or DEFAULT_MAX_SEQ_LEN,
            max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            name=loaded.get("env_id") or Path(self.spec).stem,
        )

    @staticmethod
    def _record(task: dict) -> dict:
        """A task's data as a row: its prompt (for length filtering and logs; the worker renders its own)."""
        prompt = task.get("prompt") or ""
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if task.get("system_prompt") and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": task["system_prompt"]})
        return {"prompt": messages, "answer": task.get("answer")}

    async def _start(self, harness: str | None, env_config: dict) -> dict:
        await self.endpoint.start()
        await self.worker.start()
        return await self.worker.load(self.spec, env_config, harness=harness)

    def _call(self, coro, timeout: float | None = None):
        """Run ``coro`` on the v1 thread's loop from a thread that is not in it; wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def adopt_limits(self, max_seq_len: int | None = None, max_new_tokens: int | None = None) -> None:
        super().adopt_limits(max_seq_len, max_new_tokens)
        # The length contract: v1's client reads max_model_len from /models; the trainer trains on max_seq_len.
        self.endpoint.max_model_len = self.max_seq_len
        self.endpoint.max_new_tokens = self.max_new_tokens

    def _reachable(self, kwargs):
        if kwargs:
            raise ValueError(
                f"{self.spec}: chat_template_kwargs={dict(kwargs)} cannot reach a verifiers v1 environment's prompts: "
                "v1's train client renders them itself (the renderers package). Leave --chat_template_kwargs unset.")
        return {}

    async def generate(self, sampler, prompt, prompt_ids, state):
        raise NotImplementedError("V1Env runs v1 episodes (rollout_group).")

    async def rollout(self, sampler: Sampler, row: Row, group_id: str | int) -> Rollout:
        rollouts = await self.rollout_group(sampler, row, group_id, 1)
        if len(rollouts) != 1:
            raise RolloutRefused(f"{self.name} on task {row.index}: the episode has {len(rollouts)} trainable branches, "
                                 "one Rollout each: take them with rollout_group.")
        return rollouts[0]

    async def rollout_group(self, sampler: Sampler, row: Row, group_id: str | int, n: int, *,
                            seed: int | None = None, temperature: float | None = None) -> list[Rollout]:
        """``n`` episodes of task ``row.index``, episode i sampling under ``RolloutSampling(derive_seed(seed, i),
        temperature)``; an episode of several trainable branches gives one rollout per branch (``episode_id`` i)."""
        samplings = self.group_samplings(n, seed, temperature)
        # One failing episode stops the others (and the worker's episodes behind them), as for every environment.
        episodes = await gather_or_cancel([self._episode(sampler, sampling, row, group_id, i)
                                           for i, sampling in enumerate(samplings)])
        return [rollout for episode in episodes for rollout in episode]

    async def _episode(self, sampler: Sampler, sampling: RolloutSampling, row: Row, group_id,
                       episode: int) -> list[Rollout]:
        if self._closed:
            raise RolloutError(f"{self.name}: the environment was closed.")
        where = f"{self.name} on task {row.index}"
        with self.endpoint.rollout(sampling, sampler, asyncio.get_running_loop()) as base_url:
            run = self.worker.run(row.index, base_url, self.model_name, self.renderer_model)
            try:
                answer = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run, self._loop))
            except EpisodeWorkerError as error:
                raise RolloutError(f"{where}: {error}") from error
        if not answer["ok"]:
            stops = sorted({str(trace["stop_condition"]) for trace in answer["traces"]})
            raise RolloutError(f"{where}: the episode failed: {'; '.join(answer['errors']) or 'no error given'} "
                               f"(stop condition {', '.join(stops) or 'none'})")
        rollouts = [self._to_rollout(trace, branch, row, group_id, episode)
                    for trace, branch in trainable_branches(answer["traces"], where)]
        for rollout in rollouts:  # the endpoint sampled its calls under ``sampling``, which recorded their versions
            set_completion_versions(rollout, sampling)
        return rollouts

    def _to_rollout(self, trace: dict, branch: dict, row: Row, group_id, episode: int | None) -> Rollout:
        """One trainable branch as a Rollout: the tokens up to its first sampled one are the prompt."""
        ids, mask, logprobs = branch["token_ids"], branch["sampled_mask"], branch["logprobs"]
        start = mask.index(True)
        metrics = {key: value for key, value in trace["metrics"].items() if value is not None}
        metrics.update({f"reward/{key}": value for key, value in trace["rewards"].items() if value is not None})
        return Rollout(
            prompt_ids=ids[:start],
            completion_ids=ids[start:],
            completion_mask=[int(m) for m in mask[start:]],
            completion_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs[start:], mask[start:])],
            reward=float(trace["reward"]),
            group_id=group_id,
            truncated=bool(trace["is_truncated"] or trace["is_timeout"]),
            metrics=metrics,
            prompt=row.prompt,
            completion=[{"role": "assistant", "content": trace.get("last_reply") or ""}],
            episode_id=episode if branch["of_several"] else None,
        )

    def close(self) -> None:
        """Stop the worker and the endpoint (also at exit)."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            async def stop():
                await self.worker.close()
                await self.endpoint.close()

            try:
                self._call(stop(), 60)
            except Exception as error:  # noqa: BLE001 - closing at exit: say it, do not raise over the real error
                logger.warning("%s: closing the v1 worker: %s", self.spec, error)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def trainable_branches(traces: list[dict], where: str) -> list[tuple[dict, dict]]:
    """The episode's (trace, branch) pairs to train, each branch marked ``of_several`` when the episode has more than
    one: the branches v1 marks trainable, of the traces of trainable seats (``Env.setup``'s untrainable ones, a
    judge or a simulated user, are the environment's), that sampled a token. A failed trace is a RolloutError;
    refused (``RolloutRefused``: a function of the seeds, not retried) are an episode with nothing to train, a
    branch that carries its own advantages (verifiers_rl computes them from the rewards), and trainable traces that
    score differently (each branch trains with the episode's one reward: record the episode's outcome on each
    trainable trace)."""
    played = [trace for trace in traces if trace.get("trainable", True)]
    for trace in played:
        if not trace["ok"]:
            raise RolloutError(f"{where}: the trace failed: {'; '.join(trace['errors']) or 'no error given'}")
    pairs = [(trace, branch) for trace in played for branch in trace["branches"]
             if branch["trainable"] and True in branch["sampled_mask"]]
    if not pairs:
        stops = ", ".join(sorted({str(trace["stop_condition"]) for trace in played})) or "none"
        raise RolloutRefused(f"{where}: the episode has no trainable branch that sampled a token (stop condition "
                             f"{stops}).")
    if any(branch.get("advantages") is not None for _, branch in pairs):
        raise RolloutRefused(f"{where}: the trace carries its own advantages; verifiers_rl computes advantages from "
                             "the rewards (--scale_rewards).")
    rewards = sorted({float(trace["reward"]) for trace, _ in pairs})
    if len(rewards) > 1:
        raise RolloutRefused(
            f"{where}: the episode's trainable traces score differently ({', '.join(map(str, rewards))}); verifiers_rl "
            "trains every branch of an episode with the episode's one reward (docs/environments.md, episodes of "
            "several branches): record the episode's outcome on each trainable trace, or mark a seat untrainable.")
    return [(trace, {**branch, "of_several": len(pairs) > 1}) for trace, branch in pairs]
