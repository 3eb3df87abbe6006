"""Async client of AdmissionService for routers: Admit, Commit, Release, WatchRoom.

With ``fail_closed=True`` an Admit that hits any transport error or its deadline returns a NORMAL
:class:`Admission` (reason TIMEOUT or STORE_UNAVAILABLE) instead of raising, so a router can call
it inline. Other calls raise the domain errors of :mod:`crossflow_ctl.client.errors`.

Every call carries a request id (the caller's, or a fresh one) and is retried ``retries`` times,
within the same ``timeout_s``, with the SAME id after UNAVAILABLE or a deadline, so the broker's
request records (crossflow_ctl.service.requests) make the outcome exact: a retried Admit never
debits twice and gets the first call's answer; a retried Commit or Release tells how the first
one ended.
:meth:`AdmissionClient.room_updates` is the room signal of
:class:`~crossflow_ctl.client.queue.AdmissionQueue` (late binding): it never ends on its own.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc
from crossflow_ctl.client.base import BrokerClient
from crossflow_ctl.client.errors import error_from_rpc
from crossflow_ctl.client.models import CommitResult
from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Reason
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.errors import (
    CrossflowError,
    InvalidArgument,
    StoreUnavailable,
)
from crossflow_ctl.domain.models import validated
from crossflow_ctl.domain.room import RoomUpdate, RoomWatchRequest, unknown_room
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.wire.convert_admission import admission_from_proto, admit_request_to_proto
from crossflow_ctl.wire.convert_room import room_update_from_proto, watch_request_to_proto

_RELEASE_OUTCOMES = {
    "finished": admission_pb2.RELEASE_OUTCOME_FINISHED,
    "failed": admission_pb2.RELEASE_OUTCOME_FAILED,
    "cancelled": admission_pb2.RELEASE_OUTCOME_CANCELLED,
}


_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class AdmissionClient(BrokerClient):
    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 0.25,
        fail_closed: bool = False,
        retries: int = 1,
        channel: grpc.aio.Channel | None = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        super().__init__(target, timeout_s=timeout_s, channel=channel, credentials=credentials)
        self.fail_closed = fail_closed
        self.retries = max(0, retries)
        self._stub = admission_pb2_grpc.AdmissionServiceStub(self._channel)

    async def _retried(self, method: Any, request: Any) -> Any:
        """``method(request)``, again (same request id, ``attempt`` counting) after UNAVAILABLE
        or a deadline, all attempts within the one ``timeout_s``: a fail-closed Admit answers by
        its deadline, retries included. A request the caller already marks as a retry
        (``attempt`` > 0) keeps counting from there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        first = request.attempt
        for attempt in range(self.retries + 1):
            request.attempt = first + attempt
            try:
                return await method(request, timeout=max(0.0, deadline - loop.time()))
            except grpc.aio.AioRpcError as exc:
                spent = loop.time() >= deadline
                if attempt == self.retries or exc.code() not in _RETRIED or spent:
                    raise
        raise AssertionError("unreachable")

    async def admit(self, request: AdmissionRequest | None = None, **fields: Any) -> Admission:
        """Admit one request (an AdmissionRequest, or its fields as keywords)."""
        req = request if request is not None else validated(AdmissionRequest, **fields)
        if not req.request_id and not req.dry_run:
            req = req.model_copy(update={"request_id": uuid.uuid4().hex})
        try:
            msg = await self._retried(self._stub.Admit, admit_request_to_proto(req))
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if not self.fail_closed or code == grpc.StatusCode.INVALID_ARGUMENT:
                raise error_from_rpc(exc) from None
            error = error_from_rpc(exc)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                reason = Reason.TIMEOUT
            elif isinstance(error, StoreUnavailable):
                reason = Reason.STORE_UNAVAILABLE
            else:
                reason = Reason.BROKER_UNAVAILABLE
            return Admission.normal(reason, str(error))
        return admission_from_proto(msg)

    async def _exact(self, method: Any, request: Any) -> Any:
        try:
            return await self._retried(method, request)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def commit(self, reservation_id: str, request_id: str = "") -> CommitResult:
        req = admission_pb2.CommitRequest(
            reservation_id=reservation_id, request_id=request_id or uuid.uuid4().hex
        )
        msg = await self._exact(self._stub.Commit, req)
        return CommitResult(reservation_id=msg.reservation_id, expires_at_ms=msg.expires_unix_ms)

    async def release(
        self, reservation_id: str, outcome: str = "finished", request_id: str = ""
    ) -> str:
        if outcome not in _RELEASE_OUTCOMES:
            raise InvalidArgument(f"must be one of {sorted(_RELEASE_OUTCOMES)}", field="outcome")
        req = admission_pb2.ReleaseRequest(
            reservation_id=reservation_id,
            outcome=_RELEASE_OUTCOMES[outcome],
            request_id=request_id or uuid.uuid4().hex,
        )
        msg = await self._exact(self._stub.Release, req)
        return str(msg.reservation_id)

    async def watch_room(
        self, request: RoomWatchRequest | None = None, **fields: Any
    ) -> AsyncIterator[RoomUpdate]:
        """One WatchRoom stream (no deadline): its updates until it ends. Raises the domain
        errors (InvalidArgument naming the field, StoreUnavailable when the broker goes)."""
        req = request if request is not None else validated(RoomWatchRequest, **fields)
        call = self._stub.WatchRoom(watch_request_to_proto(req))
        try:
            async for msg in call:
                yield room_update_from_proto(msg)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()

    async def room_updates(
        self,
        request: RoomWatchRequest | None = None,
        *,
        retry_s: float = 0.2,
        max_retry_s: float = 5.0,
        **fields: Any,
    ) -> AsyncIterator[RoomUpdate]:
        """:meth:`watch_room` that never ends on its own: when the stream ends or breaks, an
        UNKNOWN update (no room, ``seq`` 0) is yielded at once and the watch re-subscribes with
        exponential backoff. A refused subscription (InvalidArgument) raises."""
        req = request if request is not None else validated(RoomWatchRequest, **fields)
        delay = retry_s
        while True:
            detail = "room watch ended"
            try:
                async for update in self.watch_room(req):
                    delay = retry_s
                    yield update
            except InvalidArgument:
                raise
            except CrossflowError as exc:
                detail = f"room watch failed: {exc}"
            now = SystemClock().now_ms()
            yield RoomUpdate(seq=0, at_ms=now, view=unknown_room(req.pool, detail))
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_retry_s)
