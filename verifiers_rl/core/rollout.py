"""The rollout record: what an environment produces, what `--rollouts_path` replays, one JSON line each."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar


T = TypeVar("T")


def group_by_id(items: Iterable[T], group_id: Callable[[T], Any] = lambda item: item.group_id) -> list[list[T]]:
    """``items`` grouped by ``group_id(item)`` (a rollout's or sequence's own by default), groups in order of first
    appearance, items in their order."""
    groups: dict[Any, list[T]] = {}
    for item in items:
        groups.setdefault(group_id(item), []).append(item)
    return list(groups.values())


# ``completion_versions`` of a completion token no policy sampled (an environment's or a tool's, mask 0).
NOT_SAMPLED = -1


class RolloutFormatError(ValueError):
    """A rollout record that cannot be trained on; the message names the record and the problem."""


@dataclass
class Rollout:
    """One sampled completion of one prompt.

    ``completion_mask`` is 1 on tokens the policy generated and that are trained on, 0 on environment/tool
    tokens inside a multi-turn completion. ``completion_logprobs`` are the sampler's log-probs, one per
    completion token (any value on masked tokens). Rollouts of the same prompt share ``group_id``.
    ``metrics`` holds each reward function's value (logged as ``rewards/<name>/mean``); ``logged_metrics`` what
    reward functions logged besides (TRL's ``log_metric``, logged under its own name). ``env`` names the mixture
    entry that produced it (``envs.mixture``; None outside a mixture, and absent from files written before).
    ``episode_id``: set on the branches of one episode that has several trainable branches (a verifiers v1
    episode with sub-agents or rewritten history): they share it, their group and their reward, and count as one
    episode for the group's advantage baseline (``training.batching.episode_advantages``); None: the rollout is
    an episode of its own. ``completion_versions``: the policy version that sampled each completion token
    (``NOT_SAMPLED`` on environment tokens), so a completion sampled across a weight update says which tokens came
    from which weights; None in files written before (then ``policy_version`` holds for every token).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    reward: float
    group_id: str | int
    completion_logprobs: list[float] | None = None
    truncated: bool = False
    policy_version: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    reward_errors: dict[str, str] = field(default_factory=dict)
    logged_metrics: dict[str, float] = field(default_factory=dict)
    prompt: Any = None
    completion: Any = None
    env: str | None = None
    episode_id: str | int | None = None
    completion_versions: list[int] | None = None

    def oldest_version(self) -> int | None:
        """The policy version of the completion's oldest sampled token (its staleness is the rollout's); the
        rollout's ``policy_version`` where no token carries one."""
        sampled = [v for v in self.completion_versions or () if v != NOT_SAMPLED]
        return min(sampled) if sampled else self.policy_version

    def validate(self, where: str = "rollout") -> None:
        """Raise RolloutFormatError naming ``where`` if the record is inconsistent."""
        for name in ("prompt_ids", "completion_ids", "completion_mask"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                raise RolloutFormatError(f"{where}: `{name}` must be a list of integers.")
        if not self.prompt_ids:
            raise RolloutFormatError(f"{where}: `prompt_ids` is empty; the first completion token needs a context.")
        if any(x < 0 for x in self.prompt_ids + self.completion_ids):
            raise RolloutFormatError(f"{where}: token ids must be >= 0.")
        if len(self.completion_mask) != len(self.completion_ids):
            raise RolloutFormatError(
                f"{where}: `completion_mask` has {len(self.completion_mask)} entries but `completion_ids` has "
                f"{len(self.completion_ids)}."
            )
        if any(x not in (0, 1) for x in self.completion_mask):
            raise RolloutFormatError(f"{where}: `completion_mask` must hold only 0 and 1.")
        if self.completion_logprobs is not None:
            if not isinstance(self.completion_logprobs, list):
                raise RolloutFormatError(f"{where}: `completion_logprobs` must be a list of numbers.")
            if len(self.completion_logprobs) != len(self.completion_ids):
                raise RolloutFormatError(
                    f"{where}: `completion_logprobs` has {len(self.completion_logprobs)} entries but "
                    f"`completion_ids` has {len(self.completion_ids)}."
                )
            for value in self.completion_logprobs:
                if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value > 0:
                    raise RolloutFormatError(f"{where}: `completion_logprobs` must be finite log-probs <= 0, got {value!r}.")
        if self.completion_versions is not None:
            self._validate_versions(where)
        if not isinstance(self.reward, (int, float)) or isinstance(self.reward, bool) or not math.isfinite(self.reward):
            raise RolloutFormatError(f"{where}: `reward` must be a finite number, got {self.reward!r}.")
        if not isinstance(self.reward_errors, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.reward_errors.items()
        ):
            raise RolloutFormatError(f"{where}: `reward_errors` must map reward function names to messages.")
        if not isinstance(self.logged_metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            for k, v in self.logged_metrics.items()
        ):
            raise RolloutFormatError(f"{where}: `logged_metrics` must map names to numbers.")
        if not isinstance(self.group_id, (str, int)) or isinstance(self.group_id, bool):
            raise RolloutFormatError(f"{where}: `group_id` must be a string or an integer.")
        if self.episode_id is not None and (not isinstance(self.episode_id, (str, int)) or isinstance(self.episode_id, bool)):
            raise RolloutFormatError(f"{where}: `episode_id` must be a string or an integer.")
        if self.env is not None and not isinstance(self.env, str):
            raise RolloutFormatError(f"{where}: `env` must be the environment's name (a string).")

    def _validate_versions(self, where: str) -> None:
        versions = self.completion_versions
        if not isinstance(versions, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in versions):
            raise RolloutFormatError(f"{where}: `completion_versions` must be a list of integers.")
        if len(versions) != len(self.completion_ids):
            raise RolloutFormatError(
                f"{where}: `completion_versions` has {len(versions)} entries but `completion_ids` has "
                f"{len(self.completion_ids)}."
            )
        if any(v < NOT_SAMPLED for v in versions):
            raise RolloutFormatError(f"{where}: `completion_versions` must be >= 0, or {NOT_SAMPLED} (not sampled).")
        if any(v == NOT_SAMPLED and m == 1 for v, m in zip(versions, self.completion_mask)):
            raise RolloutFormatError(
                f"{where}: a trained token (`completion_mask` 1) has no policy version ({NOT_SAMPLED}) in "
                "`completion_versions`; the policy sampled it, so some version did."
            )

    def to_json(self) -> str:
        # Empty optional maps are left out: files stay readable by versions without them.
        record = {k: v for k, v in asdict(self).items()
                  if v is not None and not (k in ("reward_errors", "logged_metrics") and not v)}
        return json.dumps(record)

    @classmethod
    def from_record(cls, record: Any, where: str = "rollout") -> "Rollout":
        if not isinstance(record, dict):
            raise RolloutFormatError(f"{where}: expected a JSON object, got {type(record).__name__}.")
        known = {f.name for f in fields(cls)}
        required = ("prompt_ids", "completion_ids", "completion_mask", "reward", "group_id")
        missing = [name for name in required if name not in record]
        if missing:
            raise RolloutFormatError(f"{where}: missing field(s) {', '.join(missing)}.")
        unknown = sorted(set(record) - known)
        if unknown:
            raise RolloutFormatError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
        rollout = cls(**record)
        rollout.validate(where)
        return rollout


def episode_key(rollout: Rollout, index: int) -> tuple:
    """Which episode rollout ``index`` of a list belongs to: the rollouts of one group that share an ``episode_id``
    are the branches of one episode; a rollout without one is an episode of its own."""
    if rollout.episode_id is None:
        return (rollout.group_id, index)
    return (rollout.group_id, "episode", rollout.episode_id)


def group_episodes(rollouts: list[Rollout]) -> list[list[Rollout]]:
    """``rollouts`` as episodes (``episode_key``): each episode's branches in their order, episodes in order of
    first appearance. What ``--rollouts_per_step``, ``--num_generations`` and evaluation's samples count."""
    keyed = group_by_id(enumerate(rollouts), lambda item: episode_key(item[1], item[0]))
    return [[rollout for _, rollout in episode] for episode in keyed]


def metric_values(rollouts: Iterable[Rollout], kind: str = "metrics") -> dict[str, list[float]]:
    """Each name in the rollouts' ``kind`` map (``metrics`` or ``logged_metrics``) to its values, over the rollouts
    that have it."""
    values: dict[str, list[float]] = {}
    for rollout in rollouts:
        for name, value in getattr(rollout, kind).items():
            values.setdefault(name, []).append(float(value))
    return values


def read_rollouts(path: str | Path) -> list[Rollout]:
    """Read a JSON Lines file of rollouts; blank lines are skipped, anything else malformed is an error."""
    path = Path(path)
    if not path.is_file():
        missing = "is a folder, not a JSON Lines file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"Rollouts file {str(path)!r} {missing}.")
    rollouts = []
    with path.open() as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise RolloutFormatError(f"{where}: not valid JSON ({error.msg}).") from None
            rollouts.append(Rollout.from_record(record, where))
    if not rollouts:
        raise RolloutFormatError(f"{path}: the file holds no rollouts.")
    return rollouts


def write_rollouts(path: str | Path, rollouts: Iterable[Rollout]) -> None:
    """Write ``rollouts`` to a new JSON Lines file (``append_rollouts`` adds to one)."""
    with Path(path).open("w") as handle:
        for rollout in rollouts:
            handle.write(rollout.to_json() + "\n")


def append_rollouts(path: str | Path, rollouts: Iterable[Rollout]) -> int:
    """Append ``rollouts`` as whole lines in one write, flushed to disk; return the file's new length in bytes.

    One ``write`` of complete lines: a run killed while appending leaves whole lines (a regular file's write is
    not cut short by a signal), and what a checkpoint records as written is on disk.
    """
    data = "".join(rollout.to_json() + "\n" for rollout in rollouts).encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # as --output_dir is: a new folder for the file is made
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view):]
        os.fsync(descriptor)
        return os.fstat(descriptor).st_size
    finally:
        os.close(descriptor)
