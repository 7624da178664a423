"""Held-out evaluation splits: rows that evaluation uses and training never does.

Two ways to get one: an environment built with ``eval_dataset=`` (the built-ins generate theirs with
``disjoint_rows``), or ``hold_out``, which moves rows chosen by a seeded shuffle out of an environment's training
dataset (``--eval_holdout N``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from verifiers_rl.envs.environment import Environment
from verifiers_rl.core.sampling import derive_seed

# Candidates are drawn in rounds of this many rows (from a stream that does not depend on how many are asked for, so
# a smaller split is a prefix of a larger one); a round that adds no new row means the task space is used up.
ROUND_SIZE = 256
MIN_ROUNDS = 64


def _key(row: Mapping[str, Any]) -> str:
    return repr(row.get("prompt") if row.get("prompt") is not None else row.get("question"))


def disjoint_rows(
    make_rows: Callable[[int, int], Sequence[Mapping[str, Any]]],
    count: int,
    training_rows: Sequence[Mapping[str, Any]],
    seed: int,
    name: str = "environment",
) -> list[dict[str, Any]]:
    """The first ``count`` rows of ``make_rows(ROUND_SIZE, derive_seed(seed, "eval", round))``, round = 0, 1, ...,
    whose prompt (``prompt`` or ``question``) is in no training row and in no row picked before. The seeds are
    never ``seed`` itself, so a held-out row is not simply the next training row."""
    if count < 0:
        raise ValueError(f"{name}: num_eval_examples must be >= 0, got {count}.")
    seen = {_key(row) for row in training_rows}
    picked: list[dict[str, Any]] = []
    for round_ in range(max(MIN_ROUNDS, 4 * count // ROUND_SIZE)):
        found = len(picked)
        for row in make_rows(ROUND_SIZE, derive_seed(seed, "eval", round_)):
            key = _key(row)
            if key not in seen and len(picked) < count:
                seen.add(key)
                picked.append(dict(row))
        if len(picked) == count or len(picked) == found:
            break
    if len(picked) < count:
        raise ValueError(
            f"{name}: found only {len(picked)} evaluation rows that differ from every training row (asked for "
            f"{count}); the training rows cover most of the task space. Lower num_eval_examples or num_examples."
        )
    return picked


def hold_out(environment: Environment, count: int, seed: int, flag: str = "--eval_holdout") -> None:
    """Move ``count`` rows of ``environment.dataset``, chosen by a shuffle seeded with ``seed``, into
    ``environment.eval_dataset`` (replacing the split it had). The rows keep their indices, and the training rows
    their order. Applying the same holdout twice is a no-op; a different one is an error (naming ``flag``). A
    mixture holds ``count`` rows out of each entry (``MixtureEnv.hold_out``)."""
    own = getattr(environment, "hold_out", None)
    if own is not None:  # a mixture's rows are its entries': moving them here would break its draws
        own(count, seed, flag)
        return
    applied = getattr(environment, "_verifiers_rl_holdout", None)
    if applied is not None:
        if applied != (count, seed):
            raise ValueError(
                f"{environment.name}: rows were already held out with {flag} {applied[0]} (seed {applied[1]})."
            )
        return
    rows = environment.dataset
    if not 0 < count < len(rows):
        raise ValueError(
            f"{flag} {count}: {environment.name} has {len(rows)} training rows; hold out between 1 and "
            f"{len(rows) - 1} of them."
        )
    order = list(range(len(rows)))
    random.Random(derive_seed(seed, "eval_holdout")).shuffle(order)
    held = {rows[i].index for i in order[:count]}
    environment.eval_dataset = [row for row in rows if row.index in held]
    environment.dataset = [row for row in rows if row.index not in held]
    if hasattr(environment, "_all_rows"):
        # The rows adopt_limits filters again (new length limits): the split must survive that too.
        all_rows = environment._all_rows
        environment._all_eval_rows = [row for row in all_rows if row.index in held]
        environment._all_rows = [row for row in all_rows if row.index not in held]
    environment._verifiers_rl_holdout = (count, seed)


def split_size_hint(environment: Environment, form: str) -> str:
    """The loader argument that sizes ``environment``'s held-out split (reasoning-gym's, or the built-ins'), written
    into ``form`` (``{}``: the JSON object), as "... takes ..."."""
    if environment.name.startswith("reasoning_gym:"):
        return "reasoning-gym takes " + form.format('{"eval_size": N}')
    return "the built-ins take " + form.format('{"num_eval_examples": N}')
