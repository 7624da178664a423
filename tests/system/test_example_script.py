"""examples/train.py in one process: YAML config, saved model and tokenizer, clear CLI errors."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts

from tests.cli.test_train_errors import refusal
from tests.helpers.launches import ROOT, launch_env



def run_script(args, cwd):
    env = launch_env({"VERIFIERS_RL_CACHE": str(cwd / "cache")}, threads=None)
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
    # One readable line per step (not transformers' raw dict of every metric).
    assert "step 2/2 | reward " in result.stdout and " | loss " in result.stdout
    assert "'loss'" not in result.stdout + result.stderr
    saved = load_file(tmp_path / "out" / "model.safetensors")
    before = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert any(not (saved[k] == before[k]).all() for k in before), "the saved model is the trained one"


def test_the_scripts_errors_are_one_line_with_exit_status_2(tmp_path):
    # A missing replay file, through the script itself: one line, as a usage error (it came as a FileNotFoundError
    # traceback, exit status 1). The script is the command's main: its other errors run in-process below.
    result = run_script(["--rollouts_path", str(tmp_path / "missing.jsonl"), "--model", "tiny"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (f"verifiers-rl train: error: Rollouts file "
                                                      f"{str(tmp_path / 'missing.jsonl')!r} does not exist.")


@pytest.mark.parametrize("argv, message", [
    (["--loss_type", "bogus", "--rollouts_path", "x.jsonl"], "invalid choice: 'bogus'"),
    (["--env_args", "{oops"], "--env_args is not valid JSON"),
    (["--env", "no_such_env", "--model", "tiny"], "Unknown environment 'no_such_env'"),
    # A value RLConfig refuses: one line naming the flag, as argparse's own errors, no traceback.
    (["--groups_in_flight", "4", "--max_off_policy_steps", "0", "--model", "tiny"],
     "--groups_in_flight 4 (continuous generation) does not combine with --max_off_policy_steps 0"),
])
def test_cli_errors_are_clear(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in refusal(argv, capsys)


def test_a_live_run_trains_num_train_epochs_when_given_instead_of_the_quickstarts_steps(tmp_path, tiny_model_dir):
    # 8 training rows, 2 prompts a step: one epoch is 4 steps (without --num_train_epochs a live run stops at 60).
    result = run_script(["--model", tiny_model_dir, "--env_args", '{"num_examples": 8, "num_eval_examples": 2}',
                         "--num_train_epochs", "1", "--rollouts_per_step", "4", "--num_generations", "2",
                         "--print_samples_every", "0", "--output_dir", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "done: 4 steps" in result.stdout, result.stdout[-2000:]


def test_live_generation_from_an_environment_file(tmp_path, tiny_model_dir):
    env_file = ROOT / "tests" / "live" / "toy_env.py"
    result = run_script(["--model", tiny_model_dir, "--env", str(env_file), "--env_args", '{"num_examples": 4}',
                         "--rollouts_per_step", "8", "--num_generations", "4", "--max_seq_len", "64",
                         "--max_completion_length", "8", "--max_steps", "3", "--logging_steps", "1",
                         # a folder not made yet: made as --output_dir is (the first append failed there before)
                         "--save_rollouts_path", str(tmp_path / "logs" / "seen.jsonl"), "--report_to", "none",
                         "--print_samples_every", "2", "--num_completions_to_print", "2",
                         "--save_strategy", "no", "--output_dir", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in step_lines] == ["step 1/3", "step 2/3", "step 3/3"], result.stdout
    assert all(" | gen " in line and " | wait " in line and " | staleness " in line for line in step_lines)
    # Two sample completions (reward, prompt -> reply) after step 2 only.
    header = lines.index("--- sample completions at step 2 ---")
    assert all(line.startswith("  [") and " -> " in line for line in lines[header + 1 : header + 3])
    assert sum("sample completions" in line for line in lines) == 1
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # Every trained rollout was saved in the replay format, and replays through the same path.
    from verifiers_rl.core.rollout import read_rollouts

    seen = read_rollouts(tmp_path / "logs" / "seen.jsonl")
    assert len(seen) == 3 * 8 and {r.policy_version for r in seen} <= {0, 1, 2}
    replay = run_script(["--model", tiny_model_dir, "--rollouts_path", str(tmp_path / "logs" / "seen.jsonl"),
                         "--rollouts_per_step", "8", "--max_seq_len", "64", "--max_steps", "3", "--report_to", "none",
                         "--save_strategy", "no", "--output_dir", str(tmp_path / "replayed")], tmp_path)
    assert replay.returncode == 0, replay.stderr[-4000:]


def test_default_run_is_smollm2_on_reverse_text(tmp_path, smollm2_model_dir):
    # The README's run command with no arguments, cut to 2 steps: the default model (converted once into the
    # cache) and environment, a line per step, the summary; the quickstart's learning shows in the README run.
    env = launch_env({"VERIFIERS_RL_CACHE": str(Path(smollm2_model_dir).parent)}, threads=None)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--max_steps", "2",
                             "--print_samples_every", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    header = lines.index("--- sample completions at step 2 ---")
    assert len([line for line in lines[header + 1 :] if line.startswith("  [")]) == 3  # 3 of the 4 prompts
    assert any(line.startswith("done: 2 steps in ") and "mean reward" in line for line in lines)
    assert (tmp_path / "outputs" / "train" / "model.safetensors").is_file()
