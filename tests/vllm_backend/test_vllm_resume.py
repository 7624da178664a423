"""A run resumed against a REAL vLLM server (CPU): the server gets the checkpoint's weights before the first batch
after the resume, although it still holds the newer weights the interrupted run left in it; every request carries its
rollout's seed, so the batch after the resume is the uninterrupted run's and so are the final parameters."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.vllm_backend.launching import ROOT, RUNNER, hf_prompt_logprobs, launch_env
from verifiers_rl.core.rollout import read_rollouts

COMMON = ["--env", "reverse_text", "--env_args", '{"num_examples": 64}', "--rollouts_per_step", "8",
          "--num_generations", "4", "--max_seq_len", "128",
          "--max_off_policy_steps", "0", "--learning_rate", "0.05", "--logging_steps", "1", "--print_samples_every", "0",
          "--report_to", "none", "--max_steps", "2", "--vllm_weight_transfer", "files"]


def train(served, out, extra: list[str]) -> str:
    command = [sys.executable, str(RUNNER), "--model", served.model_dir, "--vllm_server_url", served.url, *COMMON,
               "--output_dir", str(out), *extra]
    result = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result.stdout


def max_gap(folder, rollouts) -> float:
    """Largest |sampler log-prob - HF log-prob under ``folder``'s weights| over the rollouts' completion tokens."""
    gaps = []
    for rollout in rollouts:
        ids = list(rollout.prompt_ids) + list(rollout.completion_ids)
        hf = hf_prompt_logprobs(folder, ids)[len(rollout.prompt_ids) - 1:]
        gaps.append(float((hf - torch.tensor(rollout.completion_logprobs)).abs().max()))
    return max(gaps)


@pytest.mark.distributed
def test_a_resumed_run_loads_the_checkpoint_into_the_server_before_its_first_batch(untied, tmp_path):
    untied.dirty = True  # both runs leave trained weights in the server
    train(untied, tmp_path / "full", ["--save_strategy", "steps", "--save_steps", "1",
                                      "--save_rollouts_path", str(tmp_path / "full.jsonl")])
    checkpoint = tmp_path / "full" / "checkpoint-1"
    # The server now serves the weights after step 2; the resumed run restarts from step 1's.
    stdout = train(untied, tmp_path / "resumed", ["--save_strategy", "no", "--resume_from_checkpoint", str(checkpoint),
                                                  "--save_rollouts_path", str(tmp_path / "resumed.jsonl")])
    steps = [line.split(" | ")[0] for line in stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step 2/2"], stdout[-3000:]
    assert "Weight sync probe FAILED" not in stdout

    resumed = read_rollouts(tmp_path / "resumed.jsonl")
    assert len(resumed) == 8 and {r.policy_version for r in resumed} == {1}
    # k = 0: the batch after the resume was sampled by the checkpoint's weights, not by the newer ones the server
    # held when the run started (the second gap shows the check can tell them apart).
    assert max_gap(checkpoint, resumed) < 1e-4
    assert max_gap(tmp_path / "full", resumed) > 1e-3
    # vLLM's per-request seed (its own generator per request) samples the same tokens as the uninterrupted run did.
    full = read_rollouts(tmp_path / "full.jsonl")
    assert len(full) == 16
    assert [r.completion_ids for r in resumed] == [r.completion_ids for r in full[8:]]
    got, want = load_file(tmp_path / "resumed" / "model.safetensors"), load_file(tmp_path / "full" / "model.safetensors")
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)
    assert worst < 1e-6, f"max relative parameter difference {worst:.3e}"
