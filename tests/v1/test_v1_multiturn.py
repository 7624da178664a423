"""A multi-turn verifiers 0.4 environment (tests/v1/envs/guess_v1.py: a three-turn guessing game in the shape of
v1's TextArena environments, its seat named ``player``) as an environment of ours: it loads under its own seat
name, and each episode is ONE token sequence whose trained ids are the engine's sampled ids (v1's turn bridge is
verifiers_rl's, ``v1_worker/bridge_renderer.py``), the game's turns between them masked, with the game's rewards."""

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from verifiers_rl.envs import load_environment
from verifiers_rl.envs.adapters.verifiers_v1 import V1Env
from verifiers_rl.core.rollout import read_rollouts

from .conftest import recorded_group
from .launching import run

GUESS = Path(__file__).parent / "envs" / "guess_v1.py"
WEIGHTS = {"solved": 1.0, "closeness": 0.5, "answered": 0.25}


def game_rules(replies: list[str], secret: int) -> tuple[list[str], dict[str, float]]:
    """guess_v1's rules, restated (game i's secret is ``secret_of(i)``): the game's answer after each reply but the
    last, and each reward's score."""
    guesses = [int(m.group()) if (m := re.search(r"[1-9]", reply)) else None for reply in replies]
    answers = ["I found no number from 1 to 9 in your reply. Guess again." if g is None else
               "Higher." if g < secret else "Lower." for g in guesses[:-1]]
    named = [g for g in guesses if g is not None]
    scores = {"solved": float(guesses[-1] == secret),
              "closeness": 1 - min(abs(g - secret) for g in named) / 8 if named else 0.0,
              "answered": len(named) / len(replies)}
    return answers, scores


def secret_of(game: int) -> int:
    return 1 + (game * 4) % 9


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in ``mask``."""
    edges = [0] + [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
    return [(mask[a], a, b) for a, b in zip(edges, edges[1:])]


def test_a_v1_environment_whose_seat_is_not_named_agent_loads(tokenizer):
    # TextArena's shape: `class GuessEnvConfig(vf.EnvConfig): player: vf.AgentConfig`. The worker used to pin an
    # `agent` seat, which v1 refused ("agent: Extra inputs are not permitted").
    env = load_environment(str(GUESS), tokenizer=tokenizer, harness="inprocess", taskset={"num_tasks": 2})
    try:
        assert isinstance(env, V1Env) and env.name == "guess_v1" and env.harness.endswith("inprocess_chat")
        opening = "I am thinking of a number from 1 to 9. Guess it."
        assert [row.prompt for row in env.dataset] == [
            [{"role": "user", "content": f"Game {i}: {opening}"}] for i in (0, 1)]
    finally:
        env.close()


@pytest.mark.parametrize("harness", ["inprocess", "null"])
def test_a_three_turn_game_is_one_sequence_of_the_sampled_ids_with_the_games_turns_masked(engine, tokenizer,
                                                                                           harness):
    # The tiny model's replies at temperature 1 do not re-tokenise to their sampled ids: v1's own fallback
    # (re-render every turn) forked each such episode into 3 branches, which the adapter refused.
    env, recording, rollouts = recorded_group(GUESS, tokenizer, engine, 4, seed=3, harness=harness, num_tasks=3,
                                              max_seq_len=256, max_new_tokens=10)
    secret = secret_of(0)
    prompt = tokenizer.apply_chat_template(env.dataset[0].prompt, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    replies_seen = 0
    for rollout in rollouts:
        assert rollout.prompt_ids == list(prompt)
        ids, mask, logprobs = rollout.completion_ids, rollout.completion_mask, rollout.completion_logprobs
        sampled = [(a, b) for value, a, b in runs(mask) if value == 1]
        between = [(a, b) for value, a, b in runs(mask) if value == 0]
        replies = []
        for a, b in sampled:  # each model turn: the engine's sample, its ids and log-probs verbatim
            sample = recording.samples[tuple(ids[a:b])]
            assert logprobs[a:b] == sample.logprobs
            replies.append(tokenizer.decode(ids[a:b], skip_special_tokens=True).strip())
        assert all(lp == 0.0 for (a, b) in between for lp in logprobs[a:b])
        answers, scores = game_rules(replies, secret)
        assert len(replies) == 3 or scores["solved"] == 1.0  # three guesses, unless one was right
        # Between two model turns: the rest of the template's end of turn, the game's answer, the next
        # generation prompt, exactly as the chat template renders them.
        assert len(between) == len(answers)
        for (a, b), answer in zip(between, answers):
            text = tokenizer.decode(ids[a:b])
            if ids[a - 1] == tokenizer.eos_token_id:  # the model ended its turn itself: the rest of it follows
                text = tokenizer.eos_token + text
            assert text == f"<|im_end|>\n<|im_start|>user\n{answer}<|im_end|>\n<|im_start|>assistant\n"
        assert rollout.metrics["guesses"] == len(replies)
        assert rollout.reward == pytest.approx(sum(WEIGHTS[k] * v for k, v in scores.items()))
        assert {f"reward/{k}" for k in WEIGHTS} <= rollout.metrics.keys()
        replies_seen += len(replies)
    assert replies_seen == len(recording.samples)  # every sample the engine drew is in a rollout
    assert len({r.reward for r in rollouts}) > 1


def game_of(rollout, tokenizer) -> tuple[list[str], list[str]]:
    """A saved rollout's replies (its sampled runs, decoded) and the game's turns between them."""
    pieces = [(value, rollout.completion_ids[a:b]) for value, a, b in runs(rollout.completion_mask)]
    replies = [tokenizer.decode(ids, skip_special_tokens=True).strip() for value, ids in pieces if value]
    return replies, [tokenizer.decode(ids, skip_special_tokens=True) for value, ids in pieces if not value]


def test_the_guessing_game_trains_at_temperature_1_and_saves_whole_games(tmp_path, smollm2_model_dir):
    # The default --max_failed_rollouts_fraction (0): one refused episode would stop the run in its first batch.
    # SmolLM2 only: the tiny model's replies that do not re-tokenise are the adapter's test above, for both harnesses.
    model_dir = smollm2_model_dir
    lines = run(["--model", model_dir, "--env", str(GUESS), "--env_args", json.dumps({"taskset": {"num_tasks": 8}}),
                 "--temperature", "1", "--rollouts_per_step", "8", "--num_generations", "4", "--max_seq_len", "256",
                 "--max_completion_length", "12", "--max_steps", "2", "--print_samples_every", "0",
                 "--report_to", "none", "--save_rollouts_path", str(tmp_path / "games.jsonl")], tmp_path)
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollouts = read_rollouts(tmp_path / "games.jsonl")
    assert len(rollouts) == 16
    for rollout in rollouts:
        replies, turns = game_of(rollout, tokenizer)
        game = int(re.search(r"Game (\d+):", tokenizer.decode(rollout.prompt_ids)).group(1))
        answers, scores = game_rules(replies, secret_of(game))
        assert len(replies) == 3 or scores["solved"] == 1.0  # the whole game: three guesses unless one was right
        assert [turn.split("user\n")[-1].split("assistant")[0].strip() for turn in turns] == answers
        assert rollout.reward == pytest.approx(sum(WEIGHTS[k] * v for k, v in scores.items()))
