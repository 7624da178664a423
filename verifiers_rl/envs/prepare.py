"""One way to make a loaded environment ready for a run: the training command, evaluation and TRL's form share it.

The order matters and is fixed here: the chat template's kwargs change the rendered prompts' lengths, which the
length contract filters rows on; the held-out split comes last, so that the limits' filter cannot undo it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verifiers_rl.envs.limits import LIMIT_FLAGS, resolve_limits
from verifiers_rl.envs.splits import hold_out


def prepare_environment(
    environment: Any,
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    lengths: Mapping[str, int] | None = None,
    given: set[str] = frozenset(),
    holdout: int = 0,
    seed: int = 0,
    args_flag: str = "--env_args",
    context: str = "",
    holdout_flag: str = "--eval_holdout",
) -> dict[str, int] | None:
    """Apply, in order, ``chat_template_kwargs`` (``Environment.use_chat_template_kwargs``), the length contract
    (``lengths``: the trainer's current ``LIMIT_FLAGS`` values, ``given``: those the user set; ``None`` skips it) and
    ``hold_out(environment, holdout, seed)`` (0 skips it; its errors name ``holdout_flag``).

    Returns the values the length flags must take (``resolve_limits``), or ``None`` when ``lengths`` is ``None``.
    Raises ``LengthContractError`` naming ``args_flag`` when a given flag disagrees with a stated limit.
    """
    environment.use_chat_template_kwargs(chat_template_kwargs)
    resolved = None
    if lengths is not None:
        resolved = resolve_limits(environment, {flag: lengths[flag] for flag in LIMIT_FLAGS}, set(given), args_flag,
                                  context)
    if holdout:
        hold_out(environment, holdout, seed, holdout_flag)
    return resolved
