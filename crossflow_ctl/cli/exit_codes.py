"""Exit codes scripts can rely on, and the one-line error every failure prints.

    0  OK           the command did what it was asked
    1  ERROR        anything else: a refused state change, an unexpected failure
    2  USAGE        bad flags or arguments, or a value the server refused as invalid
    3  NOT_FOUND    the named node or reservation does not exist
    4  UNAVAILABLE  the broker could not be reached (wrong address, down, TLS refused)
    5  TIMEOUT      a wait (``drain --timeout``) ran out before the state was reached
    6  DENIED       the broker refused the caller: no valid identity, or not permitted

Every error is printed to stderr as one line, ``error: <what went wrong>``.
"""

from __future__ import annotations

from enum import IntEnum

from pydantic import ValidationError

from crossflow_ctl.domain.errors import (
    ConfigError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from crossflow_ctl.settings_sources import refusal_text


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    NOT_FOUND = 3
    UNAVAILABLE = 4
    TIMEOUT = 5
    DENIED = 6


class CliError(Exception):
    """A failure the CLI reports in one line with a chosen exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.ERROR) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, Unavailable | ConnectionError | TimeoutError):
        return True
    name = type(exc).__name__.lower()
    return "unavailable" in name or "connect" in name or "deadline" in name


def exit_code_for(exc: BaseException) -> ExitCode:
    """The documented exit code for an error raised by a command."""
    if isinstance(exc, CliError):
        return exc.code
    if isinstance(exc, NotFound):
        return ExitCode.NOT_FOUND
    if isinstance(exc, PermissionDenied | Unauthenticated):
        return ExitCode.DENIED
    if isinstance(exc, InvalidArgument | ConfigError | ValidationError):
        return ExitCode.USAGE
    if _is_unavailable(exc):
        return ExitCode.UNAVAILABLE
    return ExitCode.ERROR


def one_line(exc: BaseException) -> str:
    """The error as a single line of text, never a traceback (a model's refusal as its first
    field and message, not pydantic's multi-line report)."""
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or exc.title
        exc = InvalidArgument(refusal_text(err), field=field)
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"error: {text}"
