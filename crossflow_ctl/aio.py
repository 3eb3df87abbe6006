"""Small asyncio helpers the agent, the service and the demo share (no I/O, no third parties)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Collection, Coroutine, Generator, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

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


def detached_task(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """A task for work shared by every caller (a subscription, a batch flusher, a renewal),
    started in a fresh context: one started lazily from a request or an agent stream would
    otherwise carry that caller's bound log fields (``node_id``) into every line it logs for
    everyone else, long after that caller left."""
    return asyncio.get_running_loop().create_task(coro, name=name, context=contextvars.Context())


async def wait_settled(
    running: Callable[[], Collection[asyncio.Future[Any]]], timeout_s: float
) -> None:
    """Wait up to ``timeout_s`` until ``running()`` is empty: the tasks it gives end, and any
    started meanwhile (a hand-over that starts another, a flusher that follows another), at
    shutdown. Their results and errors stay theirs (nothing is retrieved or raised here)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (tasks := running()) and (left_s := deadline - loop.time()) > 0:
        await asyncio.wait(set(tasks), timeout=left_s)


async def wait_any(*events: asyncio.Event, timeout_s: float) -> None:
    """Return once any of ``events`` is set, or after ``timeout_s``; leaves no waiter behind."""
    if timeout_s <= 0 or any(e.is_set() for e in events):
        return
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(waiters)


async def within(call: Awaitable[T], timeout_s: float) -> T:
    """``await call`` under ``asyncio.timeout(timeout_s)``, without arming a timer for a call
    that finishes without suspending (an in-process store's: no timer could fire then).

    The call runs to its first suspension at once; only if it suspends does the rest run under
    a timeout, due at the same loop time ``asyncio.timeout`` would have set, so a call that
    suspends times out exactly as before (TimeoutError)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    started = begin(call)
    if isinstance(started, Finished):
        return started.value
    async with asyncio.timeout_at(deadline):
        return await started


async def shielded(call: Coroutine[Any, Any, T]) -> T:
    """``await asyncio.shield(call)``, without a task for a call that finishes without
    suspending (a connection pool's release when no one waits for its lock: nearly always).

    The call runs to its first suspension at once (nothing can cancel it before then); only if
    it suspends does the rest run shielded, in a task of its own that a cancellation of the
    caller does not reach, as ``asyncio.shield`` runs all of it."""
    started = begin(call)
    if isinstance(started, Finished):
        return started.value
    return await asyncio.shield(_rest(started))


@dataclass(frozen=True, slots=True)
class Finished(Generic[T]):
    """A call that finished without suspending, and what it returned."""

    value: T


def begin(call: Awaitable[T]) -> Finished[T] | Awaitable[T]:
    """Run ``call`` to its first suspension now: :class:`Finished` when it returned without
    suspending (nothing could cancel it or run in between), else an awaitable for the rest of
    it, to be awaited exactly once, at once or by a task made at once (the call is already
    waiting on whatever suspended it, a lock's queue say). An exception raised before the first
    suspension propagates here. :func:`within` and :func:`shielded` are built on it."""
    steps = call.__await__()
    try:
        first = steps.send(None)
    except StopIteration as done:
        return Finished(done.value)
    return _Resumed(steps, first)


async def _rest(resumed: Awaitable[T]) -> T:
    return await resumed


class _Resumed(Generic[T]):
    """The rest of a call already run to its first suspension (``first``: what it yielded)."""

    def __init__(self, steps: Generator[Any, Any, T], first: Any) -> None:
        self._steps = steps
        self._first = first

    def __await__(self) -> Generator[Any, Any, T]:
        steps, pending = self._steps, self._first
        while True:  # what ``yield from steps`` does, from its second step on
            try:
                sent = yield pending
            except GeneratorExit:
                steps.close()
                raise
            except BaseException as exc:  # a cancellation (the timeout's) goes to the call
                try:
                    pending = steps.throw(exc)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
            else:
                try:
                    pending = steps.send(sent)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
