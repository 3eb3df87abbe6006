"""Scrape an engine's Prometheus ``/metrics`` over HTTP and read it into a snapshot."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import httpx

from crossflow_agent.sources.base import ScrapeError
from crossflow_agent.sources.prom import Exposition, Window, parse
from crossflow_ctl.domain.clock import Clock, SystemClock
from crossflow_ctl.domain.telemetry import EngineSnapshot

MAX_BODY_BYTES = 16 * 1024 * 1024


class Reader(Protocol):
    """Engine-specific mapping from metric names to snapshot fields."""

    name: str

    def read(
        self,
        now: Exposition,
        before: Exposition | None,
        window: Window,
        window_s: float,
        taken_at_ms: int,
    ) -> EngineSnapshot: ...


class PrometheusSource:
    """A telemetry source over an engine's ``/metrics`` endpoint."""

    def __init__(
        self,
        url: str,
        reader: Reader,
        *,
        timeout_s: float = 1.0,
        clock: Clock | None = None,
        client: httpx.AsyncClient | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.name = reader.name
        self._reader = reader
        self._clock = clock or SystemClock()
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._window = Window()
        self._monotonic = monotonic

    async def fetch(self) -> str:
        try:
            resp = await self._client.get(self.url)
        except httpx.TimeoutException as exc:
            raise ScrapeError("timeout", f"{self.url}: timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise ScrapeError("unreachable", f"{self.url}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise ScrapeError("http_error", f"{self.url}: HTTP {resp.status_code}")
        if len(resp.content) > MAX_BODY_BYTES:
            raise ScrapeError("parse", f"{self.url}: body over {MAX_BODY_BYTES} bytes")
        return resp.text

    async def scrape(self) -> EngineSnapshot:
        text = await self.fetch()
        taken_at_ms = self._clock.now_ms()
        return read_text(self._reader, self._window, text, taken_at_ms, self._monotonic())

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()


def read_text(
    reader: Reader, window: Window, text: str, taken_at_ms: int, now_s: float
) -> EngineSnapshot:
    """Parse one exposition and read it against the previous one held in ``window``."""
    expo = parse(text)
    before, window_s = window.advance(expo, now_s)
    return reader.read(expo, before, window, window_s, taken_at_ms)
