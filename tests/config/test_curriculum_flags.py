"""The --curriculum_* flags: each bad value refused naming its flag, the thresholds' order, and a curriculum where
nothing is generated (a replay, a rollout source of the user's) refused by name; a checkpoint without a curriculum's
state is refused by a run with one (and a saved state ignored by a run without)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.core.errors import CheckpointError
from verifiers_rl.rollouts.generator import make_source
from verifiers_rl.training.checkpoints import RunCheckpoints
from verifiers_rl.training.run_state import CURRICULUM_FILE


def config(**values) -> RLConfig:
    return RLConfig(output_dir="unused", use_cpu=True, report_to="none", **values)


@pytest.mark.parametrize("values, message", [
    ({"curriculum_easy_above": 0.0}, "curriculum_easy_above must be > 0"),
    ({"curriculum_easy_above": 1.5}, "curriculum_easy_above must be <= 1"),
    ({"curriculum_hard_below": -0.1}, "curriculum_hard_below must be >= 0"),
    ({"curriculum_hard_below": 1.0}, "curriculum_hard_below must be < 1"),
    ({"curriculum_easy_above": 0.5, "curriculum_hard_below": 0.5},
     "--curriculum_hard_below (0.5) must be below --curriculum_easy_above (0.5)"),
    ({"curriculum_window": 0}, "curriculum_window must be >= 1"),
    ({"curriculum_set_aside_epochs": -1}, "curriculum_set_aside_epochs must be >= 0"),
    ({"curriculum_pass_reward": float("inf")}, "--curriculum_pass_reward must be a finite number"),
    ({"curriculum_hard_below": 0.0, "rollouts_path": "batches.jsonl"}, "a replay of --rollouts_path generates nothing"),
])
def test_a_bad_curriculum_flag_is_refused_by_name(values, message):
    with pytest.raises(ValueError) as error:
        config(**values)
    assert message in str(error.value)


def test_the_extremes_are_allowed():
    settings = config(curriculum_easy_above=1.0, curriculum_hard_below=0.0, curriculum_set_aside_epochs=0)
    assert (settings.curriculum_easy_above, settings.curriculum_hard_below) == (1.0, 0.0)


def test_a_rollout_source_of_the_users_takes_no_curriculum():
    with pytest.raises(ValueError, match="a rollout_source generates nothing to steer"):
        make_source(config(curriculum_easy_above=1.0), [], None, None)


def test_a_checkpoint_without_the_curriculums_state_is_refused(tmp_path, caplog):
    (tmp_path / "with").mkdir()
    (tmp_path / "with" / CURRICULUM_FILE).write_text(json.dumps({"format": 1}))
    (tmp_path / "without").mkdir()
    checkpoints = RunCheckpoints.__new__(RunCheckpoints)  # only its generator is read
    checkpoints.generator = SimpleNamespace(curriculum=object())
    with pytest.raises(CheckpointError, match="written by a run without a curriculum"):
        checkpoints._curriculum_of(tmp_path / "without")
    assert checkpoints._curriculum_of(tmp_path / "with") == {"format": 1}
    checkpoints.generator = SimpleNamespace(curriculum=None)
    with caplog.at_level(logging.WARNING):
        assert checkpoints._curriculum_of(tmp_path / "with") is None
    assert "holds a curriculum's state; this run has none" in caplog.text


def test_tuning_a_curriculum_without_a_threshold_is_refused_by_name():
    from verifiers_rl.rollouts.curriculum import build_curriculum

    env = SimpleNamespace(name="toy")  # one environment (no entries), its rows its own
    with pytest.raises(ValueError, match=r"^--curriculum_window 3, --curriculum_set_aside_epochs 2 tunes the "
                       r"curriculum, which acts only with --curriculum_easy_above or --curriculum_hard_below"):
        build_curriculum(config(curriculum_window=3, curriculum_set_aside_epochs=2), env, [])
    assert build_curriculum(config(), env, []) is None  # nothing asked: no curriculum, no error
