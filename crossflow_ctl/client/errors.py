"""gRPC status codes back to the domain's error classes (the broker maps them the other way).

    INVALID_ARGUMENT     -> InvalidArgument
    NOT_FOUND            -> NotFound
    FAILED_PRECONDITION  -> FailedPrecondition
    ABORTED              -> Aborted (a policy write whose expected_version was not the stored one)
    RESOURCE_EXHAUSTED   -> InvalidArgument (a message over the size limit)
    PERMISSION_DENIED    -> PermissionDenied
    UNAUTHENTICATED      -> Unauthenticated
    UNAVAILABLE whose message the broker marked "store unavailable: " -> StoreUnavailable
    UNAVAILABLE, DEADLINE_EXCEEDED, anything else (gRPC's own: the broker was not reached or
    did not answer)      -> BrokerUnavailable

The broker writes ``field: detail``; the field comes back on ``error.field``.
"""

from __future__ import annotations

import re

import grpc

from crossflow_ctl.domain.errors import (
    Aborted,
    BrokerUnavailable,
    CrossflowError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
    Unauthenticated,
)
from crossflow_ctl.wire.convert import STORE_UNAVAILABLE_PREFIX

_CLASS_FOR: dict[grpc.StatusCode, type[CrossflowError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidArgument,  # message over the size limit
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}
_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): (.*)$", re.DOTALL)


def error_from_rpc(exc: grpc.aio.AioRpcError) -> CrossflowError:
    code = exc.code()
    return error_from_status(code, exc.details() or code.name)


def error_from_status(code: grpc.StatusCode | int, details: str) -> CrossflowError:
    """The domain error for a status (a StatusCode or its number, as AdmitStream sends it)."""
    if isinstance(code, int):
        code = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    cls = _CLASS_FOR.get(code)
    if code == grpc.StatusCode.UNAVAILABLE and details.startswith(STORE_UNAVAILABLE_PREFIX):
        return StoreUnavailable(details.removeprefix(STORE_UNAVAILABLE_PREFIX))
    if cls is None:
        return BrokerUnavailable(f"broker not reached or did not answer ({code.name}): {details}")
    match = _FIELD.match(details)
    if match:
        return cls(match.group(2), field=match.group(1))
    return cls(details)
