"""A mixture of three kinds of environment (a built-in, a reasoning-gym task, a verifiers 0.4 environment) trained by
`verifiers-rl train` on the tiny model: tensorboard holds each environment's training metrics (equal to what its
rollouts in the saved batches give) and its evaluation, every saved rollout names its environment, and no group mixes
two. SmolLM2 (the default model) trains the same mixture from a YAML --config for a step."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from verifiers_rl.core.rollout import group_by_id, read_rollouts

from tests.helpers.launches import ROOT, launch_env

V1_ENV = str(ROOT / "tests" / "v1" / "envs" / "reverse_v1.py")
MIXTURE = [
    {"env": "reverse_text", "weight": 2, "env_args": {"num_examples": 16, "max_new_tokens": 8}},
    {"env": "reasoning_gym:leg_counting", "env_args": {"size": 16, "eval_size": 4, "max_new_tokens": 8,
                                                        "max_seq_len": 512}},
    {"env": V1_ENV, "env_args": {"harness": "inprocess", "taskset": {"num_tasks": 12}, "max_new_tokens": 8,
                                 "max_seq_len": 128}},
]
NAMES = ["reverse_text", "reasoning_gym:leg_counting", "reverse_v1"]
STEPS, PER_STEP = 4, 8


def train(args: list[str], cwd: Path, cache: Path | None = None) -> str:
    env = launch_env({"HF_HUB_OFFLINE": "1"})
    if cache is not None:
        env["VERIFIERS_RL_CACHE"] = str(cache)
    result = subprocess.run([sys.executable, "-m", "verifiers_rl.cli.train", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("mixture")
    train(["--model", tiny_model_dir, "--env", json.dumps(MIXTURE), "--max_steps", str(STEPS),
           "--rollouts_per_step", str(PER_STEP), "--num_generations", "2", "--learning_rate", "0.01",
           "--eval_steps", "2", "--eval_holdout", "2", "--eval_samples_per_prompt", "2", "--report_to", "tensorboard",
           "--print_samples_every", "0", "--save_rollouts_path", str(work / "seen.jsonl"),
           "--curriculum_hard_below", "0", "--output_dir", str(work / "out")], work)
    return work


def scalars(run) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = (run / "out" / "runs").iterdir()
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_every_rollout_names_its_environment_and_no_group_mixes_two(run):
    rollouts = read_rollouts(run / "seen.jsonl")
    assert len(rollouts) == STEPS * PER_STEP
    assert {r.env for r in rollouts} <= set(NAMES) and None not in {r.env for r in rollouts}
    assert all(len({r.env for r in group}) == 1 for group in group_by_id(rollouts))


def test_tensorboard_holds_each_environments_training_metrics(run):
    logged = scalars(run)
    rollouts = read_rollouts(run / "seen.jsonl")
    checked = 0
    for step in range(1, STEPS + 1):
        batch = rollouts[(step - 1) * PER_STEP: step * PER_STEP]
        assert logged["train/reward"][step] == pytest.approx(statistics.fmean(r.reward for r in batch), abs=1e-6)
        for name in NAMES:
            mine = [r for r in batch if r.env == name]
            tags = {key: f"train/env/{name}/{key}" for key in ("reward", "reward_std", "completions/clipped_ratio",
                                                                "completions/mean_length", "reward_errors")}
            if not mine:
                assert step not in logged.get(tags["reward"], {})
                continue
            rewards = [r.reward for r in mine]
            expected = {"reward": statistics.fmean(rewards),
                        "reward_std": statistics.stdev(rewards),  # live groups hold >= 2 episodes
                        "completions/clipped_ratio": statistics.fmean(float(r.truncated) for r in mine),
                        "completions/mean_length": statistics.fmean(sum(r.completion_mask) for r in mine),
                        "reward_errors": float(sum(r.metrics.get("reward_errors", 0.0) for r in mine))}
            for key, tag in tags.items():
                assert logged[tag][step] == pytest.approx(expected[key], abs=1e-5), (tag, step)
                checked += 1
    assert checked >= STEPS * 5 and all(f"train/env/{name}/reward" in logged for name in NAMES)


def test_tensorboard_holds_what_the_curriculum_set_aside(run):
    """--curriculum_hard_below 0: a prompt none of whose group passed (reward 1) is set aside; each step logs how many
    are, overall and per entry, and the overall is the entries' sum."""
    logged = scalars(run)
    rollouts = read_rollouts(run / "seen.jsonl")
    for step in range(1, STEPS + 1):
        parts = {kind: [logged[f"train/env/{name}/curriculum/set_aside{kind}"][step] for name in NAMES]
                 for kind in ("", "_easy", "_hard")}
        for kind, values in parts.items():
            assert logged[f"train/curriculum/set_aside{kind}"][step] == sum(values), (step, kind)
        assert parts["_easy"] == [0.0] * len(NAMES)  # no easy threshold
    # After the first batch: its groups none of whose rollouts passed (no epoch is over yet).
    hard = [group[0].env for group in group_by_id(rollouts[:PER_STEP]) if all(r.reward < 1 for r in group)]
    assert hard and logged["train/curriculum/set_aside_hard"][1] == len(hard)
    for name in NAMES:
        assert logged[f"train/env/{name}/curriculum/set_aside_hard"][1] == hard.count(name), name


def test_tensorboard_holds_each_environments_evaluation(run):
    logged = scalars(run)
    for name in NAMES:
        for key in ("reward", "pass@1", "pass@2", "num_prompts"):
            assert sorted(logged[f"eval/env/{name}/{key}"]) == [2, 4], (name, key)
        assert logged[f"eval/env/{name}/num_prompts"][2] == 2  # the entry's own held-out rows (--eval_holdout 2)
    assert logged["eval/num_prompts"][2] == 2 * len(NAMES)
    overall = logged["eval/reward"][4]
    parts = [logged[f"eval/env/{name}/reward"][4] for name in NAMES]
    assert overall == pytest.approx(statistics.fmean(parts), abs=1e-5)  # equal prompts and samples per entry


def test_verifiers_rl_eval_of_the_mixture_equals_the_runs_own_evaluation(run, capsys):
    """`verifiers-rl eval` takes the mixture (here a training --config whose env: is the list) and evaluates the saved
    model to what the run's evaluation logged at its last step: each entry's reward and pass@k, and the overall."""
    import yaml

    from verifiers_rl.rollouts.evaluation import pass_at_k

    config = run / "run.yaml"
    config.write_text(yaml.safe_dump({"env": MIXTURE, "max_steps": STEPS}))
    from verifiers_rl.cli.eval import main

    assert main(["--model", str(run / "out"), "--env", str(config), "--holdout", "2", "-k", "2", "--output",
                 str(run / "eval.jsonl")]) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    logged = scalars(run)
    assert len({r["reward"] for r in records}) > 2  # rewards that differ: equal means are no coincidence
    assert logged["eval/reward"][STEPS] == pytest.approx(statistics.fmean(r["reward"] for r in records), abs=1e-5)
    for name in NAMES:
        mine = [r for r in records if r["env"] == name]
        rows: dict[int, list[bool]] = {}
        for record in mine:
            rows.setdefault(record["row"], []).append(record["passed"])
        assert len(rows) == 2 and all(len(passes) == 2 for passes in rows.values())
        reward = statistics.fmean(r["reward"] for r in mine)
        assert logged[f"eval/env/{name}/reward"][STEPS] == pytest.approx(reward, abs=1e-5), name
        for k in (1, 2):
            expected = statistics.fmean(pass_at_k(2, sum(passes), k) for passes in rows.values())
            assert logged[f"eval/env/{name}/pass@{k}"][STEPS] == pytest.approx(expected, abs=1e-6), (name, k)
        assert f"  {name}: reward {reward:.4f}, pass@1 " in printed


def test_smollm2_trains_the_mixture_from_a_yaml_config(tmp_path, smollm2_model_dir):
    import yaml

    config = tmp_path / "mixture.yaml"
    config.write_text(yaml.safe_dump({"env": MIXTURE, "max_steps": 1, "rollouts_per_step": 4,
                                      "num_generations": 2, "report_to": "none", "logging_steps": 1}))
    out = train(["--config", str(config), "--output_dir", str(tmp_path / "out")], tmp_path,
                cache=Path(smollm2_model_dir).parent)
    assert "step 1/1" in out and (tmp_path / "out" / "model.safetensors").is_file()


def test_a_mixture_run_with_a_curriculum_resumes_exactly(tmp_path, tiny_model_dir):
    """Resumed at step 2 of 4, a mixture under a difficulty curriculum trains the same batches token for token and
    ends with the same parameters: the checkpoint holds the curriculum's state (set-aside prompts, draw cursors), and
    the draws after it are steered (they differ from the same mixture's draws without a curriculum)."""
    import shutil

    from transformers import AutoTokenizer

    from verifiers_rl.envs import load_environment
    from verifiers_rl.envs.mixture import load_mixture, parse_entries

    # reverse_text: a rollout passes with any overlap (its reward is a similarity), easy when both of a group do;
    # every entry: hard when none does (the flag). 6 rows drawn ~12 times: set-aside rows miss an epoch.
    entries = [{"env": "reverse_text", "weight": 3, "env_args": {"num_examples": 6, "max_new_tokens": 8},
                "curriculum": {"pass_reward": 0.01, "easy_above": 1.0}},
               {"env": "arithmetic", "env_args": {"num_examples": 16, "max_new_tokens": 8}}]
    common = ["--model", tiny_model_dir, "--env", json.dumps(entries), "--max_steps", "4", "--rollouts_per_step", "8",
              "--num_generations", "2", "--learning_rate", "0.01", "--print_samples_every", "0",
              "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none", "--curriculum_hard_below", "0"]
    train([*common, "--output_dir", str(tmp_path / "full"), "--save_rollouts_path", str(tmp_path / "full.jsonl")],
          tmp_path)
    saved = json.loads((tmp_path / "full" / "checkpoint-2" / "curriculum.json").read_text())
    assert saved["set_aside"], saved  # prompts were set aside before the checkpoint
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    train([*common, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest",
           "--save_rollouts_path", str(tmp_path / "resumed.jsonl")], tmp_path)
    full, resumed = read_rollouts(tmp_path / "full.jsonl"), read_rollouts(tmp_path / "resumed.jsonl")
    assert [r.to_json() for r in resumed] == [r.to_json() for r in full[16:]]
    assert {r.env for r in full} == {"reverse_text", "arithmetic"}
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == (tmp_path / "full" / "model.safetensors").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = load_mixture(parse_entries(json.dumps(entries)), lambda entry: load_environment(
        entry.env, tokenizer=tokenizer, **entry.env_args), lambda env, entry: None)
    expected = [plain.dataset[row].prompt for row in plain.draw_rows(list(range(16)), seed=42)]
    drawn = [group[0].prompt for group in group_by_id(full)]
    assert drawn[8:] != expected[8:]  # after the checkpoint, set-aside prompts were skipped
