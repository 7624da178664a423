"""The choices and checks the config shares with the trainer, the loss and the engines.

They live below all of them, so the config never imports the training side (which imports the config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, NamedTuple, get_args, get_type_hints

# The choices, as types (RLConfig's fields use them, so the CLI lists them) and as tuples.
# LossType, ImportanceSamplingLevel, CorrectionMode: each name is also a function in training/loss.py (Registry).
LossType = Literal["grpo", "dr_grpo", "token_mean", "seq_mean_token_sum"]
ImportanceSamplingLevel = Literal["token", "sequence"]
CorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"]
SequenceLogRatio = Literal["mean", "sum"]
# The corrections whose ratio is per sequence (their level in training/loss.py; a test keeps the two equal).
SEQUENCE_CORRECTIONS = ("sequence_truncate", "sequence_mask")
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
ScaleRewards = Literal["group", "batch", "none"]
RewardAggregation = Literal["sum_then_normalize", "normalize_then_sum"]  # TRL's multi_objective_aggregation
OverlongPolicy = Literal["error", "truncate"]
MicroBatchingMode = Literal["padded", "packed"]
SharePromptTraining = Literal["auto", "on", "off"]


class Registered(NamedTuple):
    """One registered function and the options it was registered with."""

    function: Callable
    options: dict


class Registry:
    """The functions behind one of the config's choices, by name: ``@registry.register(name, **options)`` adds one,
    ``get(name)`` finds it (or raises ValueError naming ``flag``); dispatch reads the registry, never the names.

    The config lists the built-in names as a ``Literal`` (``choices``; it reads them without importing the functions,
    which live above it), so a built-in is its ``Literal`` name here plus its decorated function; the module that
    defines the functions calls ``check_builtins()`` once they are registered, so a name without its function (or the
    reverse) fails at import. A name registered later (a user's own) works wherever the functions are called by name,
    not as a config value.
    """

    def __init__(self, flag: str, choices: Any) -> None:
        self.flag = flag
        self.choices: tuple[str, ...] = get_args(choices)
        self._entries: dict[str, Registered] = {}

    def register(self, name: str, **options) -> Callable[[Callable], Callable]:
        """Decorator: register the function as ``name`` (returned unchanged, so one function can take several names)."""
        def decorate(function: Callable) -> Callable:
            if name in self._entries:
                raise ValueError(f"{self.flag} {name!r} is already registered "
                                 f"({self._entries[name].function.__qualname__}); unregister it first.")
            self._entries[name] = Registered(function, options)
            return function
        return decorate

    def unregister(self, name: str) -> None:
        """Remove a name registered after the built-ins (a built-in stays: the config offers it)."""
        if name in self.choices:
            raise ValueError(f"{self.flag} {name!r} is built in (one of the config's choices); it cannot be removed.")
        self.get(name)
        del self._entries[name]

    def get(self, name: str) -> Registered:
        """The function registered as ``name``; ValueError naming the flag and the registered names otherwise."""
        if name not in self._entries:
            check_choice(self.flag, name, self.names)
        return self._entries[name]

    @property
    def names(self) -> tuple[str, ...]:
        """The registered names: the config's choices in their order, then any registered later."""
        return (*[name for name in self.choices if name in self._entries],
                *[name for name in self._entries if name not in self.choices])

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def check_builtins(self) -> None:
        """Raise RuntimeError unless the registered names are exactly the config's choices (call after the built-ins
        are registered, before any other)."""
        missing = [name for name in self.choices if name not in self._entries]
        extra = [name for name in self._entries if name not in self.choices]
        if missing or extra:
            raise RuntimeError(
                f"{self.flag}: the config's choices (core/choices.py) and the registered functions differ: "
                f"no function for {missing}, not a choice: {extra}. A built-in needs both."
            )


@dataclass(frozen=True)
class Range:
    """A numeric field's allowed values: ``>= low`` (``> low`` when ``strict``) and ``<= high`` (when given; ``< high``
    when ``strict_high``), or one of ``also``. ``None`` passes (an optional field left unset). A field declares it in its type,
    ``name: Annotated[float, POSITIVE] = field(...)`` (``field_ranges`` reads it; argument parsers see ``float``)."""

    low: float
    strict: bool = False
    also: tuple = ()
    high: float | None = None
    strict_high: bool = False

    def check(self, name: str, value) -> None:
        """Raise ValueError naming the flag ``name`` unless ``value`` is allowed."""
        if value is None or value in self.also:
            return
        if not (value > self.low or (value == self.low and not self.strict)):
            raise ValueError(f"{name} must be {self._lowest()}, got {value}.")
        if self.high is not None and (value > self.high or (value == self.high and self.strict_high)):
            raise ValueError(f"{name} must be {self._highest()}, got {value}.")

    def _lowest(self) -> str:
        return " or ".join([str(v) for v in self.also] + [f"{'>' if self.strict else '>='} {self.low:g}"])

    def _highest(self) -> str:
        return f"{'<' if self.strict_high else '<='} {self.high:g}"

    def __str__(self) -> str:
        return self._lowest() + (f" and {self._highest()}" if self.high is not None else "")


AT_LEAST_ONE, NON_NEGATIVE, POSITIVE = Range(1), Range(0), Range(0, strict=True)


def field_ranges(cls: type) -> dict[str, Range]:
    """The ``Range`` of every field of the dataclass ``cls`` whose type is ``Annotated[..., Range]``."""
    hints = get_type_hints(cls, include_extras=True)
    out = {}
    for f in fields(cls):
        found = [extra for extra in getattr(hints[f.name], "__metadata__", ()) if isinstance(extra, Range)]
        if found:
            out[f.name] = found[0]
    return out


def check_choice(name: str, value, choices: tuple) -> None:
    """Raise ValueError naming the flag ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"Unknown {name} {value!r}; expected one of {', '.join(map(str, choices))}.")


def packed_row_fits(max_tokens_per_microbatch: int, max_seq_len: int) -> bool:
    """Whether a packed row holds the longest sequence."""
    return max_tokens_per_microbatch >= max_seq_len


def check_packed_row_fits(max_tokens_per_microbatch: int, max_seq_len: int) -> None:
    """A packed row must hold the longest sequence."""
    if not packed_row_fits(max_tokens_per_microbatch, max_seq_len):
        raise ValueError(
            f"max_tokens_per_microbatch ({max_tokens_per_microbatch}) must be >= max_seq_len ({max_seq_len}) so "
            "every sequence fits a packed row."
        )


RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                            "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                            "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs")


def check_chat_template_kwargs(kwargs: Any, flag: str = "chat_template_kwargs") -> dict[str, Any]:
    """``kwargs`` as the dict every chat template is rendered with (None: none); raises ValueError naming ``flag``
    for anything but a dict of string keys, or a key the renderers set themselves (``RESERVED_TEMPLATE_KWARGS``)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise ValueError(f"{flag} must be a dict of template variables (a JSON object on the command line), "
                         f"got {kwargs!r}.")
    reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"{flag}: {reserved} are set by the environment's rendering itself, not template variables "
                         "it can pass on; give only the variables the chat template reads (e.g. enable_thinking).")
    return dict(kwargs)
