"""wait_any: wakes on whichever event is set first, or on its timeout, and leaves no task."""

from __future__ import annotations

import asyncio

from crossflow_ctl.aio import wait_any


async def test_wait_any_wakes_on_either_event_or_timeout_and_leaks_no_task() -> None:
    before = asyncio.all_tasks()
    a, b = asyncio.Event(), asyncio.Event()
    waiter = asyncio.create_task(wait_any(a, b, timeout_s=60))
    await asyncio.sleep(0)
    assert not waiter.done()
    b.set()
    await asyncio.wait_for(waiter, timeout=10)  # returned because b was set, not at 60 s
    await wait_any(a, b, timeout_s=60)  # an event already set: at once
    await wait_any(asyncio.Event(), timeout_s=0.01)  # nothing set: the timeout
    await wait_any(asyncio.Event(), timeout_s=-1)
    await asyncio.sleep(0)
    assert asyncio.all_tasks() - before == set()
