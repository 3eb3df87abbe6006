"""Repeated warnings are rate-limited: one line per event per interval, with the count dropped."""

from __future__ import annotations

import io
import json

import structlog

from crossflow_ctl.observability import setup_logging
from crossflow_ctl.observability.logs import RepeatedLines, reset_logging


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_one_line_per_event_per_interval_with_the_count_dropped() -> None:
    clock = FakeTime()
    stream = io.StringIO()
    setup_logging(json=True, level="debug", stream=stream)
    limiter = RepeatedLines(interval_s=1.0, clock=clock)
    # the configured chain with this limiter (its clock) in place of the default one
    processors = structlog.get_config()["processors"]
    structlog.configure(processors=[limiter, *processors[1:]])
    log = structlog.get_logger()
    try:
        for _ in range(570):  # what a hung Redis wrote per second
            log.warning("admit.timeout", timeout_ms=50)
            log.warning("admit.store_unavailable", error="down")
            log.debug("admit.decided")  # lower levels pass untouched
            clock.now += 0.0015
        clock.now += 0.2
        log.warning("admit.timeout", timeout_ms=50)
        log.error("admit.timeout")  # another level: another event
    finally:
        reset_logging()
    lines = _lines(stream)
    warnings = [x for x in lines if x["level"] == "warning"]
    assert [(x["event"], x.get("suppressed")) for x in warnings] == [
        ("admit.timeout", None),
        ("admit.store_unavailable", None),
        ("admit.timeout", 569),
    ]
    assert sum(1 for x in lines if x["event"] == "admit.decided") == 570
    assert [x["event"] for x in lines if x["level"] == "error"] == ["admit.timeout"]


def test_the_limit_is_bounded_and_can_be_turned_off() -> None:
    clock = FakeTime()
    limiter = RepeatedLines(interval_s=1.0, clock=clock, max_events=4)
    for n in range(10):
        assert limiter(None, "warning", {"event": f"e{n}"}) == {"event": f"e{n}"}
    assert len(limiter._events) <= 4

    stream = io.StringIO()
    setup_logging(json=True, level="info", stream=stream, repeat_interval_s=0)
    try:
        for _ in range(3):
            structlog.get_logger().warning("same")
    finally:
        reset_logging()
    assert [x["event"] for x in _lines(stream)] == ["same"] * 3
