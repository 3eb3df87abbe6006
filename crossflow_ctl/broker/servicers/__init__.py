"""Thin grpc.aio servicers: proto in, one Broker call, proto out; domain errors -> status codes.

Every refusal carries, besides ``field: detail`` in the status message, a ``google.rpc.Status``
in the trailers (grpcio-status) with a ``google.rpc.BadRequest`` naming the field for
INVALID_ARGUMENT, so any gRPC client can read the field without parsing text. An exception that
is not a :class:`CrossflowError` is a bug: it is logged with its traceback and answered INTERNAL
with no detail, never UNKNOWN (the fuzz test proves none happen).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Any, ParamSpec, TypeVar

import grpc
import structlog
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from crossflow_ctl.domain.errors import (
    Aborted,
    CrossflowError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
    Unauthenticated,
)
from crossflow_ctl.wire.convert import STORE_UNAVAILABLE_PREFIX

P = ParamSpec("P")
R = TypeVar("R")
log = structlog.get_logger()

STATUS_FOR: tuple[tuple[type[CrossflowError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Aborted, grpc.StatusCode.ABORTED),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
)


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


def rich_status(code: grpc.StatusCode, exc: CrossflowError | None, message: str) -> grpc.Status:
    """A ``grpc.Status`` whose trailers carry a google.rpc.Status; for a refusal that names a
    field, with a BadRequest (INVALID_ARGUMENT) or PreconditionFailure detail naming it."""
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    if exc is not None and exc.field:
        detail = any_pb2.Any()
        if isinstance(exc, FailedPrecondition):
            detail.Pack(
                error_details_pb2.PreconditionFailure(
                    violations=[
                        error_details_pb2.PreconditionFailure.Violation(
                            type="STATE", subject=exc.field, description=exc.message
                        )
                    ]
                )
            )
        else:
            detail.Pack(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(
                            field=exc.field, description=exc.message
                        )
                    ]
                )
            )
        status.details.append(detail)
    result: grpc.Status = rpc_status.to_status(status)
    return result


async def abort_with(context: Any, exc: BaseException) -> None:
    """Abort ``context`` with the status ``exc`` maps to (INTERNAL, logged, for a bug)."""
    if isinstance(exc, CrossflowError):
        status = rich_status(status_for(exc), exc, status_message(exc))
    else:
        log.error("rpc.internal_error", error=repr(exc), exc_info=exc)
        status = rich_status(
            grpc.StatusCode.INTERNAL, None, "internal error (logged by the broker)"
        )
    await context.abort(status.code, status.details, status.trailing_metadata)


def maps_errors(
    method: Callable[P, Awaitable[R]],
) -> Callable[P, Awaitable[R]]:
    """Turn an exception raised by a unary handler into its status code and message.

    The message is ``field: detail`` so callers see which field was refused; the trailers carry
    the same as a google.rpc.Status with details (:func:`rich_status`)."""

    @wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # every exception gets a status, never UNKNOWN
            await abort_with(args[-1], exc)
            raise AssertionError("unreachable: abort raises") from exc

    return wrapper


def maps_stream_errors(
    method: Callable[P, AsyncIterator[R]],
) -> Callable[P, AsyncIterator[R]]:
    """:func:`maps_errors` for a server-streaming or bidirectional handler (an async
    generator): a refusal ends the stream with its status, a bug with INTERNAL, never UNKNOWN."""

    @wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> AsyncIterator[R]:
        try:
            async for item in method(*args, **kwargs):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # every exception gets a status, never UNKNOWN
            await abort_with(args[-1], exc)

    return wrapper
