"""An environment that raises now and then: its group is generated again with the same seeds (so the batch is what
a run without the fault would have had), or dropped and counted, or the run stops with the error (issue: faults)."""

from __future__ import annotations

import logging

import pytest
from transformers import AutoTokenizer

from verifiers_rl.envs import RolloutRefused, Rubric, SingleTurnEnv
from verifiers_rl.rollouts.generator import AsyncGenerator, GenerationError
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig


def length_reward(completion) -> float:
    return float(len(completion[-1]["content"]))


class FlakyEnv(SingleTurnEnv):
    """Raises on the first ``transient`` model calls of each listed row, and on every call of ``broken`` rows."""

    def __init__(self, *args, transient: dict[int, int] | None = None, broken: tuple[int, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.transient = dict(transient or {})
        self.broken = set(broken)

    async def generate(self, sampler, prompt, prompt_ids, state):
        row = state["info"]["row"]
        if row in self.broken:
            raise ConnectionError(f"the sandbox of row {row} is gone")
        if self.transient.get(row, 0) > 0:
            self.transient[row] -= 1
            raise TimeoutError(f"row {row}: the tool timed out")
        return await super().generate(sampler, prompt, prompt_ids, state)


def env(tokenizer, **faults) -> FlakyEnv:
    rows = [{"question": f"Say something ({i}).", "info": {"row": i}} for i in range(4)]
    return FlakyEnv(rows, Rubric([length_reward]), tokenizer, max_new_tokens=6, max_seq_len=64, name="flaky", **faults)


def batch(tiny_model_dir, environment, **knobs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = EmbeddedEngine(tiny_model_dir, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=6))
    generator = AsyncGenerator(environment, engine, rollouts_per_step=16, num_generations=4, max_off_policy_steps=0,
                               seed=5, timeout_s=120, **knobs)
    try:
        return generator.batch(0)
    finally:
        generator.close()


def key(rollouts):
    return sorted((r.group_id, tuple(r.completion_ids)) for r in rollouts)


def test_a_transient_failure_is_retried_with_the_same_seeds(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    clean = batch(tiny_model_dir, env(tokenizer))
    flaky = batch(tiny_model_dir, env(tokenizer, transient={1: 1, 3: 2}), max_rollout_retries=2)
    assert key(flaky.rollouts) == key(clean.rollouts)  # the retried groups sampled exactly what they would have
    # One failed attempt per flaky group (row 3's two transient faults both hit its first attempt's rollouts).
    assert flaky.stats["rollouts_failed"] == 2 and flaky.stats["groups_dropped_on_error"] == 0
    assert clean.stats["rollouts_failed"] == 0


def test_a_group_that_keeps_failing_is_dropped_within_the_allowed_fraction(tiny_model_dir, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.rollouts.generator"):
        result = batch(tiny_model_dir, env(tokenizer, broken=(2,)), max_rollout_retries=1,
                       max_failed_rollouts_fraction=0.25)
    assert len(result.rollouts) == 12 and len({r.group_id for r in result.rollouts}) == 3
    assert result.stats["groups_dropped_on_error"] == 1 and result.stats["rollouts_failed"] == 2
    assert "the sandbox of row 2 is gone" in caplog.text and "dropped 1 of 4 groups" in caplog.text


def test_more_failures_than_allowed_stop_the_run_with_the_error_and_the_flags(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(GenerationError, match=r"1 of 4 groups failed 3 time\(s\) each \(--max_rollout_retries 2\), "
                                              r"more than --max_failed_rollouts_fraction 0 .* row 2 is gone"):
        batch(tiny_model_dir, env(tokenizer, broken=(2,)))
    # Every group gone: the fraction (up to 1) allowed it, so the message names the rule that stopped the run.
    with pytest.raises(GenerationError, match=r"4 of 4 groups .*, none of the batch is left, which stops the run "
                                              r"whatever --max_failed_rollouts_fraction allows\. Last error"):
        batch(tiny_model_dir, env(tokenizer, broken=(0, 1, 2, 3)), max_rollout_retries=0,
              max_failed_rollouts_fraction=1)
    with pytest.raises(ValueError, match="max_failed_rollouts_fraction must be <= 1"):
        from verifiers_rl.config.rl_config import RLConfig

        RLConfig(output_dir="/tmp/unused", report_to="none", max_failed_rollouts_fraction=1.5)


class RefusingEnv(FlakyEnv):
    """Refuses every rollout of the ``refused`` rows, as the v1 adapter refuses an episode it cannot train, and fails
    on the ``buggy`` rows with a TypeError of its own code (which a retry under the same seeds would raise again);
    counts each row's calls."""

    def __init__(self, *args, refused: tuple[int, ...] = (), buggy: tuple[int, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.refused, self.buggy, self.calls = set(refused), set(buggy), {}

    async def generate(self, sampler, prompt, prompt_ids, state):
        row = state["info"]["row"]
        self.calls[row] = self.calls.get(row, 0) + 1
        if row in self.refused:
            raise RolloutRefused(f"row {row}: the episode has 2 trainable branches")
        if row in self.buggy:
            return row + "th turn"  # the environment's bug
        return await super().generate(sampler, prompt, prompt_ids, state)


def refusing_env(tokenizer, **faults) -> RefusingEnv:
    rows = [{"question": f"Say something ({i}).", "info": {"row": i}} for i in range(4)]
    return RefusingEnv(rows, Rubric([length_reward]), tokenizer, max_new_tokens=6, max_seq_len=64, name="flaky",
                       **faults)


@pytest.mark.parametrize("fault, why", [
    ("refused", r"were refused \(not retried: the same seeds would refuse them again\)"),
    ("buggy", r"raised TypeError in the environment's code \(not retried: the same seeds would raise it again\)"),
])
def test_a_refusal_or_an_error_of_the_environments_code_is_not_retried(fault, why, tiny_model_dir, caplog):
    # Both are functions of the group's seeds, which a retry reuses: retrying would only fail again.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    failing = refusing_env(tokenizer, **{fault: (2,)})
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.rollouts.generator"):
        result = batch(tiny_model_dir, failing, max_rollout_retries=2, max_failed_rollouts_fraction=0.25)
    assert result.stats["groups_dropped_on_error"] == 1 and result.stats["rollouts_failed"] == 1  # one attempt
    assert failing.calls[2] == 4 and failing.calls[1] == 4  # its 4 rollouts once, as every other group's
    assert "Group b0-p" in caplog.text and "(not retried" in caplog.text
    with pytest.raises(GenerationError, match=rf"1 of 4 groups {why}, more than --max_failed_rollouts_fraction 0 "):
        batch(tiny_model_dir, refusing_env(tokenizer, **{fault: (2,)}))


def test_a_batch_error_counts_each_kind_of_dropped_group(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(GenerationError) as stopped:
        batch(tiny_model_dir, refusing_env(tokenizer, buggy=(2,), broken=(1,)), max_rollout_retries=2)
    assert str(stopped.value).startswith("Batch 0: 2 of 4 groups were dropped: "), stopped.value
    assert "1 raised TypeError in the environment's code (not retried: the same seeds would raise it again)" in \
        str(stopped.value) and "1 failed 3 time(s) each (--max_rollout_retries 2)" in str(stopped.value)
