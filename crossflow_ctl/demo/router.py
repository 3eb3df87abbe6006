"""The demo's router: replays a trace through the Admission API and drives the fake engines.

Each released turn goes through the client's :class:`AdmissionQueue` (late binding): offered
once; when the broker says no room while the prefill pool is behind, it is held and re-offered
as the broker's WatchRoom stream shows room, until the router's model says prefill has room or
``max_hold_ms`` passes. BORROW: Commit, send the whole request to the chosen decode node's
engine (its prompt marked borrowed), Release when the router's model says the borrowed prefill
is done. NORMAL: send the prompt to the least-busy prefill engine, then the decode to a decode
engine. TTFT comes from :mod:`crossflow_ctl.demo.model` (time held counts in it); a session's
next turn is released when this one finished plus its think time (closed loop). ``speed``
compresses arrivals and think times (more load on the same servers), never service times.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from crossflow_ctl.aio import wait_any
from crossflow_ctl.client import (
    AdmissionClient,
    AdmissionQueue,
    Dispatch,
    Outcome,
    QueueConfig,
)
from crossflow_ctl.demo.model import ClusterModel, ModelParams, Release, first_releases
from crossflow_ctl.demo.trace import Trace, Turn
from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.errors import CrossflowError

log = structlog.get_logger()


@dataclass(frozen=True)
class Engine:
    node_id: str
    url: str


@dataclass
class RouterStats:
    released: int = 0
    finished: int = 0
    borrowed: int = 0
    admit_errors: int = 0
    engine_errors: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    ttft_by_request: dict[tuple[str, int], float] = field(default_factory=dict)
    borrowed_ttft_ms: list[float] = field(default_factory=list)
    borrowed_by_node: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    dispatch: dict[str, int] = field(default_factory=dict)
    """Outcomes of the admission queue by cause (borrowed, borrowed_late, deadline, ...)."""
    held_ms: list[float] = field(default_factory=list)
    """Time each held prompt waited in the admission queue."""
    uncached_tokens: int = 0
    borrowed_uncached_tokens: int = 0
    path_by_request: dict[tuple[str, int], str] = field(default_factory=dict)
    """How each request went: ``borrowed``, ``normal`` (sent to prefill with the first
    answer) or ``held`` (held for room by late binding, then sent to prefill)."""

    @property
    def borrowed_share(self) -> float:
        return self.borrowed / self.released if self.released else 0.0


class Router:
    def __init__(
        self,
        trace: Trace,
        admission: AdmissionClient,
        prefill: list[Engine],
        decode: list[Engine],
        params: ModelParams,
        *,
        speed: float = 1.0,
        max_hold_ms: int = 300,
        prefill_room_ms: float = 100.0,
    ) -> None:
        self.trace = trace
        self.admission = admission
        self.prefill_room_ms = prefill_room_ms
        self._booked_tokens = 0
        """Uncached tokens the queue sent to prefill that the model has not queued yet."""
        self.queue = AdmissionQueue(
            admission,
            QueueConfig(max_hold_ms=max_hold_ms),
            prefill_room=self._prefill_has_room,
            on_outcome=self._dispatched,
        )
        self.prefill = prefill
        self.decode = {e.node_id: e for e in decode}
        self.params = params
        self.speed = speed
        self.model = ClusterModel(params)
        self.stats = RouterStats()
        self.open_reservations: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heap: list[tuple[float, int, Release]] = []
        self._seq = itertools.count()
        self._decode_rr = itertools.cycle(sorted(self.decode))
        self._wake = asyncio.Event()
        self._t0 = 0.0
        self._http = httpx.AsyncClient(timeout=2.0)

    def now_s(self) -> float:
        """Seconds since the replay began (the model and the engines share this clock)."""
        return time.monotonic() - self._t0

    def _push(self, at_s: float, release: Release) -> None:
        heapq.heappush(self._heap, (at_s, next(self._seq), release))
        self._wake.set()

    @property
    def done(self) -> bool:
        return not self._heap and not self._tasks

    async def run(self, stop: asyncio.Event) -> None:
        """Replay until the trace is done or ``stop`` is set."""
        self._t0 = time.monotonic()
        for r in first_releases(self.trace, self.params, self.speed):
            self._push(r.at_s, r)
        queue = asyncio.create_task(self.queue.run(self.admission.room_updates()))
        try:
            while not stop.is_set() and not self.done:
                if not self._heap:
                    self._wake.clear()
                    await wait_any(stop, self._wake, timeout_s=0.5)
                    continue
                at_s, _, rel = self._heap[0]
                delay = at_s - self.now_s()
                if delay > 0:
                    self._wake.clear()
                    await wait_any(stop, self._wake, timeout_s=min(delay, 0.5))
                    continue
                heapq.heappop(self._heap)
                self._spawn(self._handle(rel))
        finally:
            queue.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await queue
            await self.close()

    def _prefill_has_room(self, request: AdmissionRequest) -> bool:
        """The model's prefill wait (with what was just sent there) is under prefill_room_ms;
        taking the prompt books it, so one pass does not send a burst."""
        p = self.params
        rate = p.prefill_rate_tps * max(1, len(self.model.prefill_free_s))
        free = min(self.model.prefill_free_s, default=0.0)
        wait_s = max(0.0, free - self.now_s()) + self._booked_tokens / rate
        if wait_s * 1000.0 > self.prefill_room_ms:
            return False
        self._booked_tokens += request.uncached_prompt_tokens
        return True

    def _dispatched(self, outcome: Outcome) -> None:
        cause = outcome.dispatch.value
        self.stats.dispatch[cause] = self.stats.dispatch.get(cause, 0) + 1
        if outcome.held:
            self.stats.held_ms.append(float(outcome.held_ms))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel what is in flight, release every reservation still open, close HTTP."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for rid in list(self.open_reservations):
            with contextlib.suppress(CrossflowError):
                await self.admission.release(rid, "cancelled")
            self.open_reservations.discard(rid)
        await self._http.aclose()

    async def _handle(self, rel: Release) -> None:
        turn = rel.session.turns[rel.index]
        arrival = self.now_s()
        self.stats.released += 1
        self.stats.uncached_tokens += turn.uncached_tokens
        request = AdmissionRequest(
            request_id=f"{rel.session.session_id}/{rel.index}",
            uncached_prompt_tokens=turn.uncached_tokens,
            cached_prefix_tokens=turn.cached_tokens,
            expected_output_tokens=turn.output_tokens,
        )
        booked = 0
        outcome_held = False
        try:
            outcome = await (await self.queue.submit(request))
            admission = outcome.admission
            outcome_held = outcome.held
            if outcome.dispatch is Dispatch.PREFILL_ROOM:
                booked = turn.uncached_tokens
        except CrossflowError as exc:
            self.stats.admit_errors += 1
            log.warning("demo.admit_failed", error=str(exc))
            admission = Admission.normal(Reason.STORE_UNAVAILABLE, str(exc))
        self.stats.reasons[admission.reason.value] = (
            self.stats.reasons.get(admission.reason.value, 0) + 1
        )
        self._booked_tokens = max(0, self._booked_tokens - booked)
        key = (rel.session.session_id, rel.index)
        if admission.decision is Decision.BORROW and admission.node_id in self.decode:
            ttft_s, borrowed = await self._borrow(turn, admission, arrival)
        else:
            ttft_s, borrowed = await self._normal(turn, arrival), False
        self.stats.path_by_request[key] = (
            "borrowed" if borrowed else "held" if outcome_held else "normal"
        )
        self.stats.ttft_ms.append(ttft_s * 1000.0)
        self.stats.ttft_by_request[key] = ttft_s * 1000.0
        finish = arrival + ttft_s + self.model.decode_s(turn)
        await self._sleep_until(finish)
        self.stats.finished += 1
        if rel.index + 1 < len(rel.session.turns):
            nxt = rel.session.turns[rel.index + 1]
            self._push(finish + nxt.think_s / self.speed, Release(0.0, rel.session, rel.index + 1))

    async def _borrow(self, turn: Turn, a: Admission, arrival: float) -> tuple[float, bool]:
        """(TTFT seconds, whether it was borrowed: False when the commit failed)."""
        rid = a.reservation_id
        self.open_reservations.add(rid)
        try:
            await self.admission.commit(rid)
        except CrossflowError:
            # Expired or refused between Admit and Commit: take the normal path instead.
            self.open_reservations.discard(rid)
            return await self._normal(turn, arrival), False
        self.stats.borrowed += 1
        self.stats.borrowed_uncached_tokens += turn.uncached_tokens
        self.stats.borrowed_by_node[a.node_id] = self.stats.borrowed_by_node.get(a.node_id, 0) + 1
        service_ms, wait_ms = a.predicted_ttft_ms, 0.0
        if a.plan is not None:
            for check in a.plan.nodes:
                if check.node_id == a.node_id:
                    service_ms, wait_ms = check.service_ms, check.queue_wait_ms
        now = self.now_s()
        ttft_s = now - arrival
        ttft_s += self.model.borrowed(now, a.node_id, service_ms / 1000.0, wait_ms / 1000.0)
        self.stats.borrowed_ttft_ms.append(ttft_s * 1000.0)
        await self._post(self.decode[a.node_id], turn, borrowed=True)
        self._spawn(self._release_at(rid, arrival + ttft_s))
        return ttft_s, True

    async def _release_at(self, rid: str, at_s: float) -> None:
        await self._sleep_until(at_s)
        try:
            await self.admission.release(rid, "finished")
        except CrossflowError as exc:
            log.warning("demo.release_failed", reservation_id=rid, error=str(exc))
        self.open_reservations.discard(rid)

    async def _normal(self, turn: Turn, arrival: float) -> float:
        now = self.now_s()
        idx, ttft_s = self.model.normal(now, turn)
        ttft_s += now - arrival
        await self._post(self.prefill[idx % len(self.prefill)], turn, prefill_only=True)
        self._spawn(self._decode_after(turn, arrival + ttft_s))
        return ttft_s

    async def _decode_after(self, turn: Turn, at_s: float) -> None:
        await self._sleep_until(at_s)
        await self._post(self.decode[next(self._decode_rr)], turn, kv_arrived=True)

    async def _post(
        self,
        engine: Engine,
        turn: Turn,
        *,
        borrowed: bool = False,
        prefill_only: bool = False,
        kv_arrived: bool = False,
    ) -> None:
        prompt = max(1, turn.uncached_tokens + turn.cached_tokens)
        body = {
            "prompt_tokens": prompt,
            # The normal path's decode arrives with its KV: no prompt work left on the node.
            "cached_tokens": prompt if kv_arrived else min(turn.cached_tokens, prompt),
            "output_tokens": 1 if prefill_only else max(1, turn.output_tokens),
            "borrowed": borrowed,
        }
        try:
            resp = await self._http.post(f"{engine.url}/requests", json=body)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            self.stats.engine_errors += 1
            log.warning("demo.engine_post_failed", engine=engine.node_id, error=str(exc))

    async def _sleep_until(self, at_s: float) -> None:
        delay = at_s - self.now_s()
        if delay > 0:
            await asyncio.sleep(delay)
