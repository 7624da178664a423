"""Rubric: weighting, inputs by parameter name, sync and async functions, failures recorded and counted."""

import asyncio
import math

import pytest

from verifiers_rl.envs import Parser, Rubric

PROMPT = [{"role": "user", "content": "q"}]
COMPLETION = [{"role": "assistant", "content": " 42 "}]


def score(rubric, answer="42", state=None, info=None):
    return asyncio.run(rubric.score(PROMPT, COMPLETION, answer, state or {}, info or {"level": 3}))


def test_weighted_sum_of_sync_and_async_functions():
    def exact(completion, answer, parser):
        return float(parser.parse_answer(completion) == answer)

    async def level(info):
        await asyncio.sleep(0)
        return info["level"]

    result = score(Rubric([exact, level], weights=[2.0, 0.5]))
    assert result.reward == 2.0 * 1.0 + 0.5 * 3
    assert result.metrics == {"exact": 1.0, "level": 3.0, "reward_errors": 0.0}
    assert result.errors == {}


def test_inputs_are_passed_by_name_and_kwargs_get_everything():
    seen = {}

    def only_answer(answer):
        seen["only_answer"] = answer
        return 0.0

    def everything(**kwargs):
        seen["everything"] = sorted(kwargs)
        return 0.0

    parser = Parser()
    rubric = Rubric([only_answer, everything], parser=parser)
    score(rubric, answer="x")
    assert seen == {"only_answer": "x", "everything": ["answer", "completion", "info", "parser", "prompt", "state"]}


def test_failures_are_recorded_counted_and_score_zero(caplog):
    def good():
        return 1.0

    def broken(completion):
        raise KeyError("missing")

    async def not_a_number():
        return "1.0"

    def nan():
        return math.nan

    result = score(Rubric([good, broken, not_a_number, nan], weights=[1.0, 5.0, 5.0, 5.0]))
    assert result.reward == 1.0
    assert result.errors == {
        "broken": "KeyError: 'missing'",
        "not_a_number": "TypeError: returned '1.0', not a finite number",
        "nan": "TypeError: returned nan, not a finite number",
    }
    assert result.metrics["reward_errors"] == 3.0
    assert result.metrics["broken"] == 0.0
    assert "'broken' failed" in caplog.text


def test_bool_and_int_results_are_numbers():
    result = score(Rubric([lambda answer: answer == "42"]))
    assert result.reward == 1.0 and result.errors == {}


def test_numpy_scalars_are_numbers_as_pythons_are():
    import numpy as np

    def close(answer):  # np.isclose returns numpy's bool, as a comparison of numpy numbers does
        return np.isclose(float(answer), 42.0)

    def half(answer):
        return np.float32(0.5)

    result = score(Rubric([close, half]))
    assert result.reward == 1.5 and result.errors == {} and result.metrics["close"] == 1.0


def test_construction_errors_name_the_problem():
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        Rubric([lambda: 0, lambda: 0], weights=[1.0])
    with pytest.raises(TypeError, match=r"'needs_x' requires \['x'\]"):

        def needs_x(x, completion):
            return 0.0

        Rubric([needs_x])

    def needs_y(completion, y, **kwargs):  # **kwargs receives the rubric's inputs, never y
        return 0.0

    with pytest.raises(TypeError, match=r"'needs_y' requires \['y'\], which a rubric cannot provide"):
        Rubric([needs_y])

    def positional(completion, /):  # inputs are passed by name
        return 0.0

    with pytest.raises(TypeError, match=r"'positional' takes \['completion'\] by position only; .* by name"):
        Rubric([positional])

    def dup():
        return 0.0

    with pytest.raises(ValueError, match="'dup' clashes"):
        Rubric([dup, dup])


def test_one_function_or_one_weight_for_a_list_is_refused_by_name():
    # Rubric(correct) said "'function' object is not iterable", Rubric(["correct"]) iterated the name's letters, and
    # weights=2.0 said "object of type 'float' has no len()".
    def correct(completion):
        return 1.0

    with pytest.raises(TypeError, match=r"^Rubric: funcs must be a list of reward functions, got function .*"
                                        r"\(for one: Rubric\(\[f\]\)\)"):
        Rubric(correct)
    with pytest.raises(TypeError, match=r"^Rubric: funcs must be a list of reward functions, got str 'correct'"):
        Rubric("correct")
    with pytest.raises(TypeError, match=r"^Rubric: weights must be a list of numbers, got float 2.0"):
        Rubric([correct], weights=2.0)
    rubric = Rubric(f for f in [correct])  # any iterable of functions: taken
    assert [(f.name, f.weight) for f in rubric.functions] == [("correct", 1.0)]
