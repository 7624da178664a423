"""Launching the real programs from tests: the repository root, the launched processes' environment, an
``accelerate launch`` prefix, ``examples/train.py`` runs, and the equivalence runner's inputs and outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from verifiers_rl.core.engine import free_port
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 600
EQUIVALENCE_RUNNER = ROOT / "tests" / "distributed" / "equivalence_run.py"
LIVE_RUNNER = ROOT / "tests" / "live" / "live_run.py"
TOY_ENV = ROOT / "tests" / "live" / "toy_env.py"
# The toy task (``TOY_ENV``): fraction of vowels in 8 sampled tokens; a random policy scores ~0.3.
MIN_REWARD_GAIN = 0.08
# An environment file whose code raises TypeError at line 4 in every rollout (a mid-run failure of the user's code).
RAISING_ENV = (
    "from verifiers_rl.envs import Rubric, SingleTurnEnv\n"
    "class Talk(SingleTurnEnv):\n"
    "    async def generate(self, sampler, prompt, prompt_ids, state):\n"
    "        return 'turn ' + len(prompt)\n"
    "def load_environment(tokenizer):\n"
    "    rows = [{'question': f'say {i}', 'answer': str(i)} for i in range(8)]\n"
    "    return Talk(rows, Rubric([lambda completion: 0.0]), tokenizer, max_new_tokens=4, max_seq_len=128,\n"
    "                name='talk')\n")
SCRIPT = str(ROOT / "examples" / "train.py")
COMMON = ["--learning_rate", "1e-3", "--disable_tqdm", "true", "--report_to", "none", "--logging_steps", "1",
          "--print_samples_every", "0"]
LIVE = ["--env", "reverse_text", "--env_args", '{"num_examples": 64}', "--rollouts_per_step", "8",
        "--num_generations", "4"]


def with_flags(base: list[str], flags: list[str]) -> list[str]:
    """``base`` then ``flags``, each flag of ``flags`` in place of ``base``'s own (the commands refuse a flag given
    twice); a flag's values are the words up to the next ``--flag``."""
    names = {word.split("=", 1)[0] for word in flags if word.startswith("--")}
    kept, dropping = [], False
    for word in base:
        if word.startswith("--"):
            dropping = word.split("=", 1)[0] in names
        if not dropping:
            kept.append(word)
    return [*kept, *flags]


def launch_env(env_extra: dict | None = None, threads: int | None = 1) -> dict:
    """The launched processes' environment: the repo first on PYTHONPATH, before what is there already (a GPU
    machine's carried packages, scripts/gpu_bringup.sh); OMP_NUM_THREADS ``threads`` (None: as it is here)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    omp = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    return {**os.environ, "PYTHONPATH": path, **omp, **(env_extra or {})}


def launch(prefix: list[str], args: list[str], log: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``prefix + args`` from the repository root with its output in ``log``, within LAUNCH_TIMEOUT_S."""
    env = launch_env(env_extra)
    with log.open("w") as handle:
        result = subprocess.run(prefix + args, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                timeout=LAUNCH_TIMEOUT_S)
    return result


def accelerate(config: str) -> list[str]:
    """``accelerate launch`` with one of accelerate_configs/ on a free port."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
            "--main_process_port", str(free_port())]


def run(prefix, out: Path, args: list[str], log: Path, expect: int = 0) -> str:
    """``examples/train.py`` under ``prefix`` into ``out`` with COMMON flags; asserts its exit status, returns its log."""
    result = launch(prefix, [SCRIPT, *with_flags(["--output_dir", str(out), *COMMON], args)], log)
    text = log.read_text()
    assert result.returncode == expect, text[-6000:]
    return text


def final_parameters(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_equal_parameters(got: Path, want: Path, initial: Path | None = None) -> None:
    """Relative difference < 1e-6 (float32 on CPU; in practice the resumed runs here are bitwise equal)."""
    a, b = final_parameters(got), final_parameters(want)
    assert set(a) == set(b)
    worst = max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)
    assert worst < 1e-6, f"max relative parameter difference {worst:.3e}"
    if initial is not None:  # sensitivity: the steps after the checkpoint moved the parameters well beyond that
        c = final_parameters(initial)
        moved = max(float((b[k] - c[k]).abs().max() / b[k].abs().max()) for k in b)
        assert moved > 1e-4, f"the steps after the checkpoint barely moved the parameters ({moved:.2e})"


def logged_steps(log: str) -> list[int]:
    """The step numbers of a run's per-step lines."""
    return [int(line.split()[1].split("/")[0]) for line in log.splitlines() if line.startswith("step ") and "| reward" in line]


def runner_inputs(work: Path, model_dir: str) -> list[str]:
    """The equivalence runner's model and rollouts arguments; writes the three rollouts files into ``work``."""
    # A system prompt every group starts with: a packed row holds it once (prefix.row_root).
    main = random_rollouts(4, 4, vocab_size=390, seed=1, fully_masked_fraction=0.15,
                           shared_turn_fraction=0.5, system_prompt_len=5)
    for rollout in main:  # a group without reward variance (zero advantages; dropped by --filter_groups)
        if rollout.group_id == "g1":
            rollout.reward = 0.25
    write_rollouts(work / "main.jsonl", main)
    write_rollouts(work / "small.jsonl", random_rollouts(2, 3, vocab_size=390, seed=2, fully_masked_fraction=0.0))
    # 4 groups, 15 episodes in 20 rollouts (one of 3 branches, three of 2), reward variance in every group.
    write_rollouts(work / "branching.jsonl", random_rollouts(4, 5, vocab_size=390, seed=4, branch_fraction=0.5))
    return ["--model", model_dir, "--rollouts", str(work / "main.jsonl"), "--small_rollouts", str(work / "small.jsonl"),
            "--branching_rollouts", str(work / "branching.jsonl")]


def load_run(out: Path, name: str):
    """One configuration's parameters and record as the equivalence runner saved them in ``out``."""
    return torch.load(out / f"{name}.pt"), json.loads((out / f"{name}.json").read_text())


def assert_step_equals_single_process(single_out: Path, out: Path, name: str, initial_parameters, backend: str) -> None:
    """The run saved in ``out`` (2 processes, ``backend`` ddp or zero3) took the single process's step: parameters
    (rel. < 1e-5), exactly one optimizer and scheduler step per batch, the logged loss and token metrics."""
    from tests.distributed.equivalence_run import CONFIGS  # the runner imports the trainer: only where needed

    single_params, single = load_run(single_out, name)
    params, record = load_run(out, name)
    expected_steps = CONFIGS[name].get("max_steps", CONFIGS[name].get("num_iterations", 1))

    assert record["num_processes"] == 2 and single["num_processes"] == 1
    expected_wrapper = "DeepSpeedEngine" if backend == "zero3" else "DistributedDataParallel"
    assert record["model_class"] == expected_wrapper
    # Exactly one optimizer step, one scheduler step per batch.
    assert record["optimizer_steps"] == single["optimizer_steps"] == expected_steps
    assert record["scheduler_steps"] == single["scheduler_steps"] == expected_steps
    assert record["global_steps"] == expected_steps

    assert set(params) == set(single_params)
    worst = 0.0
    update = 0.0
    for key, reference in single_params.items():
        worst = max(worst, float((params[key] - reference).abs().max() / reference.abs().max()))
        update = max(update, float((reference - initial_parameters[key]).abs().max() / reference.abs().max()))
    assert worst < 1e-5, f"max relative parameter difference {worst:.3e}"
    # Sensitivity: the step moved parameters by far more than the tolerance, so a scale error would show.
    assert update > 100 * 1e-5, f"the step barely moved the parameters ({update:.2e})"

    # The logged loss is the single-device loss of the batch.
    assert len(record["losses"]) == len(single["losses"]) == expected_steps
    for got, want in zip(record["losses"], single["losses"]):
        assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), (got, want)
    # Token-weighted metrics are global too: the same numbers as one process over the whole batch.
    assert set(record["metrics"]) == set(single["metrics"]) and "entropy" in single["metrics"]
    for key, values in single["metrics"].items():
        for got, want in zip(record["metrics"][key], values):
            assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), (key, got, want)
