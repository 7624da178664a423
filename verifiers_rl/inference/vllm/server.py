"""Start (and stop) a vLLM server that ``VLLMEngine`` can sample from and load weights into.

    scripts/install_vllm.sh                                       # once: vLLM in its own venv (.venv-vllm)
    verifiers-rl vllm-serve --model DIR --port 8000
    verifiers-rl vllm-serve --model DIR --then python examples/train.py --model DIR   # both
    verifiers-rl vllm-serve --model DIR --num-servers 2 --then python examples/train.py ...
    python examples/train.py --model DIR --vllm_server_url http://127.0.0.1:8000 ...

In Python (tests): ``with VLLMServer(model_dir) as server: VLLMEngine(server.url, model=model_dir)``.

The server runs ``<venv>/bin/python -m vllm.entrypoints.cli.main serve`` in its own process group with what weight
sync and exact log-probs need: ``--logprobs-mode processed_logprobs`` (sampler log-probs at the sampling
temperature), ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc``), our worker extension on ``PYTHONPATH``, and
``--generation-config vllm`` (the checkpoint's sampling defaults never apply), ``--enable-prefix-caching`` (a
group's samples share their prompt; the client resets the cache after every weight load), ``--no-enable-chunked-prefill``
(every request is seeded, and vLLM's CPU runner dies rewinding a seeded generator after a partial prefill, as soon as
the waiting prompts exceed a step's tokens). On CPU: ``--enforce-eager``, float32, both cores.

Security: with ``$VLLM_API_KEY`` set, every route but ``/health`` needs the key (the client sends the same variable);
without it the server may only listen on loopback, since its weight-loading routes would load what anyone sends.
Preemption: with ``--then``, a SIGTERM or SIGINT goes on to the command, which gets ``--stop-grace-s`` to exit
(a trainer writes its checkpoint) before the server stops; a second signal stops both at once.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from verifiers_rl.vllm_worker.vllm_auth import KEY_ENV as API_KEY_ENV
from verifiers_rl.core.engine import WORKER_EXTENSION, free_port, is_loopback
from verifiers_rl.core.flags import repeated_flag
from verifiers_rl.core.models import resolve_model
from verifiers_rl.inference.vllm.processes import ProcessFamily, run_preemptible
from verifiers_rl.inference.vllm.weight_transfer import SERVER_BACKENDS, TRANSFERS

ROOT = Path(__file__).resolve().parents[3]
WORKER_DIR = Path(__file__).resolve().parents[2] / "vllm_worker"
VENV_ENV_VAR = "VERIFIERS_RL_VLLM_VENV"
AUTH_MIDDLEWARE = "vllm_auth.RequireAPIKey"
KV_CACHE_GIB = 1  # the CPU build's KV cache (VLLM_CPU_KVCACHE_SPACE): ample for the small models it serves
# Variables of a torch.distributed launch: a server started from inside a rank must not join that job.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                "ROLE_RANK", "TORCHELASTIC_RUN_ID", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")


# A watchdog beside the server: if this process dies without stopping it (SIGKILL, a killed test run: no atexit),
# it kills the server's process group (API server, engine core, workers) and removes its folder. Polls, so it
# works whichever thread started the server. argv: parent pid, server process group, folder.
_WATCHDOG = """
import os, shutil, signal, sys, time
parent, group, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
while True:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        sys.exit(0)  # the server is gone (stopped normally)
    if os.getppid() != parent:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        time.sleep(1)
        shutil.rmtree(folder, ignore_errors=True)
        sys.exit(0)
    time.sleep(0.5)
"""


class VLLMServerError(RuntimeError):
    """The server could not be started (missing venv, died during startup, not ready in time)."""


def _check_exposure(host: str, api_key: str | None, extra_args: list[str]) -> None:
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in extra_args):
        raise VLLMServerError(f"Pass the API key in ${API_KEY_ENV}, not as --api-key: a command line is readable by "
                              "every user of the machine (ps), and only the variable also guards the weight routes.")
    if not api_key and not is_loopback(host):
        raise VLLMServerError(
            f"--host {host} makes the vLLM server reachable from other machines, and its weight-loading routes "
            f"(/collective_rpc, /update_weights, ...) would load whatever anyone sends. Set {API_KEY_ENV} to a secret "
            f"(the launcher and the trainer both read it; every route but /health then needs it), or serve on "
            f"127.0.0.1."
        )


def cpu_build(venv: Path) -> bool:
    """Whether ``venv`` holds vLLM's CPU build (``vllm-cpu``, as ``scripts/install_vllm.sh`` installs it); True for a
    venv not there yet (starting it says so)."""
    return not venv.exists() or any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def default_venv() -> Path:
    """``$VERIFIERS_RL_VLLM_VENV``, else ``<repo>/.venv-vllm`` (what ``scripts/install_vllm.sh`` creates)."""
    return Path(os.environ.get(VENV_ENV_VAR) or ROOT / ".venv-vllm")


class VLLMServer:
    """A vLLM OpenAI-compatible server in a child process group; a context manager (``stop()`` on exit).

    Args:
        model: local folder (or hub id) of the model.
        port: default: a free port. ``host``: default 127.0.0.1.
        served_model_name: the name clients send (default: ``model`` as given).
        venv: the vLLM venv (default ``default_venv()``).
        max_model_len: longest prompt + completion.
        dtype: default float32 (CPU); ``"auto"`` on a GPU.
        enforce_eager: skip torch.compile and graph capture (~40 s faster to start on CPU).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``, whole GiB (CPU build only: another value is refused for a venv
            holding another build).
        max_logprobs: most log-probs per token a request may ask for.
        extra_args / extra_env: passed through to ``vllm serve`` / its environment.
        weight_transfer: how clients will send weights: ``"files"`` (snapshots; always available), ``"nccl"``
            (GPU servers) or ``"gloo"`` (CPU servers) set vLLM's ``--weight-transfer-config`` backend, after which
            snapshots still work too.
        log_path: where the server's output goes (default: in its temporary folder); ``"-"``: this terminal.
        die_with_parent: a watchdog process kills the server if this process dies without stopping it.
        api_key: clients must send it (``Authorization: Bearer``) on every route but ``/health``; default
            ``$VLLM_API_KEY``. Passed to vLLM in its environment (never on a command line, which any local user
            can read), and enforced on all routes by ``vllm_worker/vllm_auth.py`` (vLLM's own check covers
            ``/v1`` only). Required when ``host`` is not a loopback address.

    ``start()`` waits for ``/health`` (``startup_timeout_s``), printing progress; if the server dies first it
    raises ``VLLMServerError`` with the tail of its log. ``stop()`` stops the whole process tree (the API server
    spawns the engine core and its workers) and removes the temporary folder.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        port: int | None = None,
        host: str = "127.0.0.1",
        served_model_name: str | None = None,
        venv: str | os.PathLike | None = None,
        max_model_len: int = 2048,
        dtype: str = "float32",
        enforce_eager: bool = True,
        kv_cache_gib: int = KV_CACHE_GIB,
        max_logprobs: int = 5,
        extra_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = 300.0,
        progress: bool = True,
        die_with_parent: bool = True,
        weight_transfer: str = "files",
        api_key: str | None = None,
    ):
        self.api_key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
        _check_exposure(host, self.api_key, extra_args or [])
        self.model = str(model)
        self.host = host
        self.port = int(port) if port else free_port()
        self.served_model_name = served_model_name or self.model
        self.venv = Path(venv) if venv else default_venv()
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        if kv_cache_gib != KV_CACHE_GIB and not cpu_build(self.venv):
            raise VLLMServerError(
                f"--kv-cache-gib {kv_cache_gib} sizes the KV cache of vLLM's CPU build; {self.venv} holds another "
                "build, which sizes its cache from the GPU's free memory: pass vLLM's --gpu-memory-utilization "
                "after the other flags instead.")
        self.kv_cache_gib = kv_cache_gib
        self.max_logprobs = max_logprobs
        self.extra_args = list(extra_args or [])
        # weight_transfer's choices: the launcher's --weight-transfer (argparse), RLConfig's for the trainer.
        self.weight_transfer = weight_transfer
        self.extra_env = dict(extra_env or {})
        self.startup_timeout_s = startup_timeout_s
        self.progress = progress
        self.die_with_parent = die_with_parent
        self.watchdog: subprocess.Popen | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="vllm-server-"))
        self._inherit_output = str(log_path) == "-"
        self.log_path = self._tmp / "server.log" if not log_path or self._inherit_output else Path(log_path)
        self.process: subprocess.Popen | None = None
        self._log = None
        self._stopped = threading.Event()
        self._launched_at = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_name(self) -> str:
        return "this terminal" if self._inherit_output else str(self.log_path)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def command(self) -> list[str]:
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--served-model-name", self.served_model_name,
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", str(self.max_logprobs),
            "--generation-config", "vllm",
            "--worker-extension-cls", WORKER_EXTENSION,
            # A group's samples share their prompt: said here, not left to vLLM's per-platform default.
            "--enable-prefix-caching",
            # The token-in-token-out route, whose outputs say which loaded weights sampled each token
            # (continuous generation records them: verifiers_rl/inference/vllm/versions.py).
            "--enable-scale-out",
            # Whole prefills only: after a partial one vLLM rewinds a seeded request's generator, which a CPU generator
            # cannot do (RuntimeError "CPU Generator does not use offset" kills the engine once prompts exceed a step).
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(self.max_model_len, 2048)),
        ]
        if self.api_key:
            cmd += ["--middleware", AUTH_MIDDLEWARE]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.weight_transfer in SERVER_BACKENDS:  # files need nothing: the extension reloads snapshots
            cmd += ["--weight-transfer-config", json.dumps({"backend": SERVER_BACKENDS[self.weight_transfer]})]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        env.update(
            HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"),
            VLLM_SERVER_DEV_MODE="1",  # /collective_rpc and /reset_prefix_cache
            VLLM_CPU_KVCACHE_SPACE=str(int(self.kv_cache_gib)),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",  # vLLM would otherwise keep one of the (2) cores idle
            VLLM_CACHE_ROOT=str(self._tmp / "cache"),  # not ~/.cache/vllm
            VLLM_RPC_BASE_PATH=str(self._tmp),  # its zmq IPC sockets, removed with the folder
            PYTHONPATH=str(WORKER_DIR),  # the weight-sync extension alone (no verifiers_rl, no trainer deps)
            PYTHONUNBUFFERED="1",
        )
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key  # vLLM guards /v1 with it, our middleware every other route
        env.update(self.extra_env)
        return env

    def start(self) -> "VLLMServer":
        """Launch and wait until ``/health`` answers 200."""
        self.launch()
        try:
            self.wait_ready(self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> "VLLMServer":
        """Start the process without waiting (then ``wait_ready``): lets several servers start side by side."""
        if self.process is not None:
            raise VLLMServerError("This server was already started.")
        if not self.python.is_file():
            raise VLLMServerError(
                f"No vLLM venv at {self.venv} ({self.python} is missing). Install it with "
                f"scripts/install_vllm.sh [{self.venv}] (~2 min), or point {VENV_ENV_VAR} to one."
            )
        check_port_free(self.host, self.port)
        if not self._inherit_output:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command(),
            env=self.environment(),
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() kills the engine core and workers too
        )
        atexit.register(self.stop)
        if self.die_with_parent:
            self.watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.process.pid), str(self._tmp)],
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        self.say(f"starting vLLM for {self.model} at {self.url} (pid {self.process.pid}, log {self.log_name})")
        self._launched_at = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until ``/health`` answers 200 (``timeout_s`` counted from the launch); raise with the log's tail
        if the server exits or the time runs out."""
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        started = self._launched_at
        next_note = started + 15
        while True:
            if self.process.poll() is not None:
                raise VLLMServerError(
                    f"The vLLM server for {self.model} exited with code {self.process.returncode} during startup. "
                    f"Last lines of {self.log_name}:\n{self.log_tail()}"
                )
            if self.healthy():
                self.say(f"vLLM ready at {self.url} after {time.monotonic() - started:.0f} s")
                return
            now = time.monotonic()
            if now - started > timeout_s:
                raise VLLMServerError(
                    f"The vLLM server for {self.model} at {self.url} was not ready within {timeout_s:.0f} s. "
                    f"Last lines of {self.log_name}:\n{self.log_tail()}"
                )
            if now >= next_note:
                self.say(f"... waiting for vLLM at {self.url} ({now - started:.0f} s)")
                next_note = now + 15
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        if self._inherit_output:
            return "(the server's output went to this terminal)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole server process tree (tests use it to simulate a crash)."""
        if self.process is not None and self.process.poll() is None:
            ProcessFamily(self.process.pid).signal(sig)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process tree, SIGKILL what is left after ``grace_s``; remove the temporary folder."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.process is not None:
            # The engine core / workers may outlive the API server: the family includes its process group.
            ProcessFamily(self.process.pid).stop(grace_s)
            self.process.wait()
        if self.watchdog is not None:
            try:  # it exits by itself within 0.5 s of the group being gone
                self.watchdog.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.watchdog.kill()
                self.watchdog.wait()
        if self._log is not None:
            self._log.close()
        try:
            atexit.unregister(self.stop)
        except Exception:  # noqa: BLE001
            pass
        # Keep a log that was asked for elsewhere; the rest goes.
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "VLLMServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def say(self, message: str) -> None:
        if self.progress:
            print(f"[vllm_server] {message}", file=sys.stderr, flush=True)


def check_port_free(host: str, port: int) -> None:
    """Raise ``VLLMServerError`` when a socket already listens on ``host:port``: a server there would answer the new
    one's /health, and the trainer would be sent to it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as error:
            raise VLLMServerError(f"--port {port}: {host}:{port} is in use ({error.strerror}); a server already there "
                                  "would answer for this one. Stop it, or pick a free --port.") from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="verifiers-rl vllm-serve",
        description="Serve a model with vLLM for verifiers_rl (generation + weight sync); Ctrl-C stops it.",
        allow_abbrev=False,  # else a prefix of one of ours (--max-model) would set it instead of reaching vLLM
    )
    parser.add_argument("--model", required=True,
                        help="local folder (or hub id) of the model; 'smollm2' and 'tiny' as training's --model")
    parser.add_argument("--port", type=int, default=8000, help="the (first) server's port (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s; 0.0.0.0 for trainers on other machines, "
                        f"which needs ${API_KEY_ENV})")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    parser.add_argument("--venv", default=None, help=f"the vLLM venv (default ${VENV_ENV_VAR} or <repo>/.venv-vllm)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="longest prompt + completion a request may hold, at least the run's --max_seq_len "
                        "(default: %(default)s)")
    parser.add_argument("--dtype", default="float32", help="vLLM's weight and activation dtype (default: %(default)s)")
    parser.add_argument("--no-enforce-eager", action="store_true", help="allow torch.compile / CUDA graphs")
    parser.add_argument("--kv-cache-gib", type=int, default=KV_CACHE_GIB,
                        help="KV cache size on CPU, whole GiB (default: %(default)s)")
    parser.add_argument("--max-logprobs", type=int, default=5,
                        help="most log-probs per token a request may ask for (default: %(default)s)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0,
                        help="how long to wait for the server's /health before giving up (default: %(default)s)")
    parser.add_argument("--log", default="-", help="file for the server's output (default: this terminal)")
    parser.add_argument("--weight-transfer", choices=TRANSFERS, default="files",
                        help="how the trainer sends weights: files (snapshots on a shared filesystem), nccl (GPUs), "
                        "gloo (CPUs); with --then the training command gets --vllm_weight_transfer too")
    parser.add_argument("--num-servers", type=int, default=1,
                        help="start this many servers of the model on consecutive ports from --port (their logs: "
                        "--log with .0, .1, ... before its suffix); --then gets their comma-joined URLs, and all of "
                        "them stop together")
    parser.add_argument("--then", action="store_true",
                        help="everything after --then is a command to run once the server is up, with "
                        "--vllm_server_url URL appended; the server stops when it ends, and its exit code is ours. "
                        "SIGTERM/SIGINT go on to the command, which gets --stop-grace-s to exit before the server "
                        "stops; a second signal stops both at once")
    parser.add_argument("--stop-grace-s", type=float, default=1800.0,
                        help="with --then: how long the command may take to exit after a SIGTERM/SIGINT (to finish "
                        "its step and write a checkpoint) before it is killed (default: %(default)s s)")
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--then" in argv:
        split = argv.index("--then")
        argv, command = argv[:split], argv[split + 1 :]
        if not command:
            parser.error("--then needs a command after it")
        if shutil.which(command[0]) is None:  # else a traceback once the servers are up, 30-90 s later
            parser.error(f"--then {command[0]}: no such command (not on PATH, nor an executable file)")
    why = repeated_flag(parser, argv)
    if why:
        parser.error(why)
    args, extra = parser.parse_known_args(argv)
    _refuse_abbreviations(parser, extra)
    try:  # before a server starts: a wrong path is one line now, not vLLM's traceback 20 s later
        args.model = resolve_model(args.model)
    except FileNotFoundError as error:
        parser.error(str(error))
    _check_numbers(parser, args)
    appended = ["vllm_server_url"] + (["vllm_weight_transfer"] if args.weight_transfer != "files" else [])
    own = _flag_given(command, appended)
    if own:
        parser.error(f"--then's command sets {own}, which vllm-serve overrides (it appends --vllm_server_url with its "
                     "servers' URLs, and --vllm_weight_transfer with --weight-transfer's): leave it out.")
    if not command and args.stop_grace_s != parser.get_default("stop_grace_s"):
        parser.error(f"--stop-grace-s {args.stop_grace_s:g} acts only with --then (the command a signal goes on to): "
                     "it would change nothing. Leave it out, or run a command with --then.")
    servers: list[VLLMServer] = []
    try:
        for index in range(args.num_servers):
            servers.append(VLLMServer(
                args.model, port=args.port + index, host=args.host, served_model_name=args.served_model_name,
                venv=args.venv, max_model_len=args.max_model_len, dtype=args.dtype,
                enforce_eager=not args.no_enforce_eager, kv_cache_gib=args.kv_cache_gib,
                max_logprobs=args.max_logprobs, extra_args=extra, startup_timeout_s=args.startup_timeout_s,
                log_path=_server_log(args.log, index, args.num_servers), weight_transfer=args.weight_transfer,
            ))
    except VLLMServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _interrupt)  # a job runner's SIGTERM stops the server like Ctrl-C does
    try:
        for server in servers:  # every port before any server starts loading
            check_port_free(server.host, server.port)
        for server in servers:  # side by side: each loads the model while the others do
            server.launch()
        for server in servers:
            server.wait_ready()
        urls = ",".join(server.url for server in servers)
        logs = ", ".join(server.log_name for server in servers)
        if command:
            command = command + ["--vllm_server_url", urls]
            if args.weight_transfer != "files":
                command += ["--vllm_weight_transfer", args.weight_transfer]
            print(f"vLLM serving {args.model} at {urls} (log: {logs}); running: {' '.join(command)}", flush=True)
            return run_preemptible(command, args.stop_grace_s, say=servers[0].say)
        print(f"vLLM serving {args.model} at {urls} (log: {logs}); Ctrl-C stops it.", flush=True)
        while all(server.process.poll() is None for server in servers):
            time.sleep(1.0)
        exited = next(server for server in servers if server.process.poll() is not None)
        print(f"The vLLM server at {exited.url} exited with code {exited.process.returncode}:\n{exited.log_tail()}",
              file=sys.stderr)
        return 1
    except VLLMServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for server in servers:
            server.stop()


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Numbers vLLM would refuse only after starting (a traceback 10-30 s later), each refused by its flag now."""
    for flag, value, ok, allowed in (("--num-servers", args.num_servers, args.num_servers >= 1, ">= 1"),
                                     ("--max-model-len", args.max_model_len, args.max_model_len >= 1, ">= 1"),
                                     ("--kv-cache-gib", args.kv_cache_gib, args.kv_cache_gib >= 1, ">= 1"),
                                     ("--startup-timeout-s", args.startup_timeout_s, args.startup_timeout_s > 0, "> 0")):
        if not ok:
            parser.error(f"{flag} must be {allowed}, got {value}")
    last = args.port + args.num_servers - 1  # the servers take consecutive ports from --port
    if args.port < 0 or last > 65535:
        servers = f" (its {args.num_servers} servers would end at {last})" if args.num_servers > 1 else ""
        parser.error(f"--port {args.port}{servers}: ports are 0-65535 (0: a free one).")
    if args.port == 0 and args.num_servers > 1:
        parser.error(f"--port 0 picks a free port for one server; --num-servers {args.num_servers} takes consecutive "
                     "ports from --port: give the first.")


def _refuse_abbreviations(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Refuse an argument for vLLM that abbreviates one of ours: vLLM takes abbreviations, and would set its flag of
    that name behind ours (``--po 8001``: vLLM would serve on 8001 while we wait for --port's server)."""
    ours = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    for token in extra:
        name = token.split("=", 1)[0]
        whole = [flag for flag in ours if name.startswith("--") and flag.startswith(name) and flag != name]
        if whole:
            parser.error(f"{name} abbreviates {' or '.join(whole)}: give the whole flag (abbreviations are refused).")


def _flag_given(command: list[str], names: list[str]) -> str | None:
    """How ``command`` sets one of the flags ``names`` (``--name V``, ``--name=V``, dashes or underscores), or None."""
    spellings = {f"--{form}" for name in names for form in (name, name.replace("_", "-"))}
    for index, token in enumerate(command):
        flag = token.split("=", 1)[0]
        if flag in spellings:
            value = "" if "=" in token or index + 1 == len(command) else f" {command[index + 1]}"
            return token + value
    return None


def _server_log(log: str, index: int, count: int) -> str:
    """Server ``index``'s log: ``log`` itself for one server or the terminal (``-``), else ``name.<index>.suffix``."""
    if count == 1 or log == "-":
        return log
    path = Path(log)
    return str(path.with_name(f"{path.stem}.{index}{path.suffix}"))


if __name__ == "__main__":
    sys.exit(main())
