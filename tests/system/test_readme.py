"""The README's own-environment example runs as printed, the README stays short, and the documentation's relative
links lead to files that exist.

The example is the README's ```python block whose first line is ``# my_env.py``: it is written to a file, loaded by
``verifiers-rl train --env FILE`` (``verifiers_rl.cli.train.main``, in this process) with the tiny model for two
steps, and every trained rollout's reward is recomputed from the example's own reward functions."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from verifiers_rl.cli import train as train_command
from verifiers_rl.envs.parsers import Parser
from verifiers_rl.core.rollout import read_rollouts

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLE_MARKER = "# my_env.py"
MAX_README_LINES = 350
ROLLOUTS_PER_STEP, STEPS = 8, 2


def readme_example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    examples = [block for block in blocks if block.startswith(EXAMPLE_MARKER)]
    assert len(examples) == 1, f"README.md needs exactly one ```python block starting with {EXAMPLE_MARKER!r}"
    return examples[0]


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("readme_my_env", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_short_and_shows_an_environment_early():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; keep it <= {MAX_README_LINES} (move detail to docs/)"
    start = next(i for i, line in enumerate(lines) if line.startswith(EXAMPLE_MARKER))
    assert start < 150, f"the own-environment example starts at line {start + 1}; a newcomer should meet it in the first 150"
    assert "SPEC" not in README.read_text()


def test_the_readme_environment_example_trains(tmp_path, tiny_model_dir, capsys):
    env_file = tmp_path / "my_env.py"
    env_file.write_text(readme_example())
    module = load_module(env_file)
    seen = tmp_path / "seen.jsonl"
    argv = ["--model", tiny_model_dir, "--env", str(env_file), "--max_steps", str(STEPS),
            "--rollouts_per_step", str(ROLLOUTS_PER_STEP), "--num_generations", "4", "--print_samples_every", "0",
            "--save_rollouts_path", str(seen), "--report_to", "none", "--output_dir", str(tmp_path / "out")]
    assert train_command.main(argv) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()

    # The run's prompts are the example's rows (its default size and seed), and each reward is the example's reward functions (with the rubric's
    # weights) of the saved completion, recomputed here without the Rubric.
    answers = {row["question"]: row["answer"] for row in module.make_rows(1000, 0)}
    rubric_weights = re.search(r"Rubric\(\[([^\]]*)\], weights=\[([^\]]*)\]\)", readme_example())
    assert rubric_weights, "the example's Rubric([...], weights=[...]) call"
    functions = [getattr(module, name.strip()) for name in rubric_weights.group(1).split(",")]
    weights = [float(w) for w in rubric_weights.group(2).split(",")]
    parser = Parser()
    rollouts = read_rollouts(seen)
    assert len(rollouts) == STEPS * ROLLOUTS_PER_STEP
    rewards = []
    for rollout in rollouts:
        question = rollout.prompt[-1]["content"]
        assert question in answers, f"a prompt the example does not make: {question!r}"
        available = {"completion": rollout.completion, "answer": answers[question], "parser": parser}
        expected = sum(weight * func(**{name: available[name] for name in inspect.signature(func).parameters})
                       for func, weight in zip(functions, weights))
        assert rollout.reward == pytest.approx(expected, abs=1e-12), (rollout.completion, rollout.metrics)
        rewards.append(rollout.reward)
    assert len(set(rewards)) > 1, "the rewards should vary (the brevity reward of random replies), or this checks little"

    # What the step lines report is the mean of those rewards, step by step.
    logged = [float(match) for match in re.findall(r"^step \d+/\d+ \| reward (-?[\d.]+) ", capsys.readouterr().out,
                                                    flags=re.M)]
    means = [sum(rewards[i:i + ROLLOUTS_PER_STEP]) / ROLLOUTS_PER_STEP for i in range(0, len(rewards), ROLLOUTS_PER_STEP)]
    assert logged == pytest.approx(means, abs=5e-4)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def documentation_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md", ROOT / "tests" / "README.md"]


@pytest.mark.parametrize("doc", documentation_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_that_exists(doc):
    if not doc.exists():
        pytest.fail(f"{doc.relative_to(ROOT)} is missing")
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or a link within the page
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"
