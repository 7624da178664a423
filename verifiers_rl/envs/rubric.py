"""A Rubric scores a rollout with weighted reward functions; a function that fails is recorded, never silently 0."""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy

from verifiers_rl.envs.awaitable import maybe_await
from verifiers_rl.envs.messages import Messages
from verifiers_rl.envs.parsers import Parser

logger = logging.getLogger(__name__)

REWARD_INPUTS = ("prompt", "completion", "answer", "state", "info", "parser")
# Counted by our Rubric; a classic verifiers rubric catches its functions' errors itself and records none (0 there).
ERRORS_METRIC = "reward_errors"


@dataclass
class Score:
    """``reward`` is the weighted sum; ``metrics`` holds each function's value (0.0 where it failed) and
    ``reward_errors``, the number of functions that failed; ``errors`` maps a failed function to its error."""

    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class _RewardFunction:
    func: Callable[..., Any]
    weight: float
    name: str
    inputs: tuple[str, ...]


def _inputs(func: Callable[..., Any], name: str) -> tuple[str, ...]:
    """The inputs ``func`` receives by name; a parameter no call could fill is refused here, not at every rollout."""
    parameters = inspect.signature(func).parameters.values()
    by_position = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if by_position:
        raise TypeError(f"Rubric: reward function {name!r} takes {by_position} by position only; a rubric passes its "
                        "inputs by name: drop the '/' from its parameters.")
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    # Checked with **kwargs too: it receives the rubric's inputs, never another required parameter.
    unknown = [p.name for p in named if p.name not in REWARD_INPUTS and p.default is p.empty]
    if unknown:
        raise TypeError(
            f"Rubric: reward function {name!r} requires {unknown}, which a rubric cannot provide; "
            f"it may ask for any of {list(REWARD_INPUTS)}."
        )
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return REWARD_INPUTS
    return tuple(p.name for p in named if p.name in REWARD_INPUTS)


def _listed(values: Any, argument: str, what: str, one: str) -> list[Any]:
    """``values`` as a list, refused by name when it is one value (``Rubric(f)`` for ``Rubric([f])``) or a string."""
    if callable(values) or isinstance(values, (str, bytes, numbers.Number)) or not isinstance(values, Iterable):
        raise TypeError(f"Rubric: {argument} must be a list of {what}, got {type(values).__name__} {values!r:.60} "
                        f"(for one: {one}).")
    return list(values)


class Rubric:
    """Weighted reward functions, each a plain function or ``async def``.

    A function receives, by parameter name, any of ``prompt``, ``completion``, ``answer``, ``state``, ``info`` and
    ``parser`` (``**kwargs`` receives them all). It must return a finite number; raising or returning anything else
    is an error: recorded in ``Score.errors``, counted in the ``reward_errors`` metric, contributing 0. A plain one
    runs on the event loop, one at a time, holding up every rollout in flight while it runs: a slow one (a judge) is
    ``async def`` and awaits its slow part with ``envs.call_off_loop``.
    """

    def __init__(
        self,
        funcs: Sequence[Callable[..., Any]] = (),
        weights: Sequence[float] | None = None,
        parser: Parser | None = None,
    ):
        funcs = _listed(funcs, "funcs", "reward functions", "Rubric([f])")
        weights = None if weights is None else _listed(weights, "weights", "numbers", "weights=[1.0]")
        if weights is not None and len(weights) != len(funcs):
            raise ValueError(f"Rubric: {len(funcs)} reward functions but {len(weights)} weights.")
        self.parser = parser or Parser()
        self.functions: list[_RewardFunction] = []
        self._reported: set[str] = set()
        for index, func in enumerate(funcs):
            self.add(func, 1.0 if weights is None else weights[index])

    def add(self, func: Callable[..., Any], weight: float = 1.0) -> None:
        """Add a reward function; its ``__name__`` names its metric and must be unique in the rubric."""
        if not callable(func):
            raise TypeError(f"Rubric: reward functions must be callable, got {func!r}.")
        name = getattr(func, "__name__", type(func).__name__)
        if name == ERRORS_METRIC or any(f.name == name for f in self.functions):
            raise ValueError(f"Rubric: a reward function named {name!r} clashes with another metric of the same name.")
        if not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"Rubric: the weight of {name!r} must be a finite number, got {weight!r}.")
        self.functions.append(_RewardFunction(func, float(weight), name, _inputs(func, name)))

    async def score(self, prompt: Messages, completion: Messages, answer: Any, state: dict, info: dict) -> Score:
        """Run every reward function (in order) and combine their values."""
        available = {"prompt": prompt, "completion": completion, "answer": answer, "state": state, "info": info}
        available["parser"] = self.parser
        score = Score(reward=0.0)
        for function in self.functions:
            try:
                value = await maybe_await(function.func(**{name: available[name] for name in function.inputs}))
                if isinstance(value, numpy.bool_):  # np.isclose(...), a == b of numpy numbers: a bool as Python's
                    value = bool(value)
                if not isinstance(value, numbers.Real) or not math.isfinite(value):
                    raise TypeError(f"returned {value!r}, not a finite number")
            except Exception as error:  # noqa: BLE001 - recorded in the score and counted in a metric
                score.errors[function.name] = f"{type(error).__name__}: {error}"
                score.metrics[function.name] = 0.0
                self._report(function.name, score.errors[function.name])
                continue
            score.metrics[function.name] = float(value)
            score.reward += function.weight * float(value)
        score.metrics[ERRORS_METRIC] = float(len(score.errors))
        return score

    def _report(self, name: str, error: str) -> None:
        # Once per function: a broken function would otherwise log on every rollout; the metric keeps counting.
        if name not in self._reported:
            self._reported.add(name)
            logger.warning(
                "Reward function %r failed (%s); it scores 0, and failures are counted in the %r metric.",
                name,
                error,
                ERRORS_METRIC,
            )
