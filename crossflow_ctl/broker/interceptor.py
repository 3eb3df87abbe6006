"""The broker's one server interceptor: tracing, authentication and the undecodable-request
check, composed into ONE wrapper per method.

grpc.aio awaits every interceptor's ``intercept_service`` on every call, and the handler each
returns wraps the next one's: three interceptors cost three awaits and three coroutine frames
before the servicer ran, on every RPC. :class:`BrokerInterceptor` builds each method's handler
once, on its first call, with the three steps in one coroutine and in the order they had as
three interceptors:

1. the RPC's span (:func:`~crossflow_ctl.observability.rpc_span`; unary-unary methods only,
   health and reflection excepted), so a refusal below is recorded on it;
2. the caller's authentication and authorization (:class:`~crossflow_ctl.broker.auth.Authorizer`,
   when the broker authenticates and the method is not open to anyone), with the caller made
   available to the servicer (:func:`~crossflow_ctl.broker.auth.caller`);
3. undecodable request bytes answered INVALID_ARGUMENT (:mod:`crossflow_ctl.broker.decoding`),
   after authentication: an unauthenticated caller learns nothing about its bytes.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import nullcontext
from typing import Any

import grpc
from opentelemetry import trace

from crossflow_ctl.broker.auth import Authorizer, Check, bind_caller, unbind_caller
from crossflow_ctl.broker.decoding import (
    Undecodable,
    checked_requests,
    refuse_undecodable,
    safe_deserializer,
)
from crossflow_ctl.broker.servicers import abort_with
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.observability import rpc_span
from crossflow_ctl.observability.tracing import UNTRACED_SERVICES

Behavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]


class BrokerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """``grpc.aio.server(interceptors=[BrokerInterceptor(authorizer)])``; ``authorizer`` None:
    the broker authenticates no one (every method open). ``tracer_provider``: tests' own."""

    def __init__(
        self,
        authorizer: Authorizer | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self._authorizer = authorizer
        self._tracer_provider = tracer_provider
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}
        """One wrapped handler per method, built on its first call (not on every call)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None:
            return None
        wrapped = self._wrapped[method] = self._wrap(method, handler)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        check = self._authorizer.check_for(method) if self._authorizer is not None else None
        h: Any = handler
        decodes = h.request_deserializer is not None
        deserialize = safe_deserializer(h.request_deserializer) if decodes else None
        if h.unary_unary:
            traced = not method.startswith(UNTRACED_SERVICES)
            behavior = _unary(h.unary_unary, method, traced, check, decodes, self._tracer_provider)
            return grpc.unary_unary_rpc_method_handler(
                behavior,
                request_deserializer=deserialize,
                response_serializer=h.response_serializer,
            )
        if h.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(h.unary_stream, check, refuse_undecodable if decodes else None),
                request_deserializer=deserialize,
                response_serializer=h.response_serializer,
            )
        if h.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _streaming(h.stream_stream, check, checked_requests if decodes else None),
                request_deserializer=deserialize,
                response_serializer=h.response_serializer,
            )
        if check is None:  # stream-unary: the broker serves none; authorized, not decoded
            return handler
        return grpc.stream_unary_rpc_method_handler(
            _streaming(h.stream_unary, check, None),
            request_deserializer=h.request_deserializer,
            response_serializer=h.response_serializer,
        )


def _unary(
    behavior: Behavior,
    method: str,
    traced: bool,
    check: Check | None,
    decodes: bool,
    provider: trace.TracerProvider | None,
) -> Behavior:
    """``behavior`` in its span, after its caller's check and its request's decoding check."""

    async def run(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        scope = (
            rpc_span(method, context.invocation_metadata(), tracer_provider=provider)
            if traced
            else nullcontext()
        )
        with scope:
            token = bind_caller(await check(context)) if check is not None else None
            try:
                if decodes and isinstance(request, Undecodable):
                    await abort_with(context, request.error)
                return await behavior(request, context)
            finally:
                if token is not None:
                    unbind_caller(token)

    return run


def _streaming(
    behavior: Behavior,
    check: Check | None,
    prepare: Callable[[Any], Any] | None,
) -> Behavior:
    """A streaming ``behavior`` (an async generator, or a coroutine that writes with
    ``context.write``) after its caller's check, its request (or request iterator) passed
    through ``prepare`` first (an undecodable one: INVALID_ARGUMENT)."""

    async def prepared(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if check is not None:
            bind_caller(await check(context))  # this RPC's own task: nothing to unbind
        if prepare is None:
            return request
        try:
            return prepare(request)
        except InvalidArgument as exc:
            await abort_with(context, exc)

    if inspect.isasyncgenfunction(behavior):

        async def as_generator(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            async for item in behavior(await prepared(request, context), context):
                yield item

        return as_generator

    async def as_coroutine(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await behavior(await prepared(request, context), context)

    return as_coroutine
