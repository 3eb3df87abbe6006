"""Coalescing calls made together into batches: one store round trip per batch, not per call.

Fleet-scale paths (issue #11) make many small calls at once: every agent's lease, every woken
relay's notice read. :class:`Coalescer` gathers the calls made while a batch is in flight (and
those ready in the same loop turn) and hands them to ``run_batch`` as the next batch (one
pipeline), so a replica makes at most ``max_in_flight`` round trips at a time for them however
many callers wait, and holds as many connections. Each caller still gets its own reply or its
own error.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from crossflow_ctl.aio import detached_task

Call = TypeVar("Call")

MAX_BATCH = 256
"""Calls per pipeline: bounds one pipeline's time in Redis (other clients wait behind it)."""
MAX_IN_FLIGHT = 2
"""Pipelines in flight at once: calls of two batches may run in either order. Lease ingest:
two leases of one node never share a round of batches in practice (an agent's stream waits for
each ack); if they did, the monotonic check inside the script refuses whichever older one runs
second. Notice reads: a relay has one read in flight at a time."""


class Coalescer(Generic[Call]):
    """``await submit(call)`` -> that call's reply from ``run_batch`` (a list, one per call; an
    exception instance in a slot is raised to that caller only). Up to ``max_in_flight``
    batches run at once (the next one is encoded while Redis runs the last); calls made
    meanwhile form the next batch.

    ``timeout_s`` bounds each caller's wait with timers per BATCH, not per call: a call still
    queued ``timeout_s`` after it was submitted fails with TimeoutError when its turn comes,
    and a batch that runs longer than ``timeout_s`` fails its callers with TimeoutError (the
    calls may still land). So no caller waits much more than twice ``timeout_s``."""

    def __init__(
        self,
        run_batch: Callable[[Sequence[Call]], Awaitable[list[Any]]],
        max_batch: int = MAX_BATCH,
        max_in_flight: int = MAX_IN_FLIGHT,
        timeout_s: float | None = None,
    ) -> None:
        self._run_batch = run_batch
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._timeout_s = timeout_s
        self._pending: list[tuple[Call, asyncio.Future[Any], float]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop of the last submit, while it runs (see :meth:`submit`)."""
        self.batches = 0
        """Pipelines sent (a test reads it to see calls coalesce)."""

    def submit(self, call: Call) -> asyncio.Future[Any]:
        """Queue ``call``; the future its reply (or error) lands in. Not a coroutine: a lease
        passes no await layer of its own here (the caller awaits the future).

        The future is made on the loop of the last submit while that loop runs (every call
        comes from one loop at a time): on Python 3.11 ``asyncio.get_running_loop`` makes a
        ``getpid`` system call each time (fork detection), once per lease on ingest; what that
        costs depends on the host's system calls (about 0.1 us here, more under a profiler or a
        sandbox)."""
        loop = self._loop
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((call, future, time.monotonic()))
        if len(self._tasks) < self._max_in_flight:
            task = detached_task(self._drain(), name="crossflow-coalescer")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return future

    def _take(self) -> list[tuple[Call, asyncio.Future[Any]]]:
        """The next batch: calls still waiting, in order; those queued past the deadline fail."""
        batch = self._pending[: self._max_batch]
        del self._pending[: self._max_batch]
        oldest = -math.inf if self._timeout_s is None else time.monotonic() - self._timeout_s
        live = []
        for call, fut, submitted in batch:
            if fut.done():
                continue
            if submitted <= oldest:
                fut.set_exception(TimeoutError(f"queued over {self._timeout_s} s"))
            else:
                live.append((call, fut))
        return live

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # calls that are ready in this loop turn join the first batch
        while self._pending:
            live = self._take()
            if not live:
                continue
            self.batches += 1
            try:
                async with asyncio.timeout(self._timeout_s):
                    replies = await self._run_batch([call for call, _ in live])
            except asyncio.CancelledError:
                for fut in [f for _, f in live] + [f for _, f, _ in self._pending]:
                    fut.cancel()
                self._pending.clear()
                raise
            except Exception as exc:  # the whole pipeline failed: every caller gets the error
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), reply in zip(live, replies, strict=True):
                if fut.done():
                    continue  # the caller gave up (its deadline); the call may still have run
                if isinstance(reply, BaseException):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
