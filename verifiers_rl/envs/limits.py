"""The length contract between a trainer and the environment it generates from.

The environment states its limits: ``max_seq_len`` (prompt + completion, in tokens) and ``max_new_tokens`` (per
model turn). The trainer's ``--max_seq_len`` and ``--max_completion_length`` default to them; a flag the user gives
must agree with the environment's limit, unless the environment does not state that limit
(``Environment.unstated_limits``), in which case the environment takes the flag's value.
"""

from __future__ import annotations

from typing import Any

# trainer flag -> the environment's attribute it must equal
LIMIT_FLAGS = {"max_seq_len": "max_seq_len", "max_completion_length": "max_new_tokens"}


class LengthContractError(ValueError):
    """A length flag disagrees with the environment's own limit."""


def resolve_limits(
    environment: Any, flags: dict[str, int], given: set[str], args_flag: str = "--env_args", context: str = ""
) -> dict[str, int]:
    """The values the trainer's length flags must take for ``environment``.

    ``flags`` holds the trainer's current values of ``LIMIT_FLAGS``, ``given`` the flags the user set (on the
    command line or in a config file). A given flag for a limit the environment does not state is adopted by the
    environment (its rows are filtered again); a given flag that differs from a stated limit raises
    LengthContractError naming both values and the flags that fix it (``args_flag``: the flag of the environment's
    loader arguments; ``context`` opens the message, e.g. which environment it is).
    """
    resolved: dict[str, int] = {}
    adopted: dict[str, int] = {}
    for flag, limit in LIMIT_FLAGS.items():
        stated = getattr(environment, limit)
        if flag in given and limit in environment.unstated_limits:
            adopted[limit] = resolved[flag] = flags[flag]
        elif flag in given and flags[flag] != stated:
            raise LengthContractError(
                f"{context}--{flag}={flags[flag]} disagrees with the environment {environment.name!r}, whose {limit} "
                f"is {stated}. Leave out --{flag} (it defaults to the environment's {stated}), or change the "
                f"environment's own limit, e.g. {args_flag} '{{\"{limit}\": {flags[flag]}}}' for a built-in "
                "environment."
            )
        else:
            resolved[flag] = stated
    if adopted:
        environment.adopt_limits(**adopted)
    return resolved
