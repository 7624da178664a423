"""A verifiers 0.4 environment (vf-init's template, v1's default `null` harness), unchanged, trained by
examples/train.py through a REAL vLLM server (``--vllm_server_url``): every episode's model call was one server
request, the trained ids and log-probs are what the server sampled (HF's log-probs for those ids under the weights
that sampled them; the trainer's own at k = 0: IS ratio 1), and the rewards are the taskset's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from tests.vllm_backend.launching import ROOT, RUNNER, assert_tokens_versioned, hf_prompt_logprobs, launch_env
from verifiers_rl.envs.adapters.verifiers_v1 import v1_python
from verifiers_rl.core.rollout import read_rollouts

TEMPLATE = ROOT / "tests" / "v1" / "envs" / "reverse_v1.py"


@pytest.mark.skipif(not v1_python().exists(), reason="no verifiers 0.4 venv: run scripts/install_verifiers_v1.sh")
def test_a_v1_environment_trains_through_the_vllm_server(untied, tmp_path):
    untied.dirty = True  # the run leaves its trained weights in the server
    command = [sys.executable, str(RUNNER), "--model", untied.model_dir, "--vllm_server_url", untied.url,
               "--env", str(TEMPLATE), "--rollouts_per_step", "8", "--num_generations", "4",
               "--max_seq_len", "128", "--max_completion_length", "8", "--max_off_policy_steps", "0",
               "--learning_rate", "0.05", "--logging_steps", "1", "--print_samples_every", "0", "--report_to", "none",
               "--max_steps", "2", "--vllm_weight_transfer", "files", "--save_strategy", "no",
               "--output_dir", str(tmp_path / "out"), "--save_rollouts_path", str(tmp_path / "seen.jsonl")]
    result = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/2", "step 2/2"], result.stdout[-3000:]
    ratios = [float(part.split()[1]) for line in lines for part in line.split(" | ") if part.startswith("is_ratio ")]
    assert len(ratios) == 2 and all(abs(r - 1) < 1e-3 for r in ratios), lines
    state = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("ENGINE_STATE "))[13:])
    assert state["engine"] == "VLLMEngine" and state["policy_version"] == 2
    assert state["requests_served"] == 16  # one model call per episode, each a server request

    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert len(seen) == 16 and [r.policy_version for r in seen] == [0] * 8 + [1] * 8
    tokenizer = AutoTokenizer.from_pretrained(untied.model_dir)
    for rollout in seen:
        assert rollout.completion_mask == [1] * len(rollout.completion_ids) and len(rollout.completion_ids) <= 8
        word = rollout.prompt[-1]["content"].removeprefix("Reverse the text: ")
        reply = tokenizer.decode(rollout.completion_ids, skip_special_tokens=True).strip()
        assert rollout.reward == float(reply == word[::-1]) and rollout.metrics["reply_chars"] == len(reply)
    # The first batch was sampled by the model's own weights: the server's log-prob of every sampled token is HF's.
    for rollout in seen[:8]:
        sequence = rollout.prompt_ids + rollout.completion_ids
        hf = hf_prompt_logprobs(untied.model_dir, sequence)[len(rollout.prompt_ids) - 1:]
        assert float((hf - torch.tensor(rollout.completion_logprobs)).abs().max()) < 1e-4


GUESS = ROOT / "tests" / "v1" / "envs" / "guess_v1.py"


def _guessing_games(untied, tmp_path, *flags: str) -> list[str]:
    """examples/train.py on the guessing game through the untied server, 2 steps, every game saved to games.jsonl."""
    return [sys.executable, str(RUNNER), "--model", untied.model_dir, "--vllm_server_url", untied.url,
            "--env", str(GUESS), "--env_args", json.dumps({"taskset": {"num_tasks": 8}}), "--temperature", "1",
            "--rollouts_per_step", "8", "--num_generations", "4", "--max_seq_len", "256",
            "--max_completion_length", "12", "--logging_steps", "1", "--print_samples_every", "0",
            "--report_to", "none", "--max_steps", "2", "--save_strategy", "no", "--output_dir", str(tmp_path / "out"),
            "--save_rollouts_path", str(tmp_path / "games.jsonl"), *flags]


@pytest.mark.skipif(not v1_python().exists(), reason="no verifiers 0.4 venv: run scripts/install_verifiers_v1.sh")
def test_the_three_turn_guessing_game_streams_through_the_vllm_server_with_each_turns_tokens_versioned(untied,
                                                                                                      tmp_path):
    # tests/v1/test_v1_multiturn.py's game on the other engine: temperature 1, the default
    # --max_failed_rollouts_fraction (one refused episode would stop the run), whole games saved, the game's rewards.
    # Continuous generation (k = 1): games are in flight while weights load; a game's turns carry the versions the
    # server labelled them with (a game may span a load), the game's own turns -1. (Batch-at-a-time through the
    # server is the template environment's test above.)
    from tests.v1.test_v1_multiturn import WEIGHTS, game_of, game_rules, secret_of

    untied.dirty = True  # the run leaves its trained weights in the server
    command = _guessing_games(untied, tmp_path, "--max_off_policy_steps", "1", "--groups_in_flight", "3")
    result = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    steps = [line.split(" | ")[0] for line in result.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step 1/2", "step 2/2"], result.stdout[-3000:]
    state = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("ENGINE_STATE "))[13:])
    assert state["engine"] == "VLLMEngine"
    games = read_rollouts(tmp_path / "games.jsonl")
    assert len(games) == 16 and any(0 in game.completion_mask for game in games)  # the game's turns, masked
    assert_tokens_versioned(games, per_step=8)
    tokenizer = AutoTokenizer.from_pretrained(untied.model_dir)
    for game in games:
        replies, turns = game_of(game, tokenizer)
        number = int(game.prompt[-1]["content"].split(":")[0].removeprefix("Game "))
        answers, scores = game_rules(replies, secret_of(number))
        assert len(replies) == 3 or scores["solved"] == 1.0  # the whole game: three guesses unless one was right
        assert [turn.split("user\n")[-1].split("assistant")[0].strip() for turn in turns] == answers
        assert game.reward == pytest.approx(sum(WEIGHTS[k] * v for k, v in scores.items()))
