"""The demo's client: replays a trace as real streamed completions through the gateway.

Each released turn is one ``POST /v1/completions`` (``stream: true``) to ``crossflow-gateway``
whose prompt has as many words as the turn has prompt tokens (:mod:`.prompts`: a session's turns
share their prefix) and whose ``max_tokens`` is the turn's output tokens (capped by
``max_output_tokens``). TTFT is measured here, from sending the request to the first streamed
chunk that carries text, and so is the request's whole time. Which path a request took, and on
which decode engine, is the gateway's word (its ``X-Crossflow-Path`` and ``X-Crossflow-Node``
headers), never a guess. A session's next turn is released when this one has finished plus its
think time (closed loop); ``speed`` compresses arrivals and think times (more load on the same
servers), never service times.

A request that does not end in a complete answer (an error status, an error event, a stream cut
before ``[DONE]``) is *lost*; requests still in flight when the replay is stopped are neither
finished nor lost (they are cancelled, which the gateway sees as a client that went away).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog

from crossflow_ctl.aio import wait_any
from crossflow_ctl.demo.prompts import Prompts
from crossflow_ctl.demo.trace import Release, Trace, first_releases

log = structlog.get_logger()

PATH_HEADER = "X-Crossflow-Path"
NODE_HEADER = "X-Crossflow-Node"
REQUEST_TIMEOUT_S = 300.0
Key = tuple[str, int]


@dataclass
class RunStats:
    """What one replay measured, request by request (keyed by session and turn)."""

    released: int = 0
    finished: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)
    """The first few lost requests' reasons."""
    ttft_by_request: dict[Key, float] = field(default_factory=dict)
    """Milliseconds from sending the request to its first streamed text."""
    total_by_request: dict[Key, float] = field(default_factory=dict)
    """Milliseconds from sending the request to its last byte."""
    path_by_request: dict[Key, str] = field(default_factory=dict)
    node_by_request: dict[Key, str] = field(default_factory=dict)
    uncached_tokens: int = 0
    """The trace's uncached prompt tokens of the requests finished."""
    cached_tokens: int = 0
    """The trace's cached prompt tokens of the requests finished."""
    borrowed_uncached_tokens: int = 0
    output_tokens: int = 0
    """Streamed chunks with text, over the requests finished."""

    @property
    def ttft_ms(self) -> list[float]:
        return list(self.ttft_by_request.values())

    @property
    def borrowed(self) -> int:
        return sum(1 for p in self.path_by_request.values() if p == "borrowed")

    @property
    def borrowed_share(self) -> float:
        return self.borrowed / self.finished if self.finished else 0.0

    def borrowed_by_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, path in self.path_by_request.items():
            if path == "borrowed":
                node = self.node_by_request.get(key, "?")
                out[node] = out.get(node, 0) + 1
        return out


class RequestLost(Exception):
    """The request did not end in a complete answer."""


class Router:
    """Replays ``trace`` through the gateway at ``gateway_url``; :meth:`run` until done."""

    def __init__(
        self,
        trace: Trace,
        gateway_url: str,
        *,
        salt: str,
        speed: float = 1.0,
        max_output_tokens: int | None = None,
        until_s: float | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.trace = trace
        self.url = f"{gateway_url.rstrip('/')}/v1/completions"
        self.prompts = Prompts(salt)
        self.speed = speed
        self.max_output_tokens = max_output_tokens
        self.until_s = until_s
        """Release no turn after this many seconds (a replay cut as another was)."""
        self.request_timeout_s = request_timeout_s
        self.stats = RunStats()
        self._tasks: set[asyncio.Task[None]] = set()
        self._heap: list[tuple[float, int, Release]] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._t0 = 0.0
        self._stopping = False

    def now_s(self) -> float:
        """Seconds since the replay began."""
        return time.monotonic() - self._t0

    def _push(self, release: Release) -> None:
        if self.until_s is not None and release.at_s > self.until_s:
            return
        heapq.heappush(self._heap, (release.at_s, next(self._seq), release))
        self._wake.set()

    @property
    def done(self) -> bool:
        return not self._heap and not self._tasks

    async def run(self, stop: asyncio.Event) -> None:
        """Replay until the trace is done or ``stop`` is set (requests in flight are then
        cancelled: the gateway sees their clients go away)."""
        self._t0 = time.monotonic()
        for release in first_releases(self.trace, self.speed):
            self._push(release)
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            try:
                while not stop.is_set() and not self.done:
                    if not self._heap:
                        self._wake.clear()
                        await wait_any(stop, self._wake, timeout_s=0.5)
                        continue
                    at_s, _, release = self._heap[0]
                    delay = at_s - self.now_s()
                    if delay > 0:
                        self._wake.clear()
                        await wait_any(stop, self._wake, timeout_s=min(delay, 0.5))
                        continue
                    heapq.heappop(self._heap)
                    self._spawn(self._turn(http, release))
            finally:
                self._stopping = True
                for task in list(self._tasks):
                    task.cancel()
                for task in list(self._tasks):
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def body(self, release: Release) -> dict[str, Any]:
        turn = release.turn
        out = max(1, turn.output_tokens)
        if self.max_output_tokens is not None:
            out = min(out, self.max_output_tokens)
        return {
            "prompt": self.prompts.text(release.session, release.index),
            "max_tokens": out,
            "stream": True,
        }

    async def _turn(self, http: aiohttp.ClientSession, release: Release) -> None:
        stats = self.stats
        stats.released += 1
        body = self.body(release)
        key = release.key
        try:
            await self._complete(http, key, body)
        except (RequestLost, aiohttp.ClientError, TimeoutError) as exc:
            if self._stopping:
                return
            stats.lost += 1
            if len(stats.errors) < 5:
                stats.errors.append(f"{key[0]}/{key[1]}: {type(exc).__name__}: {exc}")
            log.warning("demo.request_lost", request=f"{key[0]}/{key[1]}", error=str(exc))
        else:
            stats.finished += 1
            turn = release.turn
            stats.uncached_tokens += turn.uncached_tokens
            stats.cached_tokens += turn.cached_tokens
            if stats.path_by_request.get(key) == "borrowed":
                stats.borrowed_uncached_tokens += turn.uncached_tokens
        if release.index + 1 == len(release.session.turns):
            self.prompts.forget(release.session)
        following = release.next(self.now_s(), self.speed)
        if following is not None:
            self._push(following)

    async def _complete(self, http: aiohttp.ClientSession, key: Key, body: dict[str, Any]) -> None:
        sent = time.perf_counter()
        first: float | None = None
        chunks = 0
        async with http.post(self.url, json=body) as resp:
            if resp.status != 200:
                raise RequestLost(f"gateway answered {resp.status}: {(await resp.text())[:200]}")
            path = resp.headers.get(PATH_HEADER, "?")
            node = resp.headers.get(NODE_HEADER, "?")
            complete = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    # read on to the end: a client that hangs up before the last byte is one
                    # that went away, for the gateway (its handler is cancelled, uncounted)
                    complete = True
                    continue
                if first is None or b'"error"' in data:
                    event = json.loads(data)
                    if "error" in event:
                        raise RequestLost(f"error event: {event['error']}")
                    if first is None and any(c.get("text") for c in event.get("choices", [])):
                        first = time.perf_counter()
                chunks += 1
            if not complete:
                raise RequestLost("stream ended before [DONE]")
        done = time.perf_counter()
        if first is None:
            raise RequestLost("no text streamed")
        stats = self.stats
        stats.ttft_by_request[key] = (first - sent) * 1000.0
        stats.total_by_request[key] = (done - sent) * 1000.0
        stats.path_by_request[key] = path
        stats.node_by_request[key] = node
        stats.output_tokens += chunks
