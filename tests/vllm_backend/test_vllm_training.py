"""examples/train.py under DDP (2 CPU processes) generating through a real vLLM server, and syncing weights to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from verifiers_rl.inference import VLLMEngine
from verifiers_rl.core.engine import free_port
from verifiers_rl.core.rollout import read_rollouts
from verifiers_rl.rollouts.continuous import position_of

from tests.vllm_backend.launching import (PREEMPTIBLE, PROBE, ROOT, RUNNER, assert_tokens_versioned, ddp_command,  # noqa: E402
                                         hf_prompt_logprobs, launch_env)


@pytest.mark.parametrize("config, transfer", [("ddp_cpu.yaml", "files"), ("zero3_cpu.yaml", "gloo")])
def test_two_process_training_generates_through_vllm_and_syncs_weights(untied, tmp_path, config, transfer):
    # DDP with snapshots, and DeepSpeed ZeRO-3 with broadcasts through vLLM's weight-transfer engine (the NCCL
    # path's protocol over gloo): each sync gathers the sharded weights bucket by bucket and streams them.
    untied.dirty = True  # the run leaves its trained weights in the server
    result = subprocess.run(ddp_command(untied.model_dir, untied.url, tmp_path, 2, config, transfer), cwd=ROOT,
                            env=launch_env(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    steps = [line.split(" | ")[0] for line in result.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step 1/2", "step 2/2"], result.stdout[-3000:]
    # The trainer's post-sync probe (engine vs trainer log-probs of a fixed sequence) passed after each step.
    assert "Weight sync probe FAILED" not in output
    gaps = [float(part.split()[1]) for line in result.stdout.splitlines() if line.startswith("step ")
            for part in line.split(" | ") if part.startswith("probe_gap ")]
    assert len(gaps) == 2 and max(gaps) < 1e-4, result.stdout[-3000:]

    states = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
              if line.startswith("ENGINE_STATE ")]
    assert len(states) == 1, "one engine, on the main process only"
    state = states[0]
    assert state["engine"] == "VLLMEngine" and state["health"]["ok"] is True
    assert state["policy_version"] == 2 and state["last_load"]["version"] == 2
    # 2 batches of 8, each generated when the trainer asked for it (k = 0: nothing runs ahead).
    assert state["requests_served"] == 2 * 8
    assert state["last_load"]["tensors"] == len(_parameter_names(untied.model_dir))
    assert state["last_load"].get("transfer", "files") == transfer

    # Synchronous generation (k = 0): batch 1 was sampled by version 1, i.e. after the first weight sync.
    rollouts = read_rollouts(tmp_path / "rollouts.jsonl")
    assert [r.policy_version for r in rollouts] == [0] * 8 + [1] * 8

    # The server now holds exactly the saved (trained) weights, which differ from the initial ones.
    engine = VLLMEngine(untied.url, model=untied.model_dir)
    served = torch.tensor(engine.prompt_logprobs(PROBE))
    engine.close()
    torch.testing.assert_close(served, hf_prompt_logprobs(tmp_path / "model", PROBE), atol=1e-4, rtol=0)
    assert (served - hf_prompt_logprobs(untied.model_dir, PROBE)).abs().max() > 1e-3


def test_continuous_generation_trains_through_vllm(untied, tmp_path):
    # --groups_in_flight: groups stream through the server while weights are loaded into it (one process, k = 1).
    # The server labels each token with the weights that sampled it (per-token versions: TokenVersions).
    untied.dirty = True
    command = [sys.executable, str(RUNNER), "--model", untied.model_dir, "--vllm_server_url", untied.url,
               "--env", "reverse_text", "--env_args", '{"num_examples": 64}', "--rollouts_per_step", "8",
               "--num_generations", "4", "--max_seq_len", "128", "--max_off_policy_steps", "1",
               "--groups_in_flight", "3", "--max_steps", "3", "--learning_rate", "0.05", "--logging_steps", "1",
               "--print_samples_every", "0", "--report_to", "none", "--save_strategy", "no",
               "--vllm_weight_transfer", "files", "--output_dir", str(tmp_path / "out"),
               "--save_rollouts_path", str(tmp_path / "rollouts.jsonl")]
    result = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert [line.split(" | ")[0] for line in result.stdout.splitlines() if line.startswith("step ")] == [
        "step 1/3", "step 2/3", "step 3/3"]
    assert "Weight sync probe FAILED" not in output
    rollouts = read_rollouts(tmp_path / "rollouts.jsonl")
    assert len(rollouts) == 3 * 8
    for index in range(3):
        batch = rollouts[index * 8:(index + 1) * 8]
        ids = [r.group_id for r in batch]
        assert len(set(ids)) == 2 and all(ids.count(i) == 4 for i in ids)  # two whole groups
        assert min(r.oldest_version() for r in batch) >= max(0, index - 1)  # within k = 1 of its step
    assert sorted({position_of(r.group_id)[0] for r in rollouts}) == list(range(6))
    assert_tokens_versioned(rollouts, per_step=8)


def _parameter_names(folder) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


def test_launcher_starts_the_server_runs_training_against_it_and_stops_it(untied, tmp_path):
    # One command for both: the server comes up, the trainer gets --vllm_server_url, the server stops at the end.
    port = free_port()
    command = [sys.executable, "-m", "verifiers_rl.inference.vllm.server", "--model", untied.model_dir,
               "--port", str(port), "--max-model-len", "512", "--log", str(tmp_path / "server.log"),
               "--weight-transfer", "gloo", "--then",
               sys.executable, "examples/train.py", "--model", untied.model_dir, "--env", "reverse_text",
               "--env_args", '{"num_examples": 16}', "--max_steps", "1", "--rollouts_per_step", "8",
               "--num_generations", "4", "--print_samples_every", "0",
               "--output_dir", str(tmp_path / "model")]
    result = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert f"--vllm_server_url http://127.0.0.1:{port} --vllm_weight_transfer gloo" in result.stdout
    # The session's API key guards this server too (from $VLLM_API_KEY, as the trainer's), and is never printed.
    assert os.environ["VLLM_API_KEY"] not in result.stdout + result.stderr
    assert [line.split(" | ")[0] for line in result.stdout.splitlines() if line.startswith("step ")] == ["step 1/1"]
    assert not _answers(port), "the server was stopped with the command"


def test_launcher_passes_a_preemption_on_then_stops_the_server_and_leaves_nothing(vllm_servers, tmp_path):
    # A job scheduler's SIGTERM to the launcher reaches the command, which takes 2 s to "checkpoint" while the server
    # still answers; then the server stops and the launcher exits with the command's status. No key here: the
    # loopback default (the server runs without our guard).
    port = free_port()
    env = {k: v for k, v in launch_env().items() if k != "VLLM_API_KEY"}
    command = [sys.executable, "-m", "verifiers_rl.inference.vllm.server", "--model", vllm_servers["untied"].model_dir,
               "--port", str(port), "--max-model-len", "512", "--log", str(tmp_path / "server.log"), "--then",
               sys.executable, str(PREEMPTIBLE), str(tmp_path), "--delay", "2", "--exit", "0"]
    launcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 400
        while not (tmp_path / "ready.json").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)[-6000:]
            time.sleep(0.2)
        # Everything the launcher runs: the server's processes, its watchdog, the command and the command's child.
        family = [psutil.Process(launcher.pid)] + psutil.Process(launcher.pid).children(recursive=True)
        assert len(family) >= 6 and _answers(port)
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    reader.join(10)
    output = "".join(lines)
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    assert code == 0, output[-6000:]
    assert stopped["signal"] == signal.SIGTERM and stopped["slept_s"] >= 2
    assert stopped["health_while_stopping"] == 200, "the server is stopped only after the command"
    assert "SIGTERM: passed on to the command" in output and not _answers(port)
    left = [p for p in family if _alive(p)]
    assert not left, [(p.pid, p.name()) for p in left]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _answers(port: int) -> bool:
    import urllib.request

    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        return True
    except OSError:
        return False
