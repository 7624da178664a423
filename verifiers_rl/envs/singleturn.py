"""SingleTurnEnv: the model answers the prompt once."""

from __future__ import annotations

from typing import Any

from verifiers_rl.envs.multiturn import MultiTurnEnv


class SingleTurnEnv(MultiTurnEnv):
    """One model turn per rollout; takes the arguments of ``Environment`` (``max_turns`` only as 1)."""

    def __init__(self, *args: Any, max_turns: int = 1, **kwargs: Any):
        if max_turns != 1:  # e.g. --env_args '{"max_turns": 3}' given to a single-turn built-in
            name = kwargs.get("name") or type(self).__name__
            raise ValueError(f"{name}: max_turns={max_turns!r} is refused: a single-turn environment has one model "
                             "turn; use a MultiTurnEnv for several.")
        super().__init__(*args, max_turns=1, **kwargs)
