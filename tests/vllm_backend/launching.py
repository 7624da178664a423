"""What the vLLM tests share to launch training runs against a server (a module, not a test file: no test depends on
another test file, or on the order files run in)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from verifiers_rl.core.engine import free_port

from tests.helpers.launches import ROOT, launch_env as base_env

RUNNER = ROOT / "tests" / "vllm_backend" / "train_run.py"
PREEMPTIBLE = ROOT / "tests" / "inference" / "preemptible_cmd.py"
PROBE = [11, 40, 7, 93, 150, 22, 301, 64, 5, 17, 250, 3, 99]


def ddp_command(model_dir: str, url: str, out: Path, max_steps: int, config: str = "ddp_cpu.yaml",
                transfer: str = "files", extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
        "--main_process_port", str(free_port()), str(RUNNER),
        "--model", model_dir, "--env", "reverse_text", "--env_args", '{"num_examples": 64}',
        "--vllm_server_url", url, "--vllm_weight_transfer", transfer, "--max_steps", str(max_steps),
        "--rollouts_per_step", "8", "--num_generations", "4", "--max_seq_len", "128",
        "--max_off_policy_steps", "0", "--learning_rate", "0.01", "--logging_steps", "1", "--print_samples_every", "0",
        "--weight_sync_probe_every", "1", "--save_rollouts_path", str(out / "rollouts.jsonl"), "--report_to", "none",
        "--save_strategy", "no", "--output_dir", str(out / "model"), *extra,
    ]


def assert_tokens_versioned(rollouts, per_step: int, k: int = 1) -> None:
    """Rollouts a continuous run trained (``per_step`` a step, in order): every model token (mask 1) carries the version
    that sampled it, in the order the loads came (turn after turn), none newer than the step that trained it nor older
    than k steps before; environment tokens carry NOT_SAMPLED (-1)."""
    for index in range(len(rollouts) // per_step):
        for rollout in rollouts[index * per_step:(index + 1) * per_step]:
            versions, mask = rollout.completion_versions, rollout.completion_mask
            assert versions is not None and [v == -1 for v in versions] == [m == 0 for m in mask], (versions, mask)
            sampled = [v for v in versions if v != -1]
            assert sampled == sorted(sampled) and max(0, index - k) <= sampled[0] and sampled[-1] <= index, versions


def launch_env() -> dict:
    # ACCELERATE_USE_CPU (docs/scaling.md): examples/train.py picks the CPU itself (use_cpu) when no GPU is visible; the
    # env flag is set too, as users do, and must not break the ZeRO-3 launch (RLConfig swaps it for use_cpu).
    return base_env({"ACCELERATE_USE_CPU": "true"})


@torch.no_grad()
def hf_prompt_logprobs(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def start_reading(command: list[str]) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """``command`` started from the repository root with ``launch_env()``; its output lines collect in the list,
    read by the thread (join it after the process ends, before reading the whole output)."""
    process = subprocess.Popen(command, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    return process, lines, reader


def wait_for_first_step(process: subprocess.Popen, lines: list[str], timeout_s: float = 300) -> None:
    """Until the run logs step 1 (a weight sync is done and training is under way); fails if it ends first."""
    deadline = time.monotonic() + timeout_s
    while not any(line.startswith("step 1/") for line in lines):
        assert process.poll() is None, "".join(lines)[-6000:]
        assert time.monotonic() < deadline, f"no training step within {timeout_s} s:\n" + "".join(lines)[-6000:]
        time.sleep(0.05)


def stopped_output(process: subprocess.Popen, lines: list[str], reader: threading.Thread) -> str:
    """Kill ``process`` if it still runs, then its whole output (what ``start_reading``'s thread read)."""
    if process.poll() is None:
        process.kill()
        process.wait()
    reader.join(10)
    return "".join(lines)
