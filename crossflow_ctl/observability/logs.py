"""structlog configuration: JSON (or console) lines carrying the current trace and span ids."""

from __future__ import annotations

import logging
import sys
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
    json: bool = True, level: str | int = "info", *, stream: TextIO | None = None
) -> None:
    """Configure structlog (and route stdlib logging through the same renderer) once per process.

    Lines go to ``stream`` (stderr by default), one JSON object per line when ``json``.
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
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), *exc, renderer],
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
