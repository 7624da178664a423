"""examples/train.py in one process: YAML config, saved model and tokenizer, clear CLI errors."""

import os
import subprocess
import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file

from verifiers_rl.rollouts import write_rollouts
from verifiers_rl.synthetic import random_rollouts

ROOT = Path(__file__).resolve().parent.parent


def run_script(args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VERIFIERS_RL_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_yaml_config_trains_and_saves(tmp_path, tiny_model_dir):
    write_rollouts(tmp_path / "r.jsonl", random_rollouts(4, 4, vocab_size=390, seed=7))
    config = {
        "model": tiny_model_dir,
        "rollouts_path": str(tmp_path / "r.jsonl"),
        "loss_type": "token_mean",
        "micro_batching": "padded",
        "per_device_train_batch_size": 4,
        "rollouts_per_step": 8,
        "max_seq_len": 64,
        "max_steps": 2,
        "learning_rate": 0.5,
        "optim": "sgd",
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "output_dir": str(tmp_path / "out"),
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = run_script(["--config", str(tmp_path / "run.yaml")], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "'loss'" in result.stdout + result.stderr
    saved = load_file(tmp_path / "out" / "model.safetensors")
    before = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert any(not (saved[k] == before[k]).all() for k in before), "the saved model is the trained one"


def test_cli_errors_are_clear(tmp_path):
    result = run_script(["--loss_type", "bogus", "--rollouts_path", "x.jsonl"], tmp_path)
    assert result.returncode == 2 and "invalid choice: 'bogus'" in result.stderr
    result = run_script(["--env_args", "{oops"], tmp_path)
    assert result.returncode == 2 and "--env_args is not valid JSON" in result.stderr
    result = run_script(["--env", "no_such_env", "--model", "tiny"], tmp_path)
    assert result.returncode != 0 and "Unknown environment 'no_such_env'" in result.stderr
    result = run_script(["--rollouts_path", str(tmp_path / "missing.jsonl"), "--model", "tiny"], tmp_path)
    assert result.returncode != 0 and "missing.jsonl' does not exist" in result.stderr


def test_live_generation_from_an_environment_file(tmp_path, tiny_model_dir):
    env_file = ROOT / "tests" / "live" / "toy_env.py"
    result = run_script(["--model", tiny_model_dir, "--env", str(env_file), "--env_args", '{"num_examples": 4}',
                         "--rollouts_per_step", "8", "--num_generations", "4", "--max_seq_len", "64",
                         "--max_completion_length", "8", "--max_steps", "3", "--logging_steps", "1",
                         "--save_rollouts_path", str(tmp_path / "seen.jsonl"), "--report_to", "none",
                         "--save_strategy", "no", "--output_dir", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # Every trained rollout was saved in the replay format, and replays through the same path.
    from verifiers_rl.rollouts import read_rollouts

    seen = read_rollouts(tmp_path / "seen.jsonl")
    assert len(seen) == 3 * 8 and {r.policy_version for r in seen} <= {0, 1, 2}
    replay = run_script(["--model", tiny_model_dir, "--rollouts_path", str(tmp_path / "seen.jsonl"),
                         "--rollouts_per_step", "8", "--max_seq_len", "64", "--max_steps", "3", "--report_to", "none",
                         "--save_strategy", "no", "--output_dir", str(tmp_path / "replayed")], tmp_path)
    assert replay.returncode == 0, replay.stderr[-4000:]
