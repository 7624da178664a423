"""A number's range is declared once, in its field's type (``Annotated[int, AT_LEAST_ONE]``; ``INHERITED_RANGES`` for
GRPOConfig's fields): validate refuses a value outside it by name, and --help and docs/config.md show it."""

from __future__ import annotations

import pytest

from verifiers_rl.cli.sections import SectionedParser, markdown
from verifiers_rl.config.rl_config import INHERITED_RANGES, RLConfig, config_ranges


def outside(allowed) -> list:
    """Values just outside ``allowed`` (below it, and above it when it has a top)."""
    below = allowed.low if allowed.strict else allowed.low - 1
    while below in allowed.also:
        below -= 1
    return [below] + ([allowed.high + 1] if allowed.high is not None else [])


def test_every_range_is_checked_by_validate_with_the_fields_name():
    ranges = config_ranges()
    assert set(INHERITED_RANGES) < set(ranges) and len(ranges) > len(INHERITED_RANGES)  # ours come from their types
    assert "importance_cap" in ranges and "importance_cap" not in INHERITED_RANGES
    built = RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True)
    for name, allowed in ranges.items():
        for value in outside(allowed):
            good, _ = getattr(built, name), setattr(built, name, value)
            with pytest.raises(ValueError, match=rf"^{name} must be"):
                built.validate()
            setattr(built, name, good)
    with pytest.raises(ValueError, match=r"^beta must be >= 0, got -0.1"):  # a KL coefficient (TRL takes it)
        RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, beta=-0.1)
    with pytest.raises(ValueError, match=r"^rollouts_per_step must be >= 1, got 0"):  # __post_init__ checks too
        RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, rollouts_per_step=0)


def test_help_and_docs_show_the_range_validate_checks():
    parser = SectionedParser(RLConfig)
    helps = {action.dest: action.help for action in parser._actions}
    docs = markdown()
    for name, allowed in config_ranges().items():
        assert helps[name].endswith(f"Range: {allowed}."), name
    assert "| `max_failed_rollouts_fraction` | `0.0` |  | >= 0 and <= 1 |" in docs
    assert "| `weight_sync_probe_tokens` | `32` |  | 0 or >= 2 |" in docs


@pytest.mark.parametrize("name", ["learning_rate", "max_grad_norm", "weight_decay"])
def test_an_optimizer_setting_below_zero_or_nan_is_refused(name):
    # TrainingArguments took them: a negative learning rate ascended the loss, a NaN one made every weight NaN, a
    # negative max_grad_norm turned clipping off without a word.
    for value in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=rf"^{name} must be >= 0, got {value}"):
            RLConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, **{name: value})
