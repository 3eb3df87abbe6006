"""structlog configuration: JSON (or console) lines carrying the current trace and span ids, with
repeated warnings and errors rate-limited (:class:`RepeatedLines`)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

import structlog
from opentelemetry import trace
from structlog.typing import EventDict, Processor, WrappedLogger

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
LEVELS |= {"error": logging.ERROR, "critical": logging.CRITICAL}


def add_trace_context(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """``trace_id`` and ``span_id`` (lowercase hex, W3C form) of the current span, if any."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


REPEAT_INTERVAL_S = 1.0
"""Least time between two lines of one event at warning level or above (:class:`RepeatedLines`)."""
_LIMITED = frozenset({"warning", "warn", "error", "exception", "critical", "fatal"})


class RepeatedLines:
    """A structlog processor writing at most one line per interval for each event (its name and
    level) at warning level or above; the lines it drops are counted, and the next line of that
    event written says how many as ``suppressed`` (dropped since the event's last line).

    An outage repeats the same few warnings for every request (a hung Redis wrote ~570 lines a
    second); each still shows within an interval of its first occurrence, and its count
    survives. Lower levels pass untouched (per-decision debug lines are asked for)."""

    def __init__(
        self,
        interval_s: float = REPEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        max_events: int = 1_024,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._max_events = max_events
        self._events: dict[tuple[str, str], list[float | int]] = {}
        """(level, event) -> [time of its last line written, lines dropped since]."""

    def __call__(self, _logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
        if method not in _LIMITED:
            return event_dict
        key = (method, str(event_dict.get("event", "")))
        now = self._clock()
        seen = self._events.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            raise structlog.DropEvent
        if seen is not None and seen[1]:
            event_dict["suppressed"] = int(seen[1])
        if seen is None and len(self._events) >= self._max_events:
            self._events.clear()  # bounded: events with ever-new names cannot grow it
        self._events[key] = [now, 0]
        return event_dict


_GRPC_CORE = "grpc._cython.cygrpc"
_PEER_GONE = "ExecuteBatchError raised in core by servicer method"


class PeerGone(logging.Filter):
    """grpc.aio logs an ERROR with a traceback when a streaming handler writes to a call whose
    peer has just gone (an agent or router closing its stream mid-write): a race no handler can
    close, and nothing an operator can act on. It becomes one INFO line, ``stream.peer_gone``
    naming the method, kept only when INFO is logged."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == _GRPC_CORE and str(record.msg).startswith(_PEER_GONE):
            method = str(record.msg).rpartition("[")[2].rstrip("]")
            record.msg, record.args = "stream.peer_gone", None
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
            record.__dict__["method"] = method
            return self.threshold <= logging.INFO
        return True


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    try:
        return LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; use one of {sorted(LEVELS)}") from None


def setup_logging(
    json: bool = True,
    level: str | int = "info",
    *,
    stream: TextIO | None = None,
    repeat_interval_s: float = REPEAT_INTERVAL_S,
) -> None:
    """Configure structlog (and route stdlib logging through the same renderer) once per process.

    Lines go to ``stream`` (stderr by default), one JSON object per line when ``json``; one line
    per warning (or error) event per ``repeat_interval_s`` (:class:`RepeatedLines`; 0: all).
    """
    numeric = _level(level)
    out = stream if stream is not None else sys.stderr
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_context,
    ]
    renderer: Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    exc: list[Processor] = [structlog.processors.format_exc_info] if json else []
    limit: list[Processor] = [RepeatedLines(repeat_interval_s)] if repeat_interval_s > 0 else []
    structlog.configure(
        processors=[*limit, *shared, structlog.processors.StackInfoRenderer(), *exc, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                *shared,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(allow=("method",)),
                *exc,
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_crossflow", False)]:
        root.removeHandler(old)
    handler.addFilter(PeerGone(max(numeric, logging.INFO)))
    handler._crossflow = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(max(numeric, logging.INFO))  # third-party debug noise stays out


def reset_logging() -> None:
    """Undo :func:`setup_logging` (tests)."""
    structlog.reset_defaults()
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_crossflow", False)]:
        root.removeHandler(old)
