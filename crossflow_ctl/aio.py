"""Small asyncio helpers the agent and the demo share (no I/O, no third-party imports)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RECANCEL_S = 0.5
"""How long a cancelled task gets before it is cancelled again."""


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel every task, then wait for each to end; a task's own failure still propagates.

    A task can swallow one cancellation without meaning to (on Python 3.11 a cancel that lands
    as an ``asyncio.timeout`` fires comes out as TimeoutError, which a retry loop catches), so a
    task still running after :data:`RECANCEL_S` is cancelled again until it ends."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    pending = {task for task in tasks if not task.done()}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
        for task in pending:
            task.cancel()
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


async def wait_any(*events: asyncio.Event, timeout_s: float) -> None:
    """Return once any of ``events`` is set, or after ``timeout_s``; leaves no waiter behind."""
    if timeout_s <= 0 or any(e.is_set() for e in events):
        return
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(waiters)
