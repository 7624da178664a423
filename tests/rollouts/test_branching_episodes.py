"""Episodes of several branches (a verifiers v1 sub-agent's shape, ``Rollout.episode_id``) count once wherever
rollouts are counted: ``--rollouts_per_step`` and ``--num_generations`` count episodes, live and in replay (a saved
file replays as the batches the live run trained), and evaluation's samples, pass@k and reward means are episodes."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.rollout import Rollout, RolloutFormatError, group_by_id, group_episodes, write_rollouts
from verifiers_rl.envs import Rubric, SingleTurnEnv
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.rollouts.evaluation import EvalSettings, evaluate, pass_at_k
from verifiers_rl.rollouts.generator import ReplaySource, split_into_batches
from verifiers_rl.training.trainer import RLTrainer


class ScoutedEnv(SingleTurnEnv):
    """A one-turn task whose odd episodes have a scout: episode i of a group is 1 + i % 2 branches, each a real
    sample of the row's prompt, sharing the episode's ``episode_id`` and its first branch's reward and scores (as
    the v1 adapter gives a sub-agent episode's branches)."""

    async def rollout_group(self, sampler, row, group_id, n, *, seed=None, temperature=None):
        sizes = [1 + i % 2 for i in range(n)]
        samplings = self.group_samplings(sum(sizes), seed, temperature)
        drawn = iter(await asyncio.gather(*(self._rollout_under(s, sampler, row, group_id) for s in samplings)))
        rollouts = []
        for episode, size in enumerate(sizes):
            branches = [next(drawn) for _ in range(size)]
            for branch in branches:
                branch.reward, branch.metrics = branches[0].reward, dict(branches[0].metrics)
                branch.episode_id = episode if size > 1 else None
            rollouts += branches
        return rollouts


def odd_length(completion) -> float:
    return float(len(completion[-1]["content"]) % 2)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def scouted_env(tokenizer) -> ScoutedEnv:
    return ScoutedEnv([{"question": f"q{i}", "answer": "x"} for i in range(8)], Rubric([odd_length]), tokenizer,
                      max_new_tokens=6, max_seq_len=64,
                      eval_dataset=[{"question": f"e{i}", "answer": "x"} for i in range(3)])


def branching_file() -> list[Rollout]:
    """Six groups of two episodes; episode e of group g has 1 + (g + e) % 3 branches."""
    rollouts = []
    for g in range(6):
        for e in range(2):
            for b in range(1 + (g + e) % 3):
                rollouts.append(Rollout([1, 2 + g], [3 + b, 4], [1, 1], float(e), f"g{g}",
                                        completion_logprobs=[-1.0, -1.0], episode_id=e))
    return rollouts


def test_replayed_batches_count_episodes_and_hold_whole_groups_and_episodes(tmp_path):
    rollouts = branching_file()
    path = tmp_path / "branching.jsonl"
    write_rollouts(path, rollouts)
    # Before: rollouts were counted, so a step of 4 took 1 or 2 groups, whatever their episodes, or refused the file.
    for batches in (split_into_batches(rollouts, 4), ReplaySource(path, 4).batches):
        assert [len(group_episodes(batch)) for batch in batches] == [4, 4, 4]
        assert [len(batch) for batch in batches] == [8, 7, 9]  # more rollouts than episodes: the branches
        assert [r for batch in batches for r in batch] == rollouts  # in order, nothing left out
        assert [[g[0].group_id for g in group_by_id(batch)] for batch in batches] == [
            ["g0", "g1"], ["g2", "g3"], ["g4", "g5"]]
    with pytest.raises(RolloutFormatError, match=r"Group 'g1' \(2 episodes in 5 rollouts\) does not fit the 1 "
                                                 r"episodes left in batch 0.*sum of whole groups' episodes"):
        split_into_batches(rollouts, 3)
    with pytest.raises(RolloutFormatError, match=r"Group 'g0' has 2 episodes in 3 rollouts, more than "
                                                 r"rollouts_per_step=1 \(which counts episodes"):
        split_into_batches(rollouts, 1)


def test_a_live_run_of_branching_episodes_saves_batches_that_replay_as_it_trained_them(tmp_path, tiny_model_dir,
                                                                                         tokenizer):
    saved = tmp_path / "saved.jsonl"
    args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no",
                    logging_steps=1, max_steps=2, rollouts_per_step=4, num_generations=2, max_seq_len=64,
                    max_off_policy_steps=0, gradient_checkpointing=False, disable_tqdm=True, seed=3,
                    save_rollouts_path=str(saved), print_samples_every=0)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=6))
    RLTrainer(tiny_model_dir, args, processing_class=tokenizer, environment=scouted_env(tokenizer),
              engine=engine).train()
    batches = ReplaySource(saved, 4).batches
    # Each live batch: 2 groups (rows) x 2 episodes, the second of each with a scout: 6 rollouts for 4 episodes;
    # group ids name the live batch (b<index>-p<position>), so each replayed batch is the one the run trained.
    assert [len(batch) for batch in batches] == [6, 6]
    assert [len(group_episodes(batch)) for batch in batches] == [4, 4]
    for index, batch in enumerate(batches):
        assert {str(r.group_id).split("-")[0] for r in batch} == {f"b{index}"}
        assert all(len(group_episodes(group)) == 2 for group in group_by_id(batch))


def test_evaluation_counts_an_episode_of_several_branches_once(tiny_model_dir, tokenizer):
    env = scouted_env(tokenizer)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=6))
    finished = []
    result = evaluate(env, engine, EvalSettings(num_examples=3, samples_per_prompt=3, seed=5),
                      on_group=finished.append)
    assert finished == [3, 3, 3] and len(result.samples) == 9  # episodes, not their 12 rollouts
    assert [len(s.rollouts) for s in result.samples if s.row.index == 0] == [1, 2, 1]
    assert all(r.reward == s.rollout.reward for s in result.samples for r in s.rollouts)
    episodes = {row: [s.rollout.reward for s in result.samples if s.row.index == row] for row in range(3)}
    passes = {row: sum(r >= 1.0 for r in rewards) for row, rewards in episodes.items()}
    want = {"reward": sum(map(sum, episodes.values())) / 9,
            "pass@1": sum(pass_at_k(3, c, 1) for c in passes.values()) / 3,
            "pass@3": sum(pass_at_k(3, c, 3) for c in passes.values()) / 3}
    got = {"reward": result.reward, "pass@1": result.pass_at[1], "pass@3": result.pass_at[3]}
    assert got == pytest.approx(want)
    # Counting branches as samples (a scouted episode twice) gives other numbers on this draw.
    branches = {row: [r.reward for s in result.samples if s.row.index == row for r in s.rollouts] for row in range(3)}
    by_branch = {"reward": sum(map(sum, branches.values())) / 12,
                 "pass@1": sum(pass_at_k(4, sum(r >= 1.0 for r in rs), 1) for rs in branches.values()) / 3,
                 "pass@3": sum(pass_at_k(4, sum(r >= 1.0 for r in rs), 3) for rs in branches.values()) / 3}
    assert all(by_branch[key] != pytest.approx(want[key]) for key in want), (by_branch, want)
    # Token counts are over every rollout (each branch a sequence), and the saved lines are every rollout.
    tokens = [r.completion_mask.count(1) for s in result.samples for r in s.rollouts]
    assert result.completion_tokens == pytest.approx(sum(tokens) / 12)
    records = [record for s in result.samples for record in s.records()]
    assert len(records) == 12 and {r["sample"] for r in records if r["row"] == 0} == {0, 1, 2}
    assert "9 episodes (12 rollouts)" in result.table()


def test_training_reward_metrics_count_an_episode_once():
    """The step's reward, its std, rewards/<fn>/* and env/<name>/reward are over episodes (as the advantages,
    evaluation and the curriculum): a three-branch episode counted three times would pull the mean towards it."""
    import statistics

    from verifiers_rl.training.batching import BatchingConfig, plan_batch
    from verifiers_rl.training.step_batches import environment_metrics, rollout_metrics

    rollouts = [r for r in branching_file() if r.group_id in ("g0", "g1")]  # episodes 0/1 of 1-3 branches each
    for r in rollouts:
        r.metrics, r.env = {"score": r.reward * 2}, "mix_a"
    episodes = [episode[0].reward for episode in group_episodes(rollouts)]
    per_branch = [r.reward for r in rollouts]
    assert statistics.fmean(episodes) != statistics.fmean(per_branch)  # else the test could not fail
    stats = plan_batch(rollouts, BatchingConfig(max_seq_len=8))[0].stats
    assert stats.reward_mean == pytest.approx(statistics.fmean(episodes))
    assert stats.reward_std == pytest.approx(statistics.stdev(episodes))
    assert rollout_metrics(rollouts)["rewards/score/mean"] == pytest.approx(2 * statistics.fmean(episodes))
    metrics = environment_metrics(rollouts, {})
    assert metrics["env/mix_a/reward"] == pytest.approx(statistics.fmean(episodes))
    assert metrics["env/mix_a/reward_std"] == pytest.approx(statistics.stdev(episodes))
