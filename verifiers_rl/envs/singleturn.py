"""SingleTurnEnv: the model answers the prompt once."""

from __future__ import annotations

from typing import Any

from verifiers_rl.envs.multiturn import MultiTurnEnv


class SingleTurnEnv(MultiTurnEnv):
    """One model turn per rollout; takes the arguments of ``Environment``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, max_turns=1, **kwargs)
