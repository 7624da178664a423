"""A real vLLM server per tiny model (untied and tied embeddings), started once per session.

The vLLM venv is created by ``scripts/install_vllm.sh`` when missing (~2 min, printed as it goes). Both servers
start side by side (~30-40 s with ``--enforce-eager``) and are stopped at the end of the session. The tests that kill
a server kill ``doomed``, a third one of its own; while a test that leaves it dead (a module's ``LEAVES_DOOMED_DEAD``)
has a later user, one spare server starts beside it, which that user takes instead of a start of its own.

Both servers need an API key (``API_KEY``, in ``$VLLM_API_KEY`` for the session), as a server reachable from other
machines must: every client here, and every training run the tests launch, sends it.
"""

from __future__ import annotations

import itertools
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from verifiers_rl.inference.vllm.server import VLLMServer, default_venv

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 512
API_KEY = f"test-key-{secrets.token_hex(8)}"
_LOG_NUMBERS = itertools.count()


def _install_vllm_venv() -> Path:
    venv = default_venv()
    shim = list((venv / "lib").glob("python3*/site-packages/vllm-*.dist-info/METADATA"))
    if (venv / "bin" / "python").is_file() and shim:
        return venv
    print(f"\n[tests/vllm_backend] installing vLLM into {venv} with scripts/install_vllm.sh (~2 min) ...", flush=True)
    started = time.monotonic()
    process = subprocess.Popen(["bash", str(ROOT / "scripts" / "install_vllm.sh"), str(venv)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in process.stdout:
        tail = (tail + [line.rstrip()])[-40:]
        if line.startswith("[install_vllm]"):
            print(f"  {line.rstrip()} ({time.monotonic() - started:.0f} s)", flush=True)
    if process.wait() != 0:
        pytest.fail("scripts/install_vllm.sh failed:\n" + "\n".join(tail))
    return venv


@dataclass
class Served:
    """One tiny model, its server, and a differently-seeded model of the same shape (for weight loads)."""

    name: str
    model_dir: str
    other_dir: str
    tied: bool
    server: VLLMServer
    dirty: bool = False  # the server holds other weights than model_dir's
    spare: VLLMServer | None = None  # a launched server of model_dir, taken when this one is found dead
    spares_left: int = 0  # how many more times a user will find it dead (one spare at a time: memory)
    extra_args: tuple[str, ...] = ()  # the server's further vLLM flags

    def _server(self, port: int | None = None) -> VLLMServer:
        return _server(self.model_dir, port, self.extra_args)

    @property
    def url(self) -> str:
        return self.server.url

    def ensure_running(self) -> "Served":
        """Restart the server if a test killed it (take the spare if one was launched)."""
        if self.server.process is None or self.server.process.poll() is not None or not self.server.healthy():
            self.server.stop()
            self.server, self.spare = self.spare or self._server().launch(), None
            self.launch_spare()
            try:
                self.server.wait_ready()
            except BaseException:
                self.server.stop()
                raise
            self.dirty = False
        return self

    def launch_spare(self) -> None:
        """Start the next spare (without waiting for it) if a user will need one."""
        if self.spare is None and self.spares_left > 0:
            self.spare, self.spares_left = self._server().launch(), self.spares_left - 1

    def restart_same_port(self) -> "Served":
        """Start a new server for model_dir at the address of this one (which a test killed), and wait for it."""
        port = self.server.port
        self.server.stop()
        self.server = self._server(port).start()
        self.dirty = False
        return self

    def restore(self) -> "Served":
        """Load model_dir's own weights back if a test left others in the server."""
        if self.dirty:
            from verifiers_rl.inference import VLLMEngine

            engine = VLLMEngine(self.url, model=self.model_dir)
            try:
                engine.load_weights(self.hf_model().named_parameters(), version=0)
            finally:
                engine.close()
            self.dirty = False
        return self

    def hf_model(self, which: str = "model"):
        from transformers import AutoModelForCausalLM

        folder = self.model_dir if which == "model" else self.other_dir
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _server(model_dir: str, port: int | None = None, extra_args: tuple[str, ...] = ()) -> VLLMServer:
    # The log stays beside the model (pytest keeps its last temporary folders) for a post-mortem.
    log = Path(model_dir).with_suffix(f".{time.strftime('%H%M%S')}-{next(_LOG_NUMBERS)}.server.log")
    # The gloo weight-transfer backend on: clients can then send weights either way (files or gloo).
    return VLLMServer(model_dir, port=port, max_model_len=MAX_MODEL_LEN, startup_timeout_s=400, log_path=log,
                      weight_transfer="gloo", api_key=API_KEY, extra_args=list(extra_args))


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory):
    """``{"untied": Served, "tied": Served}``, both servers up."""
    if os.environ.get("VERIFIERS_RL_SKIP_VLLM"):
        pytest.skip("VERIFIERS_RL_SKIP_VLLM is set")
    from verifiers_rl.core.models import build_tiny_model

    _install_vllm_venv()
    saved_key = os.environ.get("VLLM_API_KEY")
    os.environ["VLLM_API_KEY"] = API_KEY  # what VLLMEngine and the launched training runs read
    root = tmp_path_factory.mktemp("vllm-models")
    served = {}
    for name, tied in (("untied", False), ("tied", True)):
        model_dir = build_tiny_model(root / name, tie_word_embeddings=tied, hidden_size=64, seed=0)
        other_dir = build_tiny_model(root / f"{name}-seed1", tie_word_embeddings=tied, hidden_size=64, seed=1)
        # The tied one runs without vLLM's token-in-token-out route, as a server started by hand may: the refusal of
        # per-token versions (continuous generation) is checked on it.
        extra_args = ("--no-enable-scale-out",) if tied else ()
        served[name] = Served(name, str(model_dir), str(other_dir), tied, _server(str(model_dir), None, extra_args),
                              extra_args=extra_args)
    try:
        for entry in served.values():
            entry.server.launch()
        for entry in served.values():
            entry.server.wait_ready()
        yield served
    finally:
        for entry in served.values():
            entry.server.stop()
        if saved_key is None:
            os.environ.pop("VLLM_API_KEY", None)
        else:
            os.environ["VLLM_API_KEY"] = saved_key


@pytest.fixture(params=["untied", "tied"])
def served(request, vllm_servers) -> Served:
    """Each model in turn, its server up and holding the model's own weights."""
    return vllm_servers[request.param].ensure_running().restore()


@pytest.fixture
def untied(vllm_servers) -> Served:
    return vllm_servers["untied"].ensure_running().restore()


@pytest.fixture
def tied(vllm_servers) -> Served:
    return vllm_servers["tied"].ensure_running().restore()


def _spares_needed(items) -> int:
    """How many times a ``doomed`` user will find it dead: tests that leave it dead, but for the last user."""
    users = [item for item in items if "doomed" in getattr(item, "fixturenames", ())]
    return sum(bool(getattr(getattr(item, "module", None), "LEAVES_DOOMED_DEAD", False)) for item in users[:-1])


@pytest.fixture(scope="session")
def _doomed_server(vllm_servers, request):
    base = vllm_servers["untied"]
    served = Served("doomed", base.model_dir, base.other_dir, base.tied, _server(base.model_dir))
    # Launched together: their starts overlap instead of following one another.
    served.server.launch()
    served.spares_left = _spares_needed(request.session.items)
    served.launch_spare()
    try:
        served.server.wait_ready()
        yield served
    finally:
        for server in filter(None, (served.server, served.spare)):
            server.stop()


@pytest.fixture
def doomed(_doomed_server) -> Served:
    """A server of its own (the untied model) for the tests that kill it: the shared servers stay up, so no test
    depends on the order the files run in. Restarted for each test that finds it dead."""
    return _doomed_server.ensure_running().restore()


def pytest_collection_modifyitems(items):
    # The marker says a test needs the vLLM venv and a server (its fixtures); a test that needs neither is unmarked.
    for item in items:
        if "vllm_servers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
