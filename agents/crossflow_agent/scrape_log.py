"""Say when telemetry fails, once, and again while it stays failed; say when it comes back.

A scrape failure only zeroes the lease (DESIGN.md §2); without a log line an operator with a
mistyped ``--metrics-url`` sees an agent that runs and a node that never lends. The first
failure of a kind is a warning naming the URL and the error, a still-failing source is repeated
every ``repeat_s``, and recovery is logged once.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

log = structlog.get_logger()


class ScrapeHealth:
    def __init__(self, source: str, now_s: Callable[[], float], repeat_s: float = 30.0) -> None:
        self.source = source
        self._now_s = now_s
        self.repeat_s = repeat_s
        self.failing: str | None = None
        self.failures = 0
        self._logged_at = 0.0

    def failed(self, kind: str, detail: str) -> None:
        self.failures += 1
        now = self._now_s()
        if kind != self.failing or now - self._logged_at >= self.repeat_s:
            log.warning(
                "scrape.failed",
                source=self.source,
                kind=kind,
                error=detail,
                failures=self.failures,
                effect="zero lease until telemetry returns",
            )
            self._logged_at = now
        self.failing = kind

    def ok(self) -> None:
        if self.failing is not None:
            log.info("scrape.recovered", source=self.source, after_failures=self.failures)
        self.failing, self.failures = None, 0
