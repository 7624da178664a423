"""A difficulty curriculum's settings: the ``--curriculum_*`` flags, and a mixture entry's ``curriculum:`` mapping
that overrides them for that entry. The curriculum itself (pass rates, set-aside rows, the draws that skip them) is
``rollouts/curriculum.py``; the settings live here so that a mixture entry is checked where it is parsed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from verifiers_rl.core.choices import AT_LEAST_ONE, NON_NEGATIVE, Range, field_ranges
from verifiers_rl.core.errors import unknown_keys

# A pass rate is a fraction: easy at or above a level in (0, 1] (1: every rollout passed), hard at or below one in
# [0, 1) (0: none did). easy_above 0 or hard_below 1 would set every prompt aside.
EASY_RANGE = Range(0, strict=True, high=1)
HARD_RANGE = Range(0, high=1, strict_high=True)


@dataclass(frozen=True)
class CurriculumSettings:
    """When a prompt is set aside. Its pass rate is the mean, over its last ``window`` groups, of the fraction of a
    group's rollouts whose reward is >= ``pass_reward``; judged once it has ``window`` groups. A pass rate at or
    above ``easy_above`` (easy) or at or below ``hard_below`` (hard) sets the prompt aside for ``set_aside_epochs``
    epochs of its environment's rows (0: for good); None turns that side off."""

    # Ranges in the types, as RLConfig's --curriculum_* fields declare them (field_ranges reads both).
    window: Annotated[int, AT_LEAST_ONE] = field(default=1, metadata={"from": "curriculum_window"})
    pass_reward: float = field(default=1.0, metadata={"from": "curriculum_pass_reward"})
    easy_above: Annotated[float | None, EASY_RANGE] = field(default=None, metadata={"from": "curriculum_easy_above"})
    hard_below: Annotated[float | None, HARD_RANGE] = field(default=None, metadata={"from": "curriculum_hard_below"})
    set_aside_epochs: Annotated[int, NON_NEGATIVE] = field(default=1, metadata={"from": "curriculum_set_aside_epochs"})

    @property
    def active(self) -> bool:
        """Whether any prompt can be set aside (a threshold is set)."""
        return self.easy_above is not None or self.hard_below is not None

    def check(self, where: str = "", name=lambda key: f"--curriculum_{key}") -> None:
        """Raise ValueError naming the setting (``name(key)``, after ``where``) whose value cannot work."""
        ranges = field_ranges(CurriculumSettings)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            integer = f.name in ("window", "set_aside_epochs")
            optional = f.name in ("easy_above", "hard_below")
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or (
                    not integer and not math.isfinite(value)):
                kind = "an integer" if integer else "a finite number" + (" or null (off)" if optional else "")
                raise ValueError(f"{where}{name(f.name)} must be {kind}, got {value!r}.")
            if f.name in ranges:
                ranges[f.name].check(f"{where}{name(f.name)}", value)
        if self.easy_above is not None and self.hard_below is not None and not self.hard_below < self.easy_above:
            raise ValueError(f"{where}{name('hard_below')} ({self.hard_below:g}) must be below "
                             f"{name('easy_above')} ({self.easy_above:g}): a prompt cannot be both easy and hard.")

    def overridden(self, overrides: Mapping[str, Any], where: str) -> "CurriculumSettings":
        """These settings with a mixture entry's ``curriculum:`` ``overrides``, checked (``where`` names the entry)."""
        settings = dataclasses.replace(self, **check_overrides(overrides, where))
        settings.check(where, name=lambda key: f"curriculum.{key}")
        return settings


def check_overrides(overrides: Any, where: str) -> dict[str, Any]:
    """A mixture entry's ``curriculum:`` mapping, its keys known and each value in range (``where`` names the entry;
    whether hard_below < easy_above holds is checked once the run's flags are merged in: ``overridden``)."""
    keys = [f.name for f in dataclasses.fields(CurriculumSettings)]
    if not isinstance(overrides, Mapping):
        raise ValueError(f"{where}\"curriculum\" must be a mapping of {', '.join(keys)}, got {overrides!r}.")
    refusal = unknown_keys(overrides, keys, f"{where}\"curriculum\"", f"it takes {', '.join(keys)} (each overrides "
                           "the --curriculum_ flag of that name for this entry).")
    if refusal:
        raise ValueError(refusal)
    alone = dataclasses.replace(CurriculumSettings(), **overrides)
    alone.check(where, name=lambda key: f"curriculum.{key}")
    return dict(overrides)
