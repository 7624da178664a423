"""Runs episodes of a verifiers 0.4 (``verifiers.v1``) environment, unchanged, for the trainer, in the venv
``scripts/install_verifiers_v1.sh`` makes (verifiers 0.4 cannot share the trainer's venv). A standalone script:
it imports nothing from verifiers_rl (which is not installed there).

    .venv-verifiers-v1/bin/python verifiers_rl/v1_worker/episode_worker.py

Protocol: JSON lines, requests on stdin, answers on stdout (verifiers' own prints and logs go to stderr).

* ``{"op": "load", "env": <module id, or a .py file / package folder>, "env_config": {...}, "harness": "null" |
  "inprocess" | <harness id>, "runtime": {"type": "subprocess"}}`` -> ``{"op": "loaded", "num_tasks": n,
  "tasks": [<task data>...], "env_id": ..., "harness": ...}``. ``env_config`` merges into v1's env config (e.g.
  ``{"taskset": {"num_tasks": 8}}``). ``harness`` defaults to ``"null"`` (v1's chat harness, a PEP 723 program
  run with ``uv``); ``"inprocess"`` is the same chat loop in this process (no subprocess, no ``uv``). Every seat
  the environment declares (``agent`` for a plain taskset, TextArena's ``player``, ...) plays under ``harness``
  and ``runtime``, except where its author pinned them.
* ``{"op": "run", "id": <any>, "task": <index>, "base_url": ".../v1", "model": <name>, "renderer_model": <folder>}``
  -> ``{"op": "episode", "id": ..., "ok": bool, "errors": [<the episode's, then its traces'>], "traces": [{"ok",
  "trainable", "reward", "rewards", "metrics", "errors", "stop_condition", "is_timeout", "is_truncated",
  "last_reply", "branches": [{"token_ids", "sampled_mask", "logprobs", "trainable", "advantages"}]}]}``. Runs
  concurrently; answers come in completion order. A trace's ``trainable`` is False for a seat the environment
  marks untrainable (a judge, a simulated user). The API key is read from the environment variable
  ``VERIFIERS_RL_V1_API_KEY``. For a model without a renderer of its own in the ``renderers`` package, turns are
  bridged by ``bridge_renderer.py`` (the sampled ids kept verbatim: one branch per episode of one agent).
* ``{"op": "cancel", "id": <a run's id>}``: stop that run's episode (its group failed); no answer.
* ``{"op": "close"}`` or end of input: exit.

Any request that fails answers ``{"op": "error", "id": ..., "error": <type: message>, "traceback": ...}``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
import traceback
import types
from pathlib import Path

API_KEY_VAR = "VERIFIERS_RL_V1_API_KEY"
INPROCESS_HARNESS_ID = "verifiers_rl_inprocess_chat"
BRIDGE_RENDERER_FILE = Path(__file__).resolve().parent / "bridge_renderer.py"

# The protocol's channel is the real stdout; anything verifiers prints lands on stderr.
_OUT = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
sys.stdout = sys.stderr


def send(message: dict) -> None:
    _OUT.write(json.dumps(message, allow_nan=False) + "\n")
    _OUT.flush()


def module_id(env: str) -> str:
    """A v1 taskset id for ``env``: an importable module as is; a ``.py`` file or a package folder by its name,
    with its parent folder put on ``sys.path`` (v1 loads tasksets by import)."""
    path = Path(env)
    if env.endswith(".py") or path.is_dir():
        path = path.resolve()
        if not path.exists():
            raise FileNotFoundError(f"no environment at {env}")
        sys.path.insert(0, str(path.parent))
        return path.stem if path.suffix == ".py" else path.name
    sys.path.insert(0, os.getcwd())  # a module id resolves from the trainer's working folder too, as `python -m`
    return env


def register_inprocess_harness() -> None:
    """A chat harness whose loop runs in this process: one model call per segment through the interception
    endpoint (as every harness must call the model), no subprocess, no ``uv``. Registered as an importable
    module so v1's loader finds it by id."""
    import verifiers.v1 as vf
    from openai import AsyncOpenAI
    from verifiers.v1.runtimes import ProgramResult

    class InProcessChatHarness(vf.Harness[vf.HarnessConfig]):
        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            else:
                messages += [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt or []]
            async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            return ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")

    module = types.ModuleType(INPROCESS_HARNESS_ID)
    module.InProcessChatHarness = InProcessChatHarness
    module.__all__ = ["InProcessChatHarness"]
    sys.modules[INPROCESS_HARNESS_ID] = module


def keep_uv_offline() -> None:
    """With ``UV_OFFLINE`` in this worker's environment (the trainer sets it: rollouts download nothing), no host
    process of v1's can turn it off: v1's ``Runtime.prepare_uv_script`` runs ``uv sync --script`` with
    ``UV_OFFLINE=false`` (to fetch a harness's dependencies before a sandbox's network is cut), which here would
    download them from PyPI at rollout time; ``scripts/install_verifiers_v1.sh`` puts them in uv's cache instead."""
    if "UV_OFFLINE" not in os.environ:
        return
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    process_env = SubprocessRuntime.process_env

    def offline_process_env(self, env: dict[str, str]) -> dict[str, str]:
        return {**process_env(self, env), "UV_OFFLINE": os.environ["UV_OFFLINE"]}

    SubprocessRuntime.process_env = offline_process_env


def explain(error: str) -> str:
    """``error``, with what to do when it is v1 failing to prepare a PEP 723 script offline."""
    if "failed to prepare uv script" in error and "UV_OFFLINE" in os.environ:
        return (f"{error}\n(the worker runs uv with UV_OFFLINE={os.environ['UV_OFFLINE']}: rollouts download nothing, "
                "and uv's cache lacks this script's dependencies; run scripts/install_verifiers_v1.sh, which pre-syncs "
                "the null harness's script)")
    return error


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@functools.cache
def bridge_renderer(renderer_model: str | None):
    """``bridge_renderer.ExactBridgeRenderer`` for a model without a renderer of its own in the ``renderers``
    package (where v1 would fall back to ``DefaultRenderer``, which re-tokenises every turn); None (v1 resolves
    the model's own renderer, whose bridge is exact) otherwise."""
    from renderers import CustomRendererConfig
    from renderers.base import MODEL_RENDERER_MAP

    if renderer_model is None or renderer_model in MODEL_RENDERER_MAP:
        return None
    return CustomRendererConfig(import_path=f"{BRIDGE_RENDERER_FILE}:ExactBridgeRenderer")


def seats(taskset_id: str, env_id: str = "") -> dict[str, set[str]]:
    """The environment's own seats (its ``AgentConfig`` fields: ``agent`` for a plain taskset, TextArena's
    ``player``, ...), each with the fields its author pinned: the worker's harness and runtime fill only the rest."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type

    fields = env_config_type(taskset_id, env_id).model_fields
    return {name: {key for key in field.default.model_fields_set if getattr(field.default, key) is not None}
            for name, field in fields.items() if isinstance(field.default, AgentConfig)}


def pinned_harnesses(taskset_id: str, env_id: str = "") -> dict[str, str]:
    """The harness id each seat's author pinned (``seats``), by seat."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type

    fields = env_config_type(taskset_id, env_id).model_fields
    return {name: field.default.harness.id for name, field in fields.items()
            if isinstance(field.default, AgentConfig) and field.default.harness is not None}


def trace_json(trace) -> dict:
    return {
        "ok": bool(trace.ok),
        # An untrainable seat's trace (Env.setup marks a judge or simulated user so) is the environment's, not ours.
        "trainable": bool(trace.agent.trainable) if trace.agent is not None else True,
        "reward": float(trace.reward),
        "rewards": {k: (None if r is None else float(r.value)) for k, r in trace.rewards.items()},
        "metrics": {k: (None if v is None else float(v)) for k, v in trace.metrics.items()},
        "errors": [explain(f"{e.type}: {e.message}") for e in trace.errors],
        "stop_condition": trace.stop_condition,
        "is_timeout": bool(trace.is_timeout),
        "is_truncated": bool(trace.is_truncated),
        "last_reply": trace.last_reply,
        "branches": [
            {"token_ids": list(b.token_ids), "sampled_mask": [bool(m) for m in b.sampled_mask],
             "logprobs": [float(x) for x in b.logprobs], "trainable": bool(b.trainable),
             "advantages": None if b.advantages is None else [float(x) for x in b.advantages]}
            for b in trace.branches
        ],
    }


class Worker:
    def __init__(self):
        self.env = None
        self.tasks = None
        self.serving = None

    async def load(self, request: dict) -> dict:
        import verifiers.v1 as vf

        if self.env is not None:
            raise RuntimeError("an environment is already loaded")
        keep_uv_offline()
        asked = request.get("harness")  # None: the trainer's default, v1's null harness where no author pinned one
        harness = asked or "null"
        if harness == "inprocess":
            register_inprocess_harness()
            harness = INPROCESS_HARNESS_ID
        taskset_id, env_config = module_id(request["env"]), request.get("env_config") or {}
        defaults = {"harness": {"id": harness}, "runtime": request.get("runtime") or {"type": "subprocess"}}
        pinned_by_seat = seats(taskset_id, env_config.get("id") or "")
        if asked is not None and pinned_by_seat and all("harness" in pinned for pinned in pinned_by_seat.values()):
            own = ", ".join(f"{seat}: {harness_id}" for seat, harness_id in
                            pinned_harnesses(taskset_id, env_config.get("id") or "").items())
            raise ValueError(f"harness {asked!r} (--env_args) reaches no seat: every seat of the environment pins its "
                             f"own ({own}). Leave harness out.")
        seat_configs = {seat: {key: value for key, value in defaults.items() if key not in pinned}
                        for seat, pinned in pinned_by_seat.items()}
        config = merge({"taskset": {"id": taskset_id}, **seat_configs}, env_config)
        self.env = vf.load_environment(vf.resolve_env_config(config))
        self.tasks = list(self.env.taskset)
        self.serving = self.env.serving()
        await self.serving.__aenter__()
        return {"op": "loaded", "num_tasks": len(self.tasks), "env_id": self.env.config.env_id, "harness": harness,
                "tasks": [t.data.model_dump(mode="json", exclude_none=True) for t in self.tasks]}

    async def run(self, request: dict) -> dict:
        import verifiers.v1 as vf

        if self.env is None:
            raise RuntimeError("load an environment first")
        task = self.tasks[int(request["task"])]
        client = vf.TrainClientConfig(base_url=request["base_url"], api_key_var=API_KEY_VAR,
                                      renderer_model_name=request.get("renderer_model"),
                                      renderer=bridge_renderer(request.get("renderer_model")))
        episode = await self.env.run_episode(task, vf.ModelContext(model=request["model"], client=client))
        traces = [trace_json(t) for t in episode.traces]
        # A trace's failure (e.g. its harness's setup) leaves the episode's own errors empty: the trainer reads these.
        errors = [explain(f"{e.type}: {e.message}") for e in episode.errors] + [e for t in traces for e in t["errors"]]
        return {"op": "episode", "id": request.get("id"), "ok": bool(episode.ok), "errors": list(dict.fromkeys(errors)),
                "traces": traces}

    async def close(self) -> None:
        if self.serving is not None:
            serving, self.serving = self.serving, None
            await serving.__aexit__(None, None, None)


async def main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    worker, pending = Worker(), {}  # the runs in flight, by request id

    async def answer(request: dict) -> None:
        try:
            op = request.get("op")
            if op == "load":
                reply = await worker.load(request)
            elif op == "run":
                reply = await worker.run(request)
            else:
                raise ValueError(f"unknown op {op!r}")
            send({**reply, "id": request.get("id")})
        except Exception as e:  # noqa: BLE001 - every failure goes back to the trainer, named
            send({"op": "error", "id": request.get("id"), "error": explain(f"{type(e).__name__}: {e}"),
                  "traceback": traceback.format_exc()})

    try:
        while line := await reader.readline():
            if not line.strip():
                continue
            request = json.loads(line)
            if request.get("op") == "close":
                break
            if request.get("op") == "load":
                await answer(request)  # runs wait for the environment
            elif request.get("op") == "cancel":
                if (task := pending.get(request.get("id"))) is not None:
                    task.cancel()  # v1's episode unwinds: its harness and model calls stop
            else:
                task = asyncio.create_task(answer(request))
                pending[request.get("id")] = task
                task.add_done_callback(lambda _, key=request.get("id"): pending.pop(key, None))
        if pending:
            await asyncio.gather(*pending.values(), return_exceptions=True)
    finally:
        await worker.close()


if __name__ == "__main__":
    asyncio.run(main())
