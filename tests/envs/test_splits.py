"""Held-out evaluation splits: the built-ins' (generated from other seeds, disjoint from training) and --eval_holdout's
(seeded rows moved out of training)."""

import pytest

from verifiers_rl.envs import Rubric, SingleTurnEnv, load_environment
from verifiers_rl.envs.splits import hold_out


@pytest.mark.parametrize("name", ["reverse_text", "arithmetic", "calculator"])
def test_builtin_eval_split_never_repeats_a_training_prompt(tokenizer, tool_tokenizer, name):
    tokenizer = tool_tokenizer if name == "calculator" else tokenizer
    env = load_environment(name, tokenizer=tokenizer, num_examples=300, seed=5)
    assert len(env.eval_dataset) == 100  # num_eval_examples' default
    prompts = lambda rows: [repr(row.prompt) for row in rows]  # noqa: E731
    train, held = set(prompts(env.dataset)), prompts(env.eval_dataset)
    assert len(set(held)) == len(held) and not set(held) & train
    again = load_environment(name, tokenizer=tokenizer, num_examples=300, seed=5, num_eval_examples=10)
    assert prompts(again.eval_dataset) == held[:10] and set(prompts(again.dataset)) == train


def test_builtin_eval_split_error_when_the_task_space_is_used_up(tokenizer):
    # 3 x 3 operands x 4 operations: at most 33 distinct questions, most of them drawn for training.
    with pytest.raises(ValueError, match="found only .* evaluation rows .* Lower num_eval_examples or num_examples"):
        load_environment("arithmetic", tokenizer=tokenizer, num_examples=500, max_operand=2, num_eval_examples=20)


def _toy_env(tokenizer, rows=10, eval_rows=()):
    dataset = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(rows)]
    held = [{"question": f"e{i}", "answer": f"b{i}"} for i in range(eval_rows)] if eval_rows else None
    return SingleTurnEnv(dataset, Rubric([lambda completion: 0.0]), tokenizer, max_new_tokens=4, max_seq_len=64,
                         eval_dataset=held)


def test_holdout_moves_seeded_rows_out_of_training(tokenizer):
    env = _toy_env(tokenizer)
    hold_out(env, 3, seed=7)
    held = [row.index for row in env.eval_dataset]
    assert len(held) == 3 and [row.index for row in env.dataset] == [i for i in range(10) if i not in held]
    hold_out(env, 3, seed=7)  # the same holdout again: nothing moves
    assert len(env.dataset) == 7
    with pytest.raises(ValueError, match="already held out with --eval_holdout 3"):
        hold_out(env, 2, seed=7)
    same, other = _toy_env(tokenizer), _toy_env(tokenizer)
    hold_out(same, 3, seed=7)
    hold_out(other, 3, seed=8)
    assert [row.index for row in same.eval_dataset] == held
    assert [row.index for row in other.eval_dataset] != held
    with pytest.raises(ValueError, match="--eval_holdout 10: .* has 10 training rows"):
        hold_out(_toy_env(tokenizer), 10, seed=0)


def test_new_length_limits_after_a_holdout_keep_the_split(tokenizer):
    # adopt_limits filters the rows again for the trainer's limits; it used to rebuild the training rows from all the
    # rows (the held-out ones back in training) while hold_out's marker said the split was made.
    env = _toy_env(tokenizer)
    hold_out(env, 3, seed=7)
    held, train = [row.index for row in env.eval_dataset], [row.index for row in env.dataset]
    env.adopt_limits(max_seq_len=48, max_new_tokens=4)
    assert [row.index for row in env.eval_dataset] == held and [row.index for row in env.dataset] == train
    hold_out(env, 3, seed=7)  # still the same split: nothing moves
    assert [row.index for row in env.dataset] == train
