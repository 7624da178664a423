"""User hooks (reward functions, tools, environment turns) may be plain functions or ``async def``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any


async def maybe_await(value: Any) -> Any:
    """``value`` itself, or its result when it is awaitable."""
    return await value if inspect.isawaitable(value) else value


async def call_off_loop(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``'s result: an ``async def`` awaited on the loop, a plain function run in a worker
    thread (``asyncio.to_thread``), so that a slow one (a blocking request, a subprocess) does not hold up every other
    rollout in flight meanwhile; an awaitable it returns is awaited."""
    if inspect.iscoroutinefunction(function):
        return await function(*args, **kwargs)
    return await maybe_await(await asyncio.to_thread(function, *args, **kwargs))


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
