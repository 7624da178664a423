"""User hooks (reward functions, tools, environment turns) may be plain functions or ``async def``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any


async def maybe_await(value: Any) -> Any:
    """``value`` itself, or its result when it is awaitable."""
    return await value if inspect.isawaitable(value) else value


async def gather_or_cancel(awaitables: list[Awaitable[Any]]) -> list[Any]:
    """Their results in order; when one raises, the others are cancelled (and awaited) before the error is raised:
    ``asyncio.gather`` would leave them running unseen."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
