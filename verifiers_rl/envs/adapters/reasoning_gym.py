"""reasoning-gym (PyPI ``reasoning-gym``): procedural, verifiable tasks generated offline, as a ``SingleTurnEnv``.

``--env reasoning_gym:leg_counting`` trains on one task, ``--env reasoning_gym:leg_counting,mini_sudoku`` (or
``leg_counting=3,mini_sudoku=1`` for weights) on a weighted mix. The model answers inside ``<answer>...</answer>``;
the answer is scored with the task's own ``score_answer`` (a reply without the tag scores 0). ``format_weight``
adds reward for the tag itself (default 0: only logged, as the ``format_reward`` metric).

Rows: the task generator (reasoning-gym's ``composite`` for a mix) with ``size + eval_size`` items from ``seed``;
the first ``size`` are the training rows, the rest the held-out ``eval_dataset`` minus any whose question also
appears among the training rows (small task spaces repeat questions). These are the rows verifiers'
``ReasoningGymEnv(gym, num_train_examples=size, num_eval_examples=eval_size, seed=seed)`` uses.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from verifiers_rl.envs.messages import Messages
from verifiers_rl.envs.parsers import XMLParser
from verifiers_rl.envs.rubric import Rubric
from verifiers_rl.envs.singleturn import SingleTurnEnv

INSTALL = 'pip install -e ".[reasoning-gym]"  (or: pip install reasoning-gym==0.1.25)'


def _reasoning_gym():
    try:
        import reasoning_gym
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"reasoning-gym environments need the optional extra [reasoning-gym]: {INSTALL}"
        ) from error
    return reasoning_gym


def parse_tasks(tasks: str | Sequence[str] | Mapping[str, float]) -> dict[str, float]:
    """``"a"``, ``"a,b"``, ``"a=2,b=1"``, a list of names or a {name: weight} dict, as {name: weight}."""
    if isinstance(tasks, Mapping):
        weights = {str(name): float(weight) for name, weight in tasks.items()}
    else:
        parts = tasks.split(",") if isinstance(tasks, str) else list(tasks)
        weights = {}
        for part in (p.strip() for p in parts):
            name, _, weight = part.partition("=")
            if name.strip() in weights:  # a second weight would silently replace the first
                raise ValueError(f"reasoning_gym: task {name.strip()!r} is named twice in {tasks!r}; name it once, "
                                 "with its weight (task=w).")
            try:
                weights[name.strip()] = float(weight) if weight else 1.0
            except ValueError:
                raise ValueError(f"reasoning_gym: the weight of {name!r} must be a number, got {weight!r}.") from None
    if not weights or "" in weights:
        raise ValueError(f"reasoning_gym: name at least one task, e.g. reasoning_gym:leg_counting (got {tasks!r}).")
    bad = [name for name, weight in weights.items() if not 0 < weight < math.inf]
    if bad:
        raise ValueError(f"reasoning_gym: task weights must be finite numbers > 0; {bad} are not.")
    return weights


def check_task_names(names: Sequence[str]) -> None:
    """Raise ValueError for a name reasoning-gym does not know, listing the close ones."""
    from reasoning_gym.factory import DATASETS

    for name in names:
        if name not in DATASETS or name == "composite":
            close = difflib.get_close_matches(name, [n for n in DATASETS if n != "composite"], n=5, cutoff=0.5)
            hint = f"close names: {', '.join(close)}" if close else "no close name"
            raise ValueError(
                f"reasoning-gym has no task {name!r} ({hint}); the {len(DATASETS) - 1} tasks are the keys of "
                "reasoning_gym.factory.DATASETS."
            )


def build_dataset(weights: dict[str, float], size: int, seed: int, config: Mapping[str, Any] | None):
    """The reasoning-gym dataset of ``size`` items: the task itself, or a ``composite`` for several."""
    rg = _reasoning_gym()
    check_task_names(list(weights))
    config = dict(config or {})
    if len(weights) > 1:
        unknown = sorted(set(config) - set(weights))
        if unknown:
            raise ValueError(
                f"reasoning_gym: for a mix, 'config' maps task names to their settings; {unknown} are not among the "
                f"tasks {list(weights)}."
            )
    try:
        if len(weights) == 1:
            return rg.create_dataset(next(iter(weights)), size=size, seed=seed, **config)
        from reasoning_gym.composite import DatasetSpec

        specs = [DatasetSpec(name=n, weight=w, config=dict(config.get(n, {}))) for n, w in weights.items()]
        return rg.create_dataset("composite", size=size, seed=seed, datasets=specs)
    except (TypeError, AssertionError, ValueError) as error:  # the task's config dataclass and its validate()
        raise ValueError(f"reasoning_gym {list(weights)}: bad size/seed/config {config}: {error}") from error


def reasoning_gym_score(dataset, entries: list[dict[str, Any]]):
    """The reward function: the task's ``score_answer`` of the ``<answer>`` in the reply (0 without one)."""

    def reasoning_gym_score(completion: Messages, info: dict, parser: XMLParser) -> float:
        answer = parser.parse_answer(completion)
        if answer is None:
            return 0.0
        return float(dataset.score_answer(answer, entries[info["reasoning_gym_index"]]))

    return reasoning_gym_score


def load_environment(
    *,
    tokenizer: Any,
    tasks: str | Sequence[str] | Mapping[str, float],
    size: int = 1000,
    eval_size: int = 100,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
    system_prompt: str | None = None,
    format_weight: float = 0.0,
    max_new_tokens: int = 256,
    max_seq_len: int = 1024,
    **kwargs: Any,
) -> SingleTurnEnv:
    """reasoning-gym ``tasks`` as a SingleTurnEnv (see the module docstring).

    ``config`` goes to the task's generator (for a mix: ``{task: {...}}``); ``system_prompt`` defaults to
    reasoning-gym's own ``SYSTEM_PROMPTS["default"]`` (think, then ``<answer>...</answer>``). Extra keyword
    arguments go to ``SingleTurnEnv``.
    """
    if size < 1 or eval_size < 0:
        raise ValueError(f"reasoning_gym: need size >= 1 and eval_size >= 0, got {size} and {eval_size}.")
    weights = parse_tasks(tasks)
    dataset = build_dataset(weights, size + eval_size, seed, config)
    entries = list(dataset)

    def row(index: int) -> dict[str, Any]:
        entry = entries[index]
        task = entry.get("metadata", {}).get("source_dataset", next(iter(weights)))
        return {"question": entry["question"], "answer": entry["answer"],
                "info": {"reasoning_gym_index": index, "task": task}}

    train = [row(i) for i in range(size)]
    seen = {r["question"] for r in train}
    held_out = [row(i) for i in range(size, len(entries)) if entries[i]["question"] not in seen]
    parser = XMLParser(fields=("answer",))
    rubric = Rubric([reasoning_gym_score(dataset, entries), parser.format_reward], weights=[1.0, format_weight],
                    parser=parser)
    if system_prompt is None:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        system_prompt = SYSTEM_PROMPTS["default"]
    return SingleTurnEnv(
        train,
        rubric,
        tokenizer,
        system_prompt=system_prompt,
        max_new_tokens=max_new_tokens,
        max_seq_len=max_seq_len,
        name="reasoning_gym:" + ",".join(weights),
        eval_dataset=held_out,
        **kwargs,
    )
