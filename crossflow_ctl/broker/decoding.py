"""Undecodable requests answer INVALID_ARGUMENT, not the INTERNAL/UNKNOWN of grpc's default.

grpc's own deserializer failure ends the call with a status the caller cannot tell from a
broker bug. The broker's interceptor (:mod:`crossflow_ctl.broker.interceptor`) gives every
method the deserializer :func:`safe_deserializer` makes, so that bytes that are not a valid
message become an :class:`Undecodable` marker, and the handler answers ``INVALID_ARGUMENT``
naming ``request`` (with a google.rpc.BadRequest detail) before any servicer code runs. For the
agent stream the marker ends the stream with the same status (:func:`checked_requests`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from crossflow_ctl.domain.errors import InvalidArgument


class Undecodable:
    """What the wrapped deserializer returns for bytes that do not parse."""

    def __init__(self, error: BaseException) -> None:
        self.error = InvalidArgument(
            f"not a valid protobuf message ({type(error).__name__})", field="request"
        )


def safe_deserializer(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserializer`` that returns an :class:`Undecodable` instead of raising."""
    parse = deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # any parse failure (DecodeError, RuntimeWarning-as-error...)
            return Undecodable(exc)

    return deserialize


async def checked_requests(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream that raises InvalidArgument at its first undecodable message."""
    async for request in requests:
        if isinstance(request, Undecodable):
            raise request.error
        yield request


def refuse_undecodable(request: Any) -> Any:
    """``request``, or InvalidArgument raised when it is undecodable."""
    if isinstance(request, Undecodable):
        raise request.error
    return request
