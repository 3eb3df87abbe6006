"""crossflow_ctl.aio: wait_any wakes on the first event or its timeout; cancel_and_wait reaps;
within bounds a call by a timeout, arming no timer for a call that never suspends; shielded
shields a call from its caller's cancellation, making no task for a call that never suspends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest
import structlog

from crossflow_ctl.aio import (
    Finished,
    begin,
    cancel_and_wait,
    detached_task,
    shielded,
    wait_any,
    wait_settled,
    within,
)


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


async def test_within_returns_a_call_that_never_suspends_without_a_timer() -> None:
    async def at_once() -> int:
        return 7

    loop = asyncio.get_running_loop()
    before = len(loop._scheduled)  # type: ignore[attr-defined]
    assert await within(at_once(), 0.05) == 7
    assert len(loop._scheduled) == before  # type: ignore[attr-defined]


async def test_within_times_out_a_call_that_suspends_past_its_deadline() -> None:
    finished = []

    async def slow() -> None:
        await asyncio.sleep(0)
        await asyncio.sleep(5)
        finished.append(True)

    with pytest.raises(TimeoutError):
        await within(slow(), 0.01)
    assert finished == []


async def test_within_passes_on_results_and_errors_after_a_suspension() -> None:
    async def later(fail: bool) -> str:
        await asyncio.sleep(0)
        if fail:
            raise ValueError("boom")
        return "done"

    assert await within(later(False), 1.0) == "done"
    with pytest.raises(ValueError, match="boom"):
        await within(later(True), 1.0)


async def test_within_outer_cancellation_reaches_the_call() -> None:
    cleaned = asyncio.Event()

    async def waits() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            cleaned.set()

    task = asyncio.create_task(within(waits(), 10.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()


async def _log_fields() -> dict[str, object]:
    return structlog.contextvars.get_contextvars()


async def test_a_detached_task_leaves_its_starters_log_fields_behind() -> None:
    with structlog.contextvars.bound_contextvars(node_id="d1"):
        plain = await asyncio.create_task(_log_fields())
        detached = await detached_task(_log_fields(), name="shared")
    assert plain == {"node_id": "d1"}  # what a shared task started by a stream would log with
    assert detached == {}


async def test_shielded_runs_a_call_that_never_suspends_in_the_callers_task() -> None:
    ran_in: list[asyncio.Task[object] | None] = []

    async def at_once() -> int:
        ran_in.append(asyncio.current_task())
        return 7

    assert await shielded(at_once()) == 7
    assert ran_in == [asyncio.current_task()]


async def test_shielded_finishes_a_suspended_call_its_caller_stopped_waiting_for() -> None:
    gate = asyncio.Event()
    steps: list[str] = []

    async def releases() -> str:
        steps.append("started")
        await gate.wait()  # a pool's lock another caller holds
        steps.append("finished")
        return "released"

    caller = asyncio.create_task(shielded(releases()))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert steps == ["started"]
    gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == ["started", "finished"]  # the cancel never reached it


async def test_shielded_passes_on_results_and_errors_after_a_suspension() -> None:
    async def later(fail: bool) -> str:
        await asyncio.sleep(0)
        if fail:
            raise ValueError("boom")
        return "done"

    assert await shielded(later(False)) == "done"
    with pytest.raises(ValueError, match="boom"):
        await shielded(later(True))


async def test_begin_finishes_a_call_that_never_suspends_and_resumes_one_that_does() -> None:
    async def at_once() -> int:
        return 1

    async def later(gate: asyncio.Event) -> int:
        await gate.wait()
        return 2

    assert begin(at_once()) == Finished(1)
    gate = asyncio.Event()
    rest = begin(later(gate))
    assert not isinstance(rest, Finished)
    task = asyncio.ensure_future(_await(rest))
    await asyncio.sleep(0)
    assert not task.done()
    gate.set()
    assert await task == 2


async def _await(call: Awaitable[int]) -> int:
    return await call


async def test_wait_settled_waits_for_tasks_started_meanwhile_and_stops_at_its_timeout() -> None:
    running: set[asyncio.Task[None]] = set()

    def start(coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        running.add(task)
        task.add_done_callback(running.discard)

    done: list[str] = []

    async def second() -> None:
        await asyncio.sleep(0.02)
        done.append("second")

    async def first() -> None:
        await asyncio.sleep(0.01)
        start(second())  # a hand-over that starts another
        done.append("first")

    start(first())
    await wait_settled(lambda: running, 30.0)  # a hang guard: it returns once both ended
    assert done == ["first", "second"] and not running

    never = asyncio.ensure_future(asyncio.Event().wait())
    await wait_settled(lambda: (never,), 0.01)  # bounded: returns with it still running
    assert not never.done()
    never.cancel()
