"""Small asyncio helpers the agent and the demo share (no I/O, no third-party imports)."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_any(*events: asyncio.Event, timeout_s: float) -> None:
    """Return once any of ``events`` is set, or after ``timeout_s``; leaves no waiter behind."""
    if timeout_s <= 0 or any(e.is_set() for e in events):
        return
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        for w in waiters:
            with contextlib.suppress(asyncio.CancelledError):
                await w
