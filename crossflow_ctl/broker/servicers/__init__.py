"""Thin grpc.aio servicers: proto in, one Broker call, proto out; domain errors -> status codes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any, ParamSpec, TypeVar

import grpc

from crossflow_ctl.domain.errors import (
    CrossflowError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
    Unauthenticated,
)

P = ParamSpec("P")
R = TypeVar("R")

STATUS_FOR: tuple[tuple[type[CrossflowError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
)


STORE_UNAVAILABLE_PREFIX = "store unavailable: "
"""Starts the message of every UNAVAILABLE the broker itself answers, so a client tells "the
broker's store is down" from "the broker cannot be reached" (gRPC's own UNAVAILABLE)."""


def status_message(exc: CrossflowError) -> str:
    """``field: detail``; store trouble is marked with :data:`STORE_UNAVAILABLE_PREFIX`."""
    if isinstance(exc, StoreUnavailable):
        return STORE_UNAVAILABLE_PREFIX + str(exc)
    return str(exc)


def status_for(exc: CrossflowError) -> grpc.StatusCode:
    for cls, code in STATUS_FOR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def maps_errors(
    method: Callable[P, Awaitable[R]],
) -> Callable[P, Awaitable[R]]:
    """Turn a CrossflowError raised by a unary handler into its status code and message.

    The message is ``field: detail`` so callers see which field was refused."""

    @wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except CrossflowError as exc:
            context: Any = args[-1]
            await context.abort(status_for(exc), status_message(exc))
            raise AssertionError("unreachable: abort raises") from exc

    return wrapper
