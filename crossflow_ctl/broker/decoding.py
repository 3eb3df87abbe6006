"""Undecodable requests answer INVALID_ARGUMENT, not the INTERNAL/UNKNOWN of grpc's default.

grpc's own deserializer failure ends the call with a status the caller cannot tell from a
broker bug. :class:`DecodingInterceptor` wraps every method's request deserializer so that bytes
that are not a valid message become an :class:`Undecodable` marker, and the handler answers
``INVALID_ARGUMENT`` naming ``request`` (with a google.rpc.BadRequest detail) before any
servicer code runs. For the agent stream the marker ends the stream with the same status.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from crossflow_ctl.broker.servicers import abort_with
from crossflow_ctl.domain.errors import InvalidArgument


class Undecodable:
    """What the wrapped deserializer returns for bytes that do not parse."""

    def __init__(self, error: BaseException) -> None:
        self.error = InvalidArgument(
            f"not a valid protobuf message ({type(error).__name__})", field="request"
        )


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    parse = deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # any parse failure (DecodeError, RuntimeWarning-as-error...)
            return Undecodable(exc)

    return deserialize


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise request.error
        yield request


async def _refuse_undecodable(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise request.error
    return request


def _streaming(behavior: Any, check: Callable[[Any], Any]) -> Any:
    """``behavior`` (an async generator or a coroutine writing with ``context.write``) with its
    request (or request iterator) passed through ``check`` first."""

    async def prepared(request: Any, context: Any) -> Any:
        try:
            return await check(request) if inspect.iscoroutinefunction(check) else check(request)
        except InvalidArgument as exc:
            await abort_with(context, exc)

    if inspect.isasyncgenfunction(behavior):

        async def as_generator(request: Any, context: Any) -> AsyncIterator[Any]:
            async for item in behavior(await prepared(request, context), context):
                yield item

        return as_generator

    async def as_coroutine(request: Any, context: Any) -> Any:
        return await behavior(await prepared(request, context), context)

    return as_coroutine


class DecodingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}
        """One wrapped handler per method, built on its first call (not on every call)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method: str = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrapped[method] = self._wrap(handler)
        return wrapped

    @staticmethod
    def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize = _safe(handler.request_deserializer)
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                if isinstance(request, Undecodable):
                    await abort_with(context, request.error)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=deserialize,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, _refuse_undecodable),
                request_deserializer=deserialize,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _streaming(handler.stream_stream, _checked),
                request_deserializer=deserialize,
                response_serializer=handler.response_serializer,
            )
        return handler
