"""One builder from the config to each part's settings dataclass (batching, loss, sampling, the vLLM client, eval).

A settings field takes the config field of the same name, or the one its metadata names once, beside the field:
``field(default=..., metadata={"from": "importance_cap"})``. What the config alone cannot give (the world size, a
model's attention kernel, TRL's resolved ``epsilon_high``) the caller passes by name. A settings field with neither
is refused by name, so a knob can no longer be dropped on its way to the part that uses it.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

SOURCE = "from"  # the metadata key naming a settings field's config field

S = TypeVar("S")


def source_of(settings_field) -> str:
    """The config field a settings dataclass field is filled from: its ``"from"`` metadata, else its own name."""
    return settings_field.metadata.get(SOURCE, settings_field.name)


def settings_from(config: Any, cls: type[S], **given: Any) -> S:
    """``cls`` (a dataclass) filled from ``config`` (a dataclass: ``RLConfig``): each field from the config field
    ``source_of`` names, or from ``given`` (which wins: values the caller derives). Raises TypeError naming a settings
    field with no source, or a ``given`` name ``cls`` does not have."""
    config_fields = {f.name for f in fields(config)}  # fields only: a property of the same name is no source
    unknown = sorted(set(given) - {f.name for f in fields(cls) if f.init})
    if unknown:
        raise TypeError(f"settings_from({cls.__name__}): {cls.__name__} has no field {', '.join(unknown)}.")
    values = {}
    for f in fields(cls):
        if not f.init:
            continue
        if f.name in given:
            values[f.name] = given[f.name]
        elif source_of(f) in config_fields:
            values[f.name] = getattr(config, source_of(f))
        else:
            raise TypeError(
                f"{cls.__name__}.{f.name} has no source: {type(config).__name__} has no field {source_of(f)!r}. "
                f"Name its config field in the field's metadata ({{{SOURCE!r}: 'config_field'}}) or pass it to "
                "settings_from by name."
            )
    return cls(**values)


def keywords(settings: Any) -> dict[str, Any]:
    """A settings dataclass as keyword arguments (shallow: a dict field stays the same object)."""
    return {f.name: getattr(settings, f.name) for f in fields(settings) if f.init}
