"""crossflow_ctl.aio: wait_any wakes on the first event or its timeout; cancel_and_wait reaps."""

from __future__ import annotations

import asyncio

import pytest

from crossflow_ctl.aio import cancel_and_wait, wait_any


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


async def test_cancel_and_wait_ends_every_task_and_keeps_a_real_failure() -> None:
    never = asyncio.Event()
    tasks = [asyncio.create_task(never.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    await cancel_and_wait(tasks)
    assert all(t.cancelled() for t in tasks)

    async def fail() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fail())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="boom"):
        await cancel_and_wait([failed])


async def test_cancel_and_wait_cancels_again_a_task_that_swallowed_its_cancel(monkeypatch) -> None:
    import crossflow_ctl.aio as aio

    monkeypatch.setattr(aio, "RECANCEL_S", 0.05)
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # like a retry loop that saw a TimeoutError instead

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(aio.cancel_and_wait([task]), timeout=5)
    assert task.cancelled() and swallowed == 1


async def test_cancel_and_wait_still_raises_a_tasks_own_failure() -> None:
    async def broken() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="boom"):
        await cancel_and_wait([task])
