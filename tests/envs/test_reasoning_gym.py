"""reasoning-gym tasks as an environment: scored with each task's own score_answer on the <answer> tag, a weighted
mix, a held-out split, and clear errors for unknown tasks, bad configs and a missing extra."""

import asyncio
import sys

import pytest

from verifiers_rl.envs import load_environment
from verifiers_rl.envs.adapters.reasoning_gym import parse_tasks

# An arithmetic task, a puzzle and a graph task.
TASKS = ["leg_counting", "mini_sudoku", "shortest_path"]


def score(env, row, text):
    completion = [{"role": "assistant", "content": text}]
    return asyncio.run(env.rubric.score(row.prompt, completion, row.answer, {}, row.info))


@pytest.mark.parametrize("task", TASKS)
def test_right_answer_scores_1_wrong_less_missing_tag_0(tokenizer, task):
    env = load_environment(f"reasoning_gym:{task}", tokenizer=tokenizer, size=5, eval_size=0, seed=2)
    assert env.name == f"reasoning_gym:{task}" and len(env.dataset) == 5
    assert env.dataset[0].prompt[0]["content"].startswith("Given a problem, your task is to answer the question")
    for row in env.dataset[:3]:
        right = score(env, row, f"Let me think.\n<answer>{row.answer}</answer>")
        assert right.reward == 1.0 and right.metrics["format_reward"] == 1.0
        wrong = score(env, row, f"<answer>{row.answer}x9</answer>")
        assert wrong.reward < 1.0
        assert score(env, row, str(row.answer)).reward == 0.0  # the right answer, but not in the tag
        assert score(env, row, "<answer>draft</answer> then <answer>" + row.answer + "</answer>").reward == 1.0


def test_weighted_mix_held_out_split_and_format_weight(tokenizer):
    assert parse_tasks("leg_counting=3, mini_sudoku") == {"leg_counting": 3.0, "mini_sudoku": 1.0}
    env = load_environment("reasoning_gym:leg_counting=3,shortest_path", tokenizer=tokenizer, size=40, eval_size=20,
                           seed=0, config={"leg_counting": {"min_animals": 1, "max_animals": 2}}, format_weight=0.5)
    tasks = [row.info["task"] for row in env.dataset]
    assert set(tasks) == {"leg_counting", "shortest_path"} and tasks.count("leg_counting") > tasks.count("shortest_path")
    # The task config reached its generator: at most 2 kinds of animals per question.
    legs = [row for row in env.dataset if row.info["task"] == "leg_counting"]
    assert legs and all(row.prompt[-1]["content"].split("if you have")[1].count(",") <= 1 for row in legs)
    # The held-out rows come after the training rows and never repeat a training question.
    train_questions = {row.prompt[-1]["content"] for row in env.dataset}
    assert env.eval_dataset and not train_questions & {row.prompt[-1]["content"] for row in env.eval_dataset}
    assert min(row.info["reasoning_gym_index"] for row in env.eval_dataset) >= 40
    row = env.dataset[0]
    assert score(env, row, f"<answer>{row.answer}</answer>").reward == 1.5  # 1 + 0.5 for the format
    assert score(env, row, "<answer>nope</answer>").reward < 1.5


def test_same_seed_same_rows(tokenizer):
    rows = [load_environment("reasoning_gym:shortest_path", tokenizer=tokenizer, size=8, eval_size=0, seed=s).dataset
            for s in (1, 1, 2)]
    assert [r.prompt for r in rows[0]] == [r.prompt for r in rows[1]] != [r.prompt for r in rows[2]]


def test_clear_errors(tokenizer, monkeypatch):
    with pytest.raises(ValueError, match=r"reasoning-gym has no task 'leg_count' \(close names: leg_counting.*\)"):
        load_environment("reasoning_gym:leg_count", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"bad size/seed/config \{'legs': 3\}: .*legs"):
        load_environment("reasoning_gym:leg_counting", tokenizer=tokenizer, config={"legs": 3})
    with pytest.raises(ValueError, match=r"\['dice'\] are not among the tasks"):
        load_environment("reasoning_gym:leg_counting,gcd", tokenizer=tokenizer, config={"dice": {}})
    for weights in ("leg_counting=0", "leg_counting=inf", "leg_counting=nan"):
        with pytest.raises(ValueError, match=r"weights must be finite numbers > 0; \['leg_counting'\] are not"):
            load_environment(f"reasoning_gym:{weights}", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="task 'leg_counting' is named twice"):  # not its second weight silently
        load_environment("reasoning_gym:leg_counting=3,gcd,leg_counting", tokenizer=tokenizer)
    # reasoning-gym is installed here; its absence is simulated (a None entry makes the import fail).
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ModuleNotFoundError, match=r"optional extra \[reasoning-gym\]: pip install -e \"\.\[reasoning-gym\]\""):
        load_environment("reasoning_gym:leg_counting", tokenizer=tokenizer)
