"""A classic verifiers environment (a vf.MultiTurnEnv with environment turns, defined in tests/envs/vf_envs.py)
trained by examples/train.py through a REAL vLLM server (``--vllm_server_url``): the server sampled every model
turn, the trained ids and log-probs are what it sampled (its log-probs equal HF's for those ids under the weights
that sampled them, and the trainer's own at k = 0: IS ratio 1), environment turns are masked, and the rewards are
the rubric's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.vllm_backend.launching import ROOT, RUNNER, assert_tokens_versioned, hf_prompt_logprobs, launch_env
from tests.envs.verifiers_checks import model_turns, rubric_reward
from verifiers_rl.core.rollout import read_rollouts

ENV_ARGS = {"kind": "multi", "max_turns": 2, "max_seq_len": 128, "sampling_args": {"max_tokens": 8}}


def _train(untied, tmp_path, *flags: str) -> list[str]:
    """examples/train.py on the env through the untied server, each trained rollout saved to seen.jsonl."""
    return [sys.executable, str(RUNNER), "--model", untied.model_dir, "--vllm_server_url", untied.url,
            "--env", "vf:tests.envs.vf_envs", "--env_args", json.dumps(ENV_ARGS), "--rollouts_per_step", "8",
            "--num_generations", "4", "--learning_rate", "0.05", "--logging_steps", "1", "--print_samples_every", "0",
            "--report_to", "none", "--save_strategy", "no", "--output_dir", str(tmp_path / "out"),
            "--save_rollouts_path", str(tmp_path / "seen.jsonl"), *flags]


def test_a_verifiers_multi_turn_env_trains_through_the_vllm_server(untied, tmp_path):
    untied.dirty = True  # the run leaves its trained weights in the server
    command = _train(untied, tmp_path, "--max_off_policy_steps", "0", "--max_steps", "2", "--vllm_weight_transfer",
                     "files")
    result = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/2", "step 2/2"], result.stdout[-3000:]
    # k = 0: the trainer's log-probs of the trained tokens equal the server's (ids, masks and log-probs line up).
    ratios = [float(part.split()[1]) for line in lines for part in line.split(" | ") if part.startswith("is_ratio ")]
    assert len(ratios) == 2 and all(abs(r - 1) < 1e-3 for r in ratios), lines
    state = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("ENGINE_STATE "))[13:])
    assert state["engine"] == "VLLMEngine" and state["policy_version"] == 2

    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert len(seen) == 16 and [r.policy_version for r in seen] == [0] * 8 + [1] * 8
    turns = [model_turns(r) for r in seen]
    # Every model turn was a server request (no other sampler exists in this run): at least one per rollout.
    assert state["requests_served"] == sum(len(t) for t in turns) and all(turns)
    assert any(0 in r.completion_mask for r in seen)  # the environment's turns, masked out of the loss
    assert "Go on (1)." in " ".join(m["content"] for r in seen for m in r.completion if m["role"] == "user")
    # The first batch was sampled by the model's own weights: the server's log-prob of every sampled token (mask 1)
    # is HF's log softmax for that id after the sequence before it.
    for rollout, rollout_turns in zip(seen[:8], turns[:8]):
        sequence = rollout.prompt_ids + rollout.completion_ids
        hf = hf_prompt_logprobs(untied.model_dir, sequence)
        for start, ids, logprobs in rollout_turns:
            assert sequence[start : start + len(ids)] == ids
            gap = (hf[start - 1 : start - 1 + len(ids)] - torch.tensor(logprobs)).abs().max()
            assert float(gap) < 1e-4, (rollout.group_id, start, float(gap))
    for batch in (seen[:8], seen[8:]):
        for group in {r.group_id for r in batch}:
            members = [r for r in batch if r.group_id == group]
            assert [r.reward for r in members] == pytest.approx(rubric_reward(members))


def test_a_verifiers_multi_turn_env_streams_through_the_vllm_server_with_each_token_versioned(untied, tmp_path):
    # Continuous generation (--groups_in_flight, k = 1): weights load while episodes are in flight; each model token
    # carries the version the server labelled it with, environment tokens none (NOT_SAMPLED, -1).
    untied.dirty = True
    command = _train(untied, tmp_path, "--max_off_policy_steps", "1", "--groups_in_flight", "3", "--max_steps", "3")
    result = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert len(seen) == 24 and any(0 in r.completion_mask for r in seen)
    assert_tokens_versioned(seen, per_step=8)
