"""Built-in environments and load_environment."""

import asyncio
import importlib.util
import json
import operator
import sys
import threading
from fractions import Fraction

import pytest

from verifiers_rl.core.errors import raised_at, read_yaml
from verifiers_rl.envs import BUILTINS, MathChecker, SingleTurnEnv, ToolEnv, load_environment
from verifiers_rl.envs.loading import load_with_args
from verifiers_rl.envs.builtin.calculator import calculate

from .scripted import ScriptedSampler

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def score(env, text, answer):
    completion = [{"role": "assistant", "content": text}]
    return asyncio.run(env.rubric.score(env.dataset[0].prompt, completion, answer, {}, {}))


def test_reverse_text_dataset_is_procedural_and_reward_gives_partial_credit(tokenizer):
    env = load_environment("reverse_text", tokenizer=tokenizer, num_examples=50, seed=3)
    assert isinstance(env, SingleTurnEnv) and env.name == "reverse_text" and len(env.dataset) == 50
    questions = [row.prompt[-1]["content"] for row in env.dataset]
    assert all(3 <= len(q) <= 8 and q.isalpha() and row.answer == q[::-1] for q, row in zip(questions, env.dataset))
    again = load_environment("reverse_text", tokenizer=tokenizer, num_examples=50, seed=3)
    assert [row.prompt for row in again.dataset] == [row.prompt for row in env.dataset]

    assert score(env, " olleh\n", "olleh").reward == 1.0
    assert score(env, "olleH", "olleh").reward == pytest.approx(0.8)  # one substitution in five
    assert score(env, "oleh", "olleh").reward == pytest.approx(0.8)  # one deletion
    assert score(env, "hello", "olleh").reward == pytest.approx(0.2)
    assert score(env, "", "olleh").reward == 0.0


def test_reverse_text_rollout_is_short_and_scored(tokenizer):
    env = load_environment("reverse_text", tokenizer=tokenizer, num_examples=1)
    row = env.dataset[0]
    reply = tokenizer.encode(row.answer[:-1], add_special_tokens=False) + [tokenizer.eos_token_id]
    rollout = asyncio.run(env.rollout(ScriptedSampler([reply]), row, 0))
    assert rollout.reward == pytest.approx(1 - 1 / len(row.answer))
    assert env.max_new_tokens <= 16 and len(rollout.prompt_ids) + env.max_new_tokens <= env.max_seq_len


def test_arithmetic_dataset_answers_are_right(tokenizer):
    env = load_environment("arithmetic", tokenizer=tokenizer, num_examples=40, seed=1)
    for row in env.dataset:
        a, symbol, b = row.prompt[-1]["content"].removeprefix("What is ").removesuffix("?").split()
        assert Fraction(row.answer) == OPERATIONS[symbol](Fraction(a), Fraction(b))
    assert "\\boxed{}" in env.dataset[0].prompt[0]["content"]


def test_arithmetic_reward_uses_math_verify(tokenizer):
    env = load_environment("arithmetic", tokenizer=tokenizer, num_examples=1)
    assert score(env, "so \\boxed{0.5}", "1/2").reward == 1.0
    assert score(env, "\\boxed{\\frac{2}{4}}", "1/2").reward == 1.0
    assert score(env, "\\boxed{0.6}", "1/2").reward == 0.0
    assert score(env, "0.5, no box", "1/2").reward == 0.0
    result = score(env, "\\boxed{-3}", "-3")
    assert result.reward == 1.0 and result.metrics["reward_errors"] == 0.0
    assert score(env, "\\boxed{1}", None).errors == {
        "correct_answer": "ValueError: the dataset row has no answer to compare with"
    }

    # Environments run on the generator's thread, where math-verify's own (signal-based) timeout would fail.
    results = []
    thread = threading.Thread(target=lambda: results.append(score(env, "\\boxed{0.5}", "1/2")))
    thread.start()
    thread.join()
    assert results[0].reward == 1.0 and results[0].errors == {}


def test_math_checker_restarts_its_worker_after_a_hang():
    async def check():
        checker = MathChecker(timeout_s=1.0)
        with pytest.raises(TimeoutError, match="math-verify took over 1 s to compare '9\\^\\{9\\^\\{9\\}\\}' with '7'"):
            await checker.equal("7", "9^{9^{9}}")
        return await checker.equal("7", "7.0")

    assert asyncio.run(check()) is True


def test_math_checker_compares_in_parallel_workers():
    """A batch's answers are checked by a pool of worker processes at once, not one after another through one."""
    checker = MathChecker(timeout_s=30.0, workers=3)
    barrier = threading.Barrier(3, timeout=60)
    for worker in checker._pool:
        # Each request, holding its worker, waits for the other two: only with three workers at once do all meet
        # (one worker, or a lock around the pool, breaks the barrier).
        original = worker.request
        worker.request = lambda *args, _original=original: (barrier.wait(), _original(*args))[1]

    async def check():
        return await asyncio.gather(*(checker.equal(gold, answer) for gold, answer in
                                      (("1/2", "0.5"), ("3", "4"), ("x+1", "1+x"))))

    try:
        assert asyncio.run(check()) == [True, False, True]
        assert len({worker.process.pid for worker in checker._pool}) == 3
    finally:
        checker.close()


def test_calculator_tool_is_safe():
    assert calculate("(12 + 7) * 3") == "57" and calculate("12 / 4") == "3" and calculate("7 / 2") == "3.5"
    with pytest.raises(ValueError, match="unsupported syntax"):
        calculate("__import__('os').system('true')")
    with pytest.raises(ValueError, match="more than 1000 digits"):
        calculate("9 ** 9 ** 9")
    with pytest.raises(ZeroDivisionError):
        calculate("1 / 0")


def test_calculator_environment_loads_with_a_tool_template(tool_tokenizer):
    env = load_environment("calculator", tokenizer=tool_tokenizer, num_examples=3)
    assert isinstance(env, ToolEnv) and env.tools == {"calculate": calculate} and len(env.dataset) == 3
    a, _, b, symbol, c = env.dataset[0].prompt[-1]["content"].removeprefix("What is ").removesuffix("?").split()
    assert int(env.dataset[0].answer) == int(a) * int(b) + (int(c) if symbol == "+" else -int(c))


def test_load_environment_from_module_function_and_file(tokenizer, tmp_path, monkeypatch):
    source = (
        "from verifiers_rl.envs import Rubric, SingleTurnEnv\n"
        "def load_environment(tokenizer, word='hi'):\n"
        "    return SingleTurnEnv([{'question': word}], Rubric(), tokenizer, name='custom')\n"
        "def not_an_env(**kwargs):\n"
        "    return 42\n"
    )
    (tmp_path / "my_custom_env.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("my_custom_env:load_environment", tokenizer=tokenizer, word="yo")
    assert env.name == "custom" and env.dataset[0].prompt[-1]["content"] == "yo"
    env = load_environment(str(tmp_path / "my_custom_env.py"), tokenizer=tokenizer)
    assert env.dataset[0].prompt[-1]["content"] == "hi"

    with pytest.raises(TypeError, match="returned a int, which is neither a verifiers_rl Environment .* nor a classic "
                                        "verifiers environment"):
        load_environment("my_custom_env:not_an_env")
    with pytest.raises(ValueError, match="module 'my_custom_env' has no 'missing'"):
        load_environment("my_custom_env:missing")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_environment("no_such_module_xyz:load_environment")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_environment(str(tmp_path / "absent.py"))


def test_an_environment_file_imports_the_modules_beside_it_and_a_module_loads_from_the_working_directory(
        tokenizer, tmp_path, monkeypatch):
    (tmp_path / "sibling_helpers.py").write_text("WORD = 'beside'\n")
    (tmp_path / "sibling_env.py").write_text(
        "from sibling_helpers import WORD\n"
        "from verifiers_rl.envs import Rubric, SingleTurnEnv\n"
        "def load_environment(tokenizer):\n"
        "    return SingleTurnEnv([{'question': WORD}], Rubric(), tokenizer, name='sibling')\n")
    folder = str(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in (folder, "", ".")])
    monkeypatch.delitem(sys.modules, "sibling_helpers", raising=False)
    assert load_environment(str(tmp_path / "sibling_env.py"), tokenizer=tokenizer).dataset[0].prompt[-1]["content"] \
        == "beside"  # as `python sibling_env.py` would import it
    # A console script (verifiers-rl) leaves the working directory off sys.path; `python -m` would find it there.
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in (folder, "", ".")])
    monkeypatch.delitem(sys.modules, "sibling_env", raising=False)
    monkeypatch.chdir(tmp_path)
    env = load_environment("sibling_env:load_environment", tokenizer=tokenizer)
    assert env.name == "sibling"
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_environment("no_such_module_xyz:load_environment")


def test_env_args_named_like_load_environments_own_parameters_reach_the_loader(tokenizer, tmp_path):
    (tmp_path / "keyed_env.py").write_text(
        "from verifiers_rl.envs import Rubric, SingleTurnEnv\n"
        "def load_environment(tokenizer, spec, tool_mode):\n"
        "    return SingleTurnEnv([{'question': spec + tool_mode}], Rubric(), tokenizer, name='keyed')\n")
    env = load_with_args(str(tmp_path / "keyed_env.py"), tokenizer, env_args={"spec": "a", "tool_mode": "b"})
    assert env.dataset[0].prompt[-1]["content"] == "ab"
    with pytest.raises(ValueError, match="'tokenizer' cannot be one of its arguments"):
        load_with_args(str(tmp_path / "keyed_env.py"), tokenizer, env_args={"tokenizer": "gpt2"})


def test_where_an_error_was_raised_is_the_users_line_not_the_libraries(tmp_path):
    (tmp_path / "calls_json.py").write_text("import json\ndef load():\n    return json.loads('{')\n")
    spec = importlib.util.spec_from_file_location("calls_json", tmp_path / "calls_json.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(json.JSONDecodeError) as raised:
        module.load()
    assert raised_at(raised.value) == f"{(tmp_path / 'calls_json.py').resolve()}:3"  # not json/decoder.py's line
    with pytest.raises(ValueError) as ours:
        read_yaml(str(tmp_path / "absent.yaml"), "--config")
    assert raised_at(ours.value) is None  # verifiers_rl's own message says what to change


def test_unknown_environment_lists_the_builtins():
    with pytest.raises(
        ValueError, match="Unknown environment 'gsm9k'. Built-ins: reverse_text, arithmetic, calculator"
    ):
        load_environment("gsm9k")
    assert set(BUILTINS) == {"reverse_text", "arithmetic", "calculator"}


def test_an_argument_the_loader_does_not_take_is_named(tokenizer, tmp_path):
    # reverse_text passes extra keywords on to SingleTurnEnv, which refuses this one: the error names it either way.
    with pytest.raises(ValueError, match="Environment 'reverse_text' takes no argument 'num_exampels' .*--env_args"):
        load_environment("reverse_text", tokenizer=tokenizer, num_exampels=10)
    # A TypeError of the loader's own (not an unknown keyword) is left as it is.
    (tmp_path / "typed_env.py").write_text("def load_environment(tokenizer, size=1):\n    return [0] * None\n")
    with pytest.raises(TypeError, match="can't multiply sequence"):
        load_environment(str(tmp_path / "typed_env.py"), tokenizer=tokenizer, size=2)
