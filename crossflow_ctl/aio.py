"""Small asyncio helpers the agent and the demo share (no I/O, no third-party imports)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel every task, then wait for each to end; a task's own failure still propagates."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_any(*events: asyncio.Event, timeout_s: float) -> None:
    """Return once any of ``events`` is set, or after ``timeout_s``; leaves no waiter behind."""
    if timeout_s <= 0 or any(e.is_set() for e in events):
        return
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(waiters)
