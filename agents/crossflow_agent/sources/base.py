"""What a telemetry source is, and how it fails."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from crossflow_ctl.domain.errors import CrossflowError
from crossflow_ctl.domain.step_windows import StepTotals
from crossflow_ctl.domain.telemetry import EngineSnapshot


class ScrapeError(CrossflowError):
    """A scrape that gave no snapshot; ``kind`` is one of the agent's scrape-failure reasons:
    unreachable, timeout, http_error, parse."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class TelemetrySource(Protocol):
    """An engine's telemetry: each scrape returns a snapshot stamped with its time."""

    name: str

    async def scrape(self) -> EngineSnapshot:
        """One snapshot, or ScrapeError."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class StepCounting(Protocol):
    """A source that also reads the engine's step counters (online calibration)."""

    def step_totals(self) -> StepTotals | None:
        """The counters of the last scrape that gave a snapshot (None: none told)."""
        ...
