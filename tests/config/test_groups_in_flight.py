"""--groups_in_flight (continuous generation): what it does not combine with is refused by name with the reason, and
a checkpoint it wrote is refused by a batch-at-a-time run (its pending groups are no whole batches);
--continuous_batching_rows where no engine is built (a replay without evaluation) is refused too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.errors import CheckpointError
from verifiers_rl.rollouts.generator import make_source


def config(**values) -> RLConfig:
    return RLConfig(**{"output_dir": "unused", "use_cpu": True, "report_to": "none", **values})


@pytest.mark.parametrize("values, message", [
    ({"groups_in_flight": -1}, "groups_in_flight must be >= 0"),
    ({"max_off_policy_steps": 0}, "with --max_off_policy_steps 0: groups are generated while the trainer trains"),
    ({"filter_groups": "zero_variance"}, "with --filter_groups zero_variance: its refill rounds are batch-at-a-time"),
    ({"curriculum_hard_below": 0.0}, "with --curriculum_easy_above / --curriculum_hard_below: its per-batch state"),
    ({"rollouts_path": "batches.jsonl"}, "with --rollouts_path (replay): a replay generates nothing"),
])
def test_what_continuous_generation_does_not_combine_with_is_refused_by_name(values, message):
    values = {"groups_in_flight": 4, **values}
    with pytest.raises(ValueError) as error:
        config(**values)
    assert message in str(error.value)
    if values["groups_in_flight"] > 0:
        assert "--groups_in_flight 4 (continuous generation) does not combine" in str(error.value)
        config(**{**values, "groups_in_flight": 0})  # batch at a time takes it


def test_more_groups_in_flight_than_the_staleness_bound_lets_start_is_refused_by_name():
    # A group started at version v is due by batch v + k: (k + 1) batches' groups at most are ever in flight, so a
    # larger N would act as that bound while the user believes N run.
    values = {"rollouts_per_step": 8, "num_generations": 4, "max_off_policy_steps": 2}  # 2 groups a batch, k = 2
    assert config(**values, groups_in_flight=6).groups_in_flight == 6
    with pytest.raises(ValueError, match=r"^--groups_in_flight 7 is more than can ever be in flight: .* \(k \+ 1\) x 2 "
                                         r"groups a batch .* = 6 are, at --max_off_policy_steps 2\. Use "
                                         r"--groups_in_flight 6 or less, or raise --max_off_policy_steps\.$"):
        config(**values, groups_in_flight=7)


def test_a_rollout_source_of_the_users_is_refused_with_groups_in_flight():
    with pytest.raises(ValueError, match="--groups_in_flight 2 sets how live generation from an environment runs"):
        make_source(config(groups_in_flight=2), given=[], environment=None, engine=None)


def test_a_continuous_checkpoint_is_refused_by_a_batch_at_a_time_run(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from verifiers_rl.training.checkpoints import RunCheckpoints
    from verifiers_rl.training.run_state import save_run_state

    args = config(output_dir=str(tmp_path), max_steps=2)
    generator = SimpleNamespace(rows=[], environment=SimpleNamespace(name="toy"), curriculum=None)
    steps = SimpleNamespace(batch_index=1, iteration=1, source=None)
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True, process_index=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    checkpoints = RunCheckpoints(args, accelerator, steps, generator, lambda: model, 0)
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    state = checkpoints.run_state(1)
    state.generator = {"next_position": 4, "in_flight": [[3, 0]], "groups_in_flight": 2}
    save_run_state(folder, state, {})
    with pytest.raises(CheckpointError, match=r"written under continuous generation \(--groups_in_flight 2\).*"
                                              r"Resume it with --groups_in_flight N"):
        checkpoints.restore(str(folder), 1)


def test_continuous_batching_rows_in_a_replay_without_evaluation_is_refused():
    with pytest.raises(ValueError, match="--continuous_batching_rows 8 sets how the embedded engine decodes; a replay"):
        config(rollouts_path="batches.jsonl", continuous_batching_rows=8)
    config(rollouts_path="batches.jsonl", continuous_batching_rows=8, eval_strategy="steps", eval_steps=5)  # evaluates
    config(rollouts_path="batches.jsonl")  # the default, 0
