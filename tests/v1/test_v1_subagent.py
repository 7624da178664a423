"""A verifiers 0.4 environment with a sub-agent (tests/v1/envs/relay_v1.py: a ``lead`` seat helped by a ``scout``,
both trainable): every episode has two trainable branches, each trained as a rollout of its own that shares the
episode's ``episode_id`` and reward (docs/environments.md, episodes of several branches); the run trains."""

import json
from pathlib import Path

import pytest

from verifiers_rl.core.rollout import group_episodes, read_rollouts
from verifiers_rl.envs.adapters.verifiers_v1 import trainable_branches
from verifiers_rl.envs.environment import RolloutRefused
from verifiers_rl.rollouts.generator import ReplaySource

from .conftest import recorded_group
from .launching import run

RELAY = Path(__file__).parent / "envs" / "relay_v1.py"
WEIGHTS = {"solved": 1.0, "brief": 0.5}


def relay_reward(lead_reply: str, answer: str) -> float:
    """relay_v1's rules, restated: solved (the lead's reply is the reversed word) and brief (1 / (1 + length))."""
    reply = lead_reply.strip()
    return WEIGHTS["solved"] * float(reply == answer) + WEIGHTS["brief"] / (1 + len(reply))


def seats_of(rollouts, tokenizer) -> dict:
    """episode_id -> {"lead": rollout, "scout": rollout}, by each branch's prompt."""
    out: dict = {}
    for rollout in rollouts:
        seat = "lead" if "Reverse the text:" in tokenizer.decode(rollout.prompt_ids) else "scout"
        assert seat not in out.setdefault(rollout.episode_id, {})
        out[rollout.episode_id][seat] = rollout
    return out


def test_a_sub_agent_episode_is_two_rollouts_sharing_the_episode_and_its_reward(engine, tokenizer):
    # Before: "the episode has 2 trainable branches; verifiers_rl trains one token sequence per rollout" (refused).
    _, recording, rollouts = recorded_group(RELAY, tokenizer, engine, 3, seed=5, max_seq_len=256, max_new_tokens=8)
    assert len(rollouts) == 6 and {r.group_id for r in rollouts} == {"g"}
    episodes = seats_of(rollouts, tokenizer)
    assert sorted(episodes) == [0, 1, 2] and all(set(seats) == {"lead", "scout"} for seats in episodes.values())
    for seats in episodes.values():
        lead, scout = seats["lead"], seats["scout"]
        reply = tokenizer.decode([t for t, m in zip(lead.completion_ids, lead.completion_mask) if m],
                                 skip_special_tokens=True)
        assert lead.reward == scout.reward == pytest.approx(relay_reward(reply, "olleh"))
        # The lead's prompt holds the scout's reply: two sequences, each the engine's own samples.
        hint = tokenizer.decode([t for t, m in zip(scout.completion_ids, scout.completion_mask) if m],
                                skip_special_tokens=True).strip()
        assert f"Your scout's hint: {hint}" in tokenizer.decode(lead.prompt_ids)
        for rollout in (lead, scout):
            sampled = tuple(t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m)
            assert recording.samples[sampled].logprobs == [
                lp for lp, m in zip(rollout.completion_logprobs, rollout.completion_mask) if m]


def trace(reward: float, branches: int = 1, trainable: bool = True) -> dict:
    branch = {"token_ids": [1, 2, 3], "sampled_mask": [False, True, True], "logprobs": [0.0, -1.0, -1.0],
              "trainable": True, "advantages": None}
    return {"ok": True, "trainable": trainable, "reward": reward, "rewards": {}, "metrics": {}, "errors": [],
            "stop_condition": "agent_completed", "is_timeout": False, "is_truncated": False, "last_reply": "",
            "branches": [branch] * branches}


def test_what_still_cannot_train_is_refused_and_an_untrainable_seat_is_left_out():
    # An untrainable seat (a judge, a simulated user) is the environment's: its branch is not ours to train.
    assert [b["of_several"] for _, b in trainable_branches([trace(1.0), trace(0.0, trainable=False)], "w")] == [False]
    assert [b["of_several"] for _, b in trainable_branches([trace(1.0, branches=3)], "w")] == [True] * 3
    with pytest.raises(RolloutRefused, match="trainable traces score differently"):
        trainable_branches([trace(1.0), trace(0.0)], "w")  # best-of-n's shape: each attempt its own reward
    carrying = trace(1.0)
    carrying["branches"] = [{**carrying["branches"][0], "advantages": [0.0, 1.0, 1.0]}]
    with pytest.raises(RolloutRefused, match="carries its own advantages"):
        trainable_branches([carrying], "w")
    with pytest.raises(RolloutRefused, match="no trainable branch that sampled a token"):
        trainable_branches([trace(1.0, trainable=False)], "w")


def test_the_sub_agent_environment_trains_two_steps_on_the_tiny_model(tmp_path, tiny_model_dir, tokenizer):
    lines = run(["--model", tiny_model_dir, "--env", str(RELAY), "--env_args", json.dumps(
                 {"harness": "inprocess", "taskset": {"num_tasks": 4}}), "--temperature", "1",
                 "--rollouts_per_step", "4", "--num_generations", "2", "--max_seq_len", "256",
                 "--max_completion_length", "8", "--max_steps", "2", "--print_samples_every", "0",
                 "--report_to", "none", "--save_rollouts_path", str(tmp_path / "relay.jsonl")], tmp_path)
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    rollouts = read_rollouts(tmp_path / "relay.jsonl")
    assert len(rollouts) == 2 * 4 * 2  # 2 steps x 4 episodes x 2 branches
    for group in {r.group_id for r in rollouts}:
        episodes = seats_of([r for r in rollouts if r.group_id == group], tokenizer)
        assert len(episodes) == 2 and all(s["lead"].reward == s["scout"].reward for s in episodes.values())
    # Replayed at the run's --rollouts_per_step (episodes), the saved file is the two batches the run trained.
    replayed = ReplaySource(tmp_path / "relay.jsonl", 4).batches
    assert [len(group_episodes(batch)) for batch in replayed] == [4, 4]
    assert [{str(r.group_id).split("-")[0] for r in batch} for batch in replayed] == [{"b0"}, {"b1"}]
