"""Runs a :class:`SyntheticEngine` in real time for the requests that follow their jobs.

A background task advances the engine whenever its next step is due (the engine says when) and
each followed job's :class:`Run` wakes its waiters as the job changes, so tokens come out at the
wall-clock times the step model gives them. The task sleeps while nothing is followed. A run
whose prompt KV is complete puts its prompt's blocks in the prefix cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from crossflow_agent.fake_engine.prefix_cache import PrefixCache
from crossflow_agent.sources.synthetic import EngineRequest, Job, JobState, SyntheticEngine
from crossflow_ctl.aio import cancel_and_wait, detached_task

MIN_SLEEP_S = 0.0005
MAX_SLEEP_S = 0.05
"""Bounds of the driver's sleep between advances while runs are followed."""


class Run:
    """One followed engine job. ``settled``: it ended, or it holds its KV (exported)."""

    def __init__(self, driver: EngineDriver, hashes: Sequence[bytes]) -> None:
        self._driver = driver
        self._hashes = hashes
        self._changed = asyncio.Event()
        self.job: Job | None = None

    @property
    def settled(self) -> bool:
        job = self.job
        return job is not None and (job.ended or job.state is JobState.HELD)

    async def changed(self) -> None:
        """Wait for the next change of the job (returns at once if one came since last time)."""
        await self._changed.wait()
        self._changed.clear()

    async def settle(self) -> Job:
        while not self.settled:
            await self.changed()
        assert self.job is not None
        return self.job

    def on_change(self, job: Job) -> None:
        self.job = job
        if self._hashes and job.prompt_done_s is not None:
            self._driver.cache.insert(self._hashes)
            self._hashes = ()
        if self.settled:
            self._driver.forget(self)
        self._changed.set()


class EngineDriver:
    def __init__(self, engine: SyntheticEngine, cache: PrefixCache) -> None:
        self.engine = engine
        self.cache = cache
        self._active: set[Run] = set()
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = detached_task(self._drive(), "fake-engine-driver")

    async def close(self) -> None:
        """Abort every followed job that has not settled, and stop the task."""
        for run in list(self._active):
            self.abort(run)
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    def submit(
        self,
        request: EngineRequest,
        *,
        hashes: Sequence[bytes] = (),
        kv_transferred: bool = False,
        keep_kv: bool = False,
    ) -> Run:
        """Queue a followed job (OverflowError when the engine's queue is full)."""
        run = Run(self, hashes)
        self._active.add(run)
        try:
            run.job = self.engine.submit(
                request, kv_transferred=kv_transferred, keep_kv=keep_kv, listener=run.on_change
            )
        except BaseException:
            self._active.discard(run)
            raise
        self._nudge()
        return run

    def abort(self, run: Run) -> None:
        if run.job is not None and not run.job.ended:
            self.engine.abort(run.job)
            self._nudge()

    def release(self, run: Run) -> None:
        if run.job is not None:
            self.engine.release(run.job)
            self._nudge()

    def forget(self, run: Run) -> None:
        self._active.discard(run)

    def _nudge(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            delay: float | None = None
            if self._active:
                self.engine.advance()
                due = self.engine.next_due_s()
                delay = MAX_SLEEP_S
                if due is not None:
                    delay = min(max(due - self.engine.now_s(), MIN_SLEEP_S), MAX_SLEEP_S)
            self._wake = loop.create_future()
            timer = None if delay is None else loop.call_later(delay, self._nudge)
            try:
                await self._wake
            finally:
                if timer is not None:
                    timer.cancel()
                self._wake = None
