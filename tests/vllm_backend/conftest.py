"""A real vLLM server per tiny model (untied and tied embeddings), started once per session.

The vLLM venv is created by ``scripts/install_vllm.sh`` when missing (~2 min, printed as it goes). Both servers
start side by side (~30-40 s with ``--enforce-eager``) and are stopped at the end of the session; a test that
kills one (tests/vllm_backend/test_zz_*.py run last) leaves the next user of the fixture a fresh one.

Both servers need an API key (``API_KEY``, in ``$VLLM_API_KEY`` for the session), as a server reachable from other
machines must: every client here, and every training run the tests launch, sends it.
"""

from __future__ import annotations

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

    @property
    def url(self) -> str:
        return self.server.url

    def ensure_running(self) -> "Served":
        """Restart the server if a test killed it."""
        if self.server.process is None or self.server.process.poll() is not None or not self.server.healthy():
            self.server.stop()
            self.server = _server(self.model_dir).start()
            self.dirty = False
        return self

    def restart_same_port(self) -> "Served":
        """Start a new server for model_dir at the address of this one (which a test killed), and wait for it."""
        port = self.server.port
        self.server.stop()
        self.server = _server(self.model_dir, port=port).start()
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


def _server(model_dir: str, port: int | None = None) -> VLLMServer:
    # The log stays beside the model (pytest keeps its last temporary folders) for a post-mortem.
    log = Path(model_dir).with_suffix(f".{time.strftime('%H%M%S')}.server.log")
    # The gloo weight-transfer backend on: clients can then send weights either way (files or gloo).
    return VLLMServer(model_dir, port=port, max_model_len=MAX_MODEL_LEN, startup_timeout_s=400, log_path=log,
                      weight_transfer="gloo", api_key=API_KEY)


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
        served[name] = Served(name, str(model_dir), str(other_dir), tied, _server(str(model_dir)))
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


@pytest.fixture(scope="session")
def _doomed_server(vllm_servers):
    base = vllm_servers["untied"]
    served = Served("doomed", base.model_dir, base.other_dir, base.tied, _server(base.model_dir))
    served.server.start()
    yield served
    served.server.stop()


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
