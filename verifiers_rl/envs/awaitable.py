"""User hooks (reward functions, tools, environment turns) may be plain functions or ``async def``."""

from __future__ import annotations

import inspect
from typing import Any


async def maybe_await(value: Any) -> Any:
    """``value`` itself, or its result when it is awaitable."""
    return await value if inspect.isawaitable(value) else value
