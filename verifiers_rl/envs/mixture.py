"""Several environments in one run: a weighted mixture (``--env '[{"env": ..., "weight": ...}, ...]'`` or a YAML list).

Each entry is one environment with its own loader arguments, limits and sampling weight. ``MixtureEnv`` holds the
loaded entries: its dataset is their rows (each row knows its entry), a group is one row of one entry (so reward
scaling never mixes environments), and every rollout carries its entry's name (``Rollout.env``), which the per-
environment metrics and evaluation group by.

Draws: the entry of the group at position p is drawn by weight from ``derive_seed(seed, "mixture", p)``; within an
entry, rows come in that entry's own seeded shuffle, epoch after epoch. Both are functions of the seed and the
position alone, so a run and its resume draw the same sequence.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verifiers_rl.core.curriculum import check_overrides
from verifiers_rl.core.errors import raised_at, read_yaml, unknown_keys
from verifiers_rl.core.rollout import Rollout
from verifiers_rl.core.sampling import Sampler, derive_seed
from verifiers_rl.envs.environment import Environment, Row, Trajectory
from verifiers_rl.envs.messages import Messages

logger = logging.getLogger(__name__)

ENTRY_KEYS = ("env", "weight", "env_args", "name", "curriculum")
YAML_SUFFIXES = (".yaml", ".yml")


class MixtureError(ValueError):
    """A mixture entry that cannot be used; the message names the flag and the entry."""


def steering_keys(entries: list["MixtureEntry"]) -> list[str]:
    """The keys among ``entries`` that steer only training's draws (a weight other than 1, a curriculum): evaluation
    rolls out every entry's held-out rows, so there they would change nothing."""
    return sorted({key for entry in entries for key in ("weight", "curriculum")
                   if (key == "curriculum" and entry.curriculum) or (key == "weight" and entry.weight != 1.0)})


@dataclass
class MixtureEntry:
    """One environment of a mixture: ``env`` (what ``--env`` accepts for one environment), its sampling ``weight``
    (> 0; relative to the others), its loader's ``env_args`` (its own limits among them, e.g. ``max_new_tokens``
    for a built-in), the ``name`` its metrics are logged under (default: the spec, a file's stem for a path) and its
    ``curriculum`` (overrides of the ``--curriculum_*`` flags for this entry: ``core.curriculum``)."""

    env: str
    weight: float = 1.0
    env_args: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    curriculum: dict[str, Any] = field(default_factory=dict)
    environment: Environment | None = None

    def __post_init__(self):
        if not self.name:
            path = Path(self.env)
            self.name = path.stem if self.env.endswith(".py") or path.is_dir() else self.env


@dataclass
class MixtureRow(Row):
    """A mixture's row: ``entry`` is the index of its environment, ``source`` the row of that environment."""

    entry: int = 0
    source: Row | None = None

    @property
    def seed_index(self) -> int:
        """The entry's own row's: evaluated in a mixture or alone, a row draws the same seeds."""
        return self.index if self.source is None else self.source.seed_index


def parse_entries(value: Any, flag: str = "--env") -> list[MixtureEntry] | None:
    """The mixture ``value`` describes (a list of mappings, its JSON text, or a YAML file of it: ``read_entries``,
    from ``flag``), checked entry by entry; None when ``value`` names a single environment (a string that is neither
    a JSON list nor a .yaml file)."""
    if isinstance(value, str) and value.endswith(YAML_SUFFIXES):
        value = read_entries(value, flag)
    if isinstance(value, str):
        if value.lstrip().startswith("{"):
            raise MixtureError(f"{flag} {value}: one JSON object. A mixture is a JSON list of entries ('[{value}]'); "
                               f"one environment is its name, its arguments in {flag}_args.")
        if not value.lstrip().startswith("["):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise MixtureError(f"{flag} is not a valid JSON list of environments: {error}") from None
    if not isinstance(value, list) or not value:
        raise MixtureError(f"{flag}: a mixture is a non-empty list of entries like {{\"env\": \"reverse_text\", "
                           f"\"weight\": 1}}, got {value!r}.")
    return _named_apart([_entry(item, i, flag) for i, item in enumerate(value)], flag)


def _named_apart(entries: list[MixtureEntry], flag: str) -> list[MixtureEntry]:
    names = [entry.name for entry in entries]
    for name in names:
        if names.count(name) > 1:
            raise MixtureError(f"{flag}: two entries are named {name!r} (their metrics would mix); give each a "
                               "\"name\".")
    return entries


def read_entries(path: str, flag: str = "--env") -> Any:
    """A YAML file's mixture: the file is the list of entries, or a training ``--config`` whose ``env:`` is that list
    (only ``env:`` is read from it: the command's own flags set the rest)."""
    try:
        content = read_yaml(path, flag)
    except ValueError as error:
        raise MixtureError(str(error)) from None
    if isinstance(content, Mapping):
        if "env" not in content:
            raise MixtureError(f"{flag} {path} is a mapping without env:; give a YAML list of entries or a training "
                               "--config whose env: is one.")
        others = sorted(set(content) - {"env"})
        if others:  # said, not silently dropped: the user may have meant --config
            logger.warning("%s %s: only its env: list is read; its other keys (%s) are not (pass the file as --config "
                           "to train with them).", flag, path, ", ".join(others))
        content = content["env"]
    if not isinstance(content, list):
        raise MixtureError(f"{flag} {path}: a mixture file holds a list of entries (or a config's env: list), got "
                           f"{content!r:.200}.")
    return content


def _entry(item: Any, index: int, flag: str, built: bool = False) -> MixtureEntry:
    """Entry ``index`` of ``flag``; with ``built`` (``mixture_of``), ``env`` may be an ``Environment`` object."""
    where = f"{flag} entry {index}"
    if not isinstance(item, Mapping):
        raise MixtureError(f"{where} is a {type(item).__name__}; expected a mapping like {{\"env\": \"reverse_text\"}}.")
    refusal = unknown_keys(item, ENTRY_KEYS, where, f"an entry takes {', '.join(ENTRY_KEYS)} (an environment's own "
                           "limits go in its env_args).")
    if refusal:
        raise MixtureError(refusal)
    spec = item.get("env")
    if built and isinstance(spec, Environment):
        if item.get("env_args"):
            raise MixtureError(f"{where} ({spec.name}): \"env_args\" are a loader's arguments; an Environment object "
                               "is built already (give its limits to its constructor).")
        entry = _entry({**item, "env": spec.name, "name": item.get("name") or spec.name}, index, flag)
        entry.environment = spec
        return entry
    if not isinstance(spec, str) or not spec:
        kind = "name or path" + (", or an Environment object" if built else "")
        raise MixtureError(f"{where} needs \"env\": the environment's {kind}, got {spec!r}.")
    where = f"{flag} entry {index} ({spec})"
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise MixtureError(f"{where}: \"weight\" must be a number > 0, got {weight!r}.")
    env_args = item.get("env_args", {})
    if not isinstance(env_args, Mapping):
        raise MixtureError(f"{where}: \"env_args\" must be a mapping of the loader's arguments, got {env_args!r}.")
    name = item.get("name", "")
    if not isinstance(name, str):
        raise MixtureError(f"{where}: \"name\" must be a string, got {name!r}.")
    try:
        curriculum = check_overrides(item.get("curriculum", {}), f"{where}: ")
    except ValueError as error:
        raise MixtureError(str(error)) from None
    return MixtureEntry(spec, float(weight), dict(env_args), name, curriculum)


def load_mixture(entries: list[MixtureEntry], load: Callable[[MixtureEntry], Environment],
                 prepare: Callable[[Environment, MixtureEntry], Any], flag: str = "--env") -> "MixtureEnv":
    """Load each entry (``load``; an entry built already keeps its environment) and make it ready for the run
    (``prepare``: chat kwargs, its limits, its hold-out); any failure is a ``MixtureError`` naming the entry."""
    for entry in entries:
        try:
            if entry.environment is None:
                entry.environment = load(entry)
            prepare(entry.environment, entry)
        except Exception as error:
            where = raised_at(error)  # the user's loader's own error: where it was raised
            at = f" at {where}" if where else ""
            raise MixtureError(f"{flag} entry {entry.name!r}: {type(error).__name__}{at}: {error}") from error
    return MixtureEnv(entries)


def mixture_of(entries: list[Mapping[str, Any]], tokenizer: Any = None, *, holdout: int = 0,
               seed: int = 0) -> "MixtureEnv":
    """A mixture built in Python: each entry a mapping as ``--env``'s (``env``, ``weight``, ``env_args``, ``name``),
    whose ``env`` may also be an ``Environment`` object (e.g. TRL's form, ``RewardFunctionsEnv(dataset,
    reward_funcs, tokenizer)``; its name defaults to the environment's). Named environments are loaded with
    ``tokenizer``; ``holdout`` rows of each entry are held out by a ``seed`` shuffle (what ``--eval_holdout``
    checks). Pass the result to ``RLTrainer(environment=...)``: it gives every entry the run's chat template kwargs
    and, to TRL-form entries, its ``trainer_state``."""
    from verifiers_rl.envs.loading import load_with_args
    from verifiers_rl.envs.splits import hold_out

    if not isinstance(entries, (list, tuple)) or not entries:
        raise MixtureError(f"mixture_of: a mixture is a non-empty list of entries, got {entries!r:.200}.")
    parsed = _named_apart([_entry(item, i, "mixture_of", built=True) for i, item in enumerate(entries)], "mixture_of")

    def load(entry: MixtureEntry) -> Environment:
        if tokenizer is None:
            raise MixtureError("it names an environment to load: pass mixture_of(..., tokenizer=...).")
        return load_with_args(entry.env, tokenizer, env_args=entry.env_args)

    # Chat template kwargs are the trainer's to give (RLTrainer), so only the hold-out is applied here.
    return load_mixture(parsed, load, lambda env, entry: holdout and hold_out(env, holdout, seed), "mixture_of")


class MixtureEnv(Environment):
    """The entries of a mixture as one environment (module docstring). Its limits are the largest of the entries';
    each entry keeps its own. Entries must be loaded and prepared first (``load_mixture``)."""

    def __init__(self, entries: list[MixtureEntry]):
        if not entries or any(entry.environment is None for entry in entries):
            raise ValueError("MixtureEnv needs loaded entries (load_mixture).")
        self.entries = entries
        self.name = "mixture[" + ",".join(f"{e.name}={e.weight:g}" for e in entries) + "]"
        first = entries[0].environment
        self.rubric = first.rubric
        self.tokenizer = first.tokenizer
        self.chat_template_kwargs = dict(first.chat_template_kwargs)
        total = sum(entry.weight for entry in entries)
        self._cumulative = [sum(e.weight for e in entries[: i + 1]) / total for i in range(len(entries))]
        self._drawn: list[tuple[int, int]] = []  # position -> (entry, how many draws of it came before)
        self._drawn_under: tuple[int, bool] | None = None  # the (seed, shuffle) ``_drawn`` was drawn under
        self._counts: list[int] = []  # draws of each entry in ``_drawn``
        self._rebuild()

    def _rebuild(self) -> None:
        """The rows, limits and hold-out as the entries now have them."""
        envs = [entry.environment for entry in self.entries]
        self.max_seq_len = max(env.max_seq_len for env in envs)
        self.max_new_tokens = max(env.max_new_tokens for env in envs)
        self.dataset = self._rows("dataset")
        self.eval_dataset = self._rows("eval_dataset")
        self._starts = [0]
        for env in envs:
            self._starts.append(self._starts[-1] + len(env.dataset))
        held = {getattr(env, "_verifiers_rl_holdout", None) for env in envs}
        if len(held) == 1 and None not in held:
            self._verifiers_rl_holdout = held.pop()

    def _rows(self, split: str) -> list[MixtureRow]:
        rows = []
        for number, entry in enumerate(self.entries):
            for row in getattr(entry.environment, split):
                rows.append(MixtureRow(len(rows), row.prompt, row.answer, row.info, entry=number, source=row))
        return rows

    def use_chat_template_kwargs(self, kwargs: Mapping[str, Any] | None) -> None:
        """Every entry renders with ``kwargs`` (``Environment.use_chat_template_kwargs``); an entry that refuses
        them is named."""
        for entry in self.entries:
            try:
                entry.environment.use_chat_template_kwargs(kwargs)
            except ValueError as error:
                raise MixtureError(f"mixture entry {entry.name!r}: {error}") from error
        self.chat_template_kwargs = dict(self.entries[0].environment.chat_template_kwargs)
        self._rebuild()

    def use_trainer_state(self, state: Callable[[], Any]) -> None:
        """Every entry that reads the trainer's state (TRL's form: ``RewardFunctionsEnv.use_trainer_state``) gets
        ``state``."""
        for entry in self.entries:
            use = getattr(entry.environment, "use_trainer_state", None)
            if use is not None:
                use(state)

    def hold_out(self, count: int, seed: int, flag: str = "--eval_holdout") -> None:
        """``count`` rows of each entry held out (``envs.splits.hold_out``), as ``--eval_holdout`` does; an error
        names the entry."""
        from verifiers_rl.envs.splits import hold_out

        for entry in self.entries:
            try:
                hold_out(entry.environment, count, seed, flag)
            except ValueError as error:
                raise MixtureError(f"mixture entry {entry.name!r}: {error}") from error
        self._rebuild()

    def adopt_limits(self, max_seq_len: int | None = None, max_new_tokens: int | None = None) -> None:
        raise MixtureError("A mixture states no limits of its own: each entry takes the trainer's flags where it "
                           "has no limit, or its own (set them in each entry's env_args).")

    def prompt_ids(self, prompt: Messages) -> list[int]:
        raise NotImplementedError("A mixture renders a prompt with its entry's environment (rollout_group).")

    async def generate(self, sampler: Sampler, prompt: Messages, prompt_ids: list[int], state: dict) -> Trajectory:
        raise NotImplementedError("A mixture generates whole groups through its entries (rollout_group).")

    async def rollout_group(self, sampler: Sampler, row: Row, group_id: str | int, n: int, *,
                            seed: int | None = None, temperature: float | None = None) -> list[Rollout]:
        """The group of ``row`` from its entry's environment, each rollout stamped with the entry's name."""
        entry = self.entries[row.entry]
        rollouts = await entry.environment.rollout_group(sampler, row.source, group_id, n, seed=seed,
                                                         temperature=temperature)
        for rollout in rollouts:
            rollout.env = entry.name
        return rollouts

    # --- draws ------------------------------------------------------------------------------------------------------

    def entry_at(self, position: int, seed: int) -> int:
        """The entry the group at ``position`` comes from: drawn by weight from the position's own seed."""
        u = random.Random(derive_seed(seed, "mixture", position)).random()
        return min(bisect.bisect_right(self._cumulative, u), len(self.entries) - 1)

    def draw_rows(self, positions: list[int], seed: int, shuffle: bool = True) -> list[int]:
        """The rows (indices into ``dataset``) of the groups at ``positions``: the entry by weight, then the next row
        of that entry's own order (a shuffle seeded per epoch, or the dataset's order without ``shuffle``)."""
        if self._drawn_under != (seed, shuffle):
            self._drawn, self._drawn_under = [], (seed, shuffle)
            self._counts = [0] * len(self.entries)
        while len(self._drawn) <= max(positions, default=-1):
            entry = self.entry_at(len(self._drawn), seed)
            self._drawn.append((entry, self._counts[entry]))
            self._counts[entry] += 1
        return [self._row_of(*self._drawn[p], seed, shuffle) for p in positions]

    def _row_of(self, entry: int, draw: int, seed: int, shuffle: bool) -> int:
        epoch, offset = divmod(draw, len(self.entry_rows(entry)))
        return self.entry_order(entry, epoch, seed, shuffle)[offset]

    def entry_rows(self, entry: int) -> range:
        """The rows (indices into ``dataset``) of entry ``entry``."""
        return range(self._starts[entry], self._starts[entry + 1])

    def entry_order(self, entry: int, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
        """Entry ``entry``'s rows in the order of its epoch ``epoch``: a shuffle seeded by the entry's name and the
        epoch (the dataset's order without ``shuffle``)."""
        order = list(self.entry_rows(entry))
        if shuffle:
            random.Random(derive_seed(seed, "mixture", self.entries[entry].name, epoch)).shuffle(order)
        return order

    def entry_by_weight(self, u: float) -> int:
        """The entry a uniform draw ``u`` in [0, 1) picks by weight."""
        return min(bisect.bisect_right(self._cumulative, u), len(self.entries) - 1)

    def draw_refill(self, index: int, round_: int, count: int, seed: int,
                    rows_of: Callable[[int], Sequence[int]] | None = None) -> list[int]:
        """Dynamic sampling's refill rows of batch ``index``, round ``round_``: each drawn by weight, then uniformly
        among its entry's ``rows_of(entry)`` (default: all of them; a curriculum leaves out those set aside), from its
        own seed (so a resumed run refills alike)."""
        rows_of = rows_of or self.entry_rows
        rows = []
        for j in range(count):
            draw = random.Random(derive_seed(seed, "mixture", "refill", index, round_, j))
            rows.append(draw.choice(rows_of(self.entry_by_weight(draw.random()))))
        return rows

    # --- evaluation -------------------------------------------------------------------------------------------------

    def eval_selection(self, num_examples: int | None, flag: str = "--eval_num_examples") -> list[MixtureRow]:
        """The held-out rows evaluation uses: the first ``num_examples`` (``flag``'s value) of each entry's split (all
        for None)."""
        from verifiers_rl.envs.splits import split_size_hint

        picked = []
        for number, entry in enumerate(self.entries):
            rows = [row for row in self.eval_dataset if row.entry == number]
            larger = split_size_hint(entry.environment, "env_args {}")  # the entry's own loader's argument
            if not rows:
                raise MixtureError(f"mixture entry {entry.name!r} has no held-out split to evaluate on: give it one "
                                   f"({larger}) or hold out training rows with --eval_holdout N (verifiers-rl eval: "
                                   "--holdout N).")
            if num_examples is not None and num_examples > len(rows):
                raise MixtureError(f"{flag} {num_examples} is larger than the held-out split of mixture "
                                   f"entry {entry.name!r} ({len(rows)} rows); lower it or enlarge that split "
                                   f"({larger}).")
            picked += rows if num_examples is None else rows[:num_examples]
        return picked
