"""Scrape an engine's Prometheus ``/metrics`` over HTTP and read it into a snapshot (and, for
online calibration, the engine's step counters: :meth:`PrometheusSource.step_totals`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import httpx

from crossflow_agent.sources.base import ScrapeError
from crossflow_agent.sources.prom import Exposition, Window, parse
from crossflow_ctl.domain.clock import Clock, SystemClock
from crossflow_ctl.domain.step_windows import StepTotals
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

    def totals(self, now: Exposition, at_s: float) -> StepTotals | None:
        """The engine's step counters in ``now`` (None: it exports none)."""
        ...


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
        self._totals: StepTotals | None = None

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
        self._totals = None
        text = await self.fetch()
        taken_at_ms = self._clock.now_ms()
        snapshot, self._totals = read_with_totals(
            self._reader, self._window, text, taken_at_ms, self._monotonic()
        )
        return snapshot

    def step_totals(self) -> StepTotals | None:
        """The step counters of the last scrape that gave a snapshot (None: it failed, or the
        engine exports none)."""
        return self._totals

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()


def read_text(
    reader: Reader, window: Window, text: str, taken_at_ms: int, now_s: float
) -> EngineSnapshot:
    """Parse one exposition and read it against the previous one held in ``window``."""
    return read_with_totals(reader, window, text, taken_at_ms, now_s)[0]


def read_with_totals(
    reader: Reader, window: Window, text: str, taken_at_ms: int, now_s: float
) -> tuple[EngineSnapshot, StepTotals | None]:
    """:func:`read_text`, and the step counters of the same exposition (taken at ``now_s``)."""
    expo = parse(text)
    before, window_s = window.advance(expo, now_s)
    snapshot = reader.read(expo, before, window, window_s, taken_at_ms)
    return snapshot, reader.totals(expo, now_s)
