"""A verifiers 0.4 environment trained by examples/train.py as a user runs it: the template environment with
SmolLM2, the default model (no other flags), a live run at the default k = 1 resumed exactly (same batches, same
parameters), a replay of its saved rollouts, and `verifiers-rl eval` with pass@k."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from verifiers_rl.rollouts.evaluation import pass_at_k
from verifiers_rl.core.rollout import read_rollouts

from .launching import run

ENVS = Path(__file__).parent / "envs"
TEMPLATE = str(ENVS / "reverse_v1.py")
GRADED = str(ENVS / "graded_v1.py")



def steps_and_samples(lines: list[str]) -> tuple[list[str], list[str]]:
    steps = [line.split(" | ")[0] for line in lines if line.startswith("step ")]
    header = lines.index("--- sample completions at step 1 ---")
    return steps, [line for line in lines[header + 1:] if line.startswith("  [")]


def test_the_template_environment_trains_smollm2_with_no_other_flags(tmp_path, smollm2_model_dir):
    # SmolLM2 is the default model: v1's renderer builds its prompts from SmolLM2's own tokenizer, and its stop
    # tokens are the engine's.
    # One step: each batch is 16 episodes of v1's default `null` harness, a subprocess each (the slow part).
    lines = run(["--env", TEMPLATE, "--max_steps", "1", "--print_samples_every", "1"], tmp_path,
                cache=Path(smollm2_model_dir).parent)
    steps, samples = steps_and_samples(lines)
    assert steps == ["step 1/1"] and samples and all("Reverse the text: " in line for line in samples), lines[-20:]
    assert any(line.startswith("done: 1 steps in ") for line in lines)
    assert (tmp_path / "outputs" / "train" / "model.safetensors").is_file()


LIVE = ["--env", GRADED, "--env_args", json.dumps({"harness": "inprocess", "taskset": {"num_tasks": 16}}),
        "--rollouts_per_step", "8", "--num_generations", "4", "--max_seq_len", "64", "--max_completion_length", "8",
        "--learning_rate", "1e-2", "--logging_steps", "1", "--print_samples_every", "0", "--report_to", "none",
        "--max_steps", "4"]


def parameters(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def worst_gap(a: Path, b: Path) -> float:
    x, y = parameters(a), parameters(b)
    return max(float((x[k] - y[k]).abs().max() / y[k].abs().max()) for k in y)


def test_a_v1_run_resumes_exactly_replays_and_evaluates_with_pass_at_k(tmp_path, tiny_model_dir):
    run(["--model", tiny_model_dir, *LIVE, "--save_strategy", "steps", "--save_steps", "2",
         "--output_dir", str(tmp_path / "full"), "--save_rollouts_path", str(tmp_path / "full.jsonl")], tmp_path)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    resumed = run(["--model", tiny_model_dir, *LIVE, "--save_strategy", "no", "--resume_from_checkpoint",
                   str(checkpoint), "--output_dir", str(tmp_path / "resumed"),
                   "--save_rollouts_path", str(tmp_path / "resumed.jsonl")], tmp_path)
    assert [line.split(" | ")[0] for line in resumed if line.startswith("step ")] == ["step 3/4", "step 4/4"]
    # The batches after the resume are the uninterrupted run's, token for token, and so are the parameters. The
    # sampler's log-probs agree to float32 rounding, not bit for bit: v1's model calls reach the engine over HTTP, so
    # which of them share an engine batch (and its padding) depends on when they arrive.
    seen, again = read_rollouts(tmp_path / "full.jsonl"), read_rollouts(tmp_path / "resumed.jsonl")
    assert len(seen) == 32 and len(again) == 16
    for a, b in zip(again, seen[16:]):
        assert (a.group_id, a.prompt_ids, a.completion_ids, a.completion_mask, a.reward, a.policy_version) == (
            b.group_id, b.prompt_ids, b.completion_ids, b.completion_mask, b.reward, b.policy_version)
        assert a.completion_logprobs == pytest.approx(b.completion_logprobs, abs=1e-5)
    # Those last-bit differences reach the importance ratios, so the parameters agree to ~1e-6 (Adam's normalised
    # steps amplify them), against the 1e-2 the two steps after the checkpoint moved them.
    assert worst_gap(tmp_path / "resumed", tmp_path / "full") < 2e-5
    assert worst_gap(tmp_path / "full", checkpoint) > 1e-3
    # The rewards are the taskset's: shorter replies score higher.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for rollout in seen:
        reply = tokenizer.decode(rollout.completion_ids, skip_special_tokens=True).strip()
        assert rollout.reward == pytest.approx(1 / (1 + len(reply))) and rollout.metrics["reply_chars"] == len(reply)
    assert len({r.reward for r in seen}) > 1  # signal to learn from

    # A replay of the saved rollouts trains the same steps on them: the same parameters as the live run. It
    # evaluates on a v1 --eval_env (4 tasks held out of it) at step 4.
    replay = run(["--model", tiny_model_dir, "--rollouts_path", str(tmp_path / "full.jsonl"), "--rollouts_per_step",
                  "8", "--max_seq_len", "64", "--max_completion_length", "8", "--learning_rate", "1e-2",
                  "--report_to", "none", "--max_steps", "4", "--save_strategy", "no",
                  "--output_dir", str(tmp_path / "replayed"), "--eval_env", GRADED,
                  "--eval_env_args", json.dumps({"harness": "inprocess"}), "--eval_holdout", "4",
                  "--eval_strategy", "steps", "--eval_steps", "4"], tmp_path)
    assert worst_gap(tmp_path / "replayed", tmp_path / "full") < 1e-6  # the same saved log-probs: bit for bit
    assert [line.split(" | ")[0] for line in replay if line.startswith(("step ", "eval at step"))] == [
        "step 1/4", "step 2/4", "step 3/4", "step 4/4", "eval at step 4"]

    # Evaluation of the trained model on held-out tasks, 3 samples each: pass@k from the samples it wrote.
    lines = run(["--model", str(tmp_path / "full"), "--env", GRADED, "--env_args",
                 json.dumps({"harness": "inprocess", "max_new_tokens": 8, "max_seq_len": 64}), "--holdout", "4",
                 "-k", "3", "--pass_threshold", "0.1", "--output", str(tmp_path / "eval.jsonl")], tmp_path,
                module="verifiers_rl.cli.eval")
    records = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(records) == 12 and sorted({r["row"] for r in records}).__len__() == 4
    passed = {}
    for record in records:
        reply = tokenizer.decode(record["completion_ids"], skip_special_tokens=True).strip()
        assert record["reward"] == pytest.approx(1 / (1 + len(reply)))
        passed.setdefault(record["row"], []).append(record["reward"] >= 0.1)
    for k in (1, 3):
        expected = sum(pass_at_k(3, sum(p), k) for p in passed.values()) / len(passed)
        assert f"pass@{k}              {expected:.4f}" in lines, lines
