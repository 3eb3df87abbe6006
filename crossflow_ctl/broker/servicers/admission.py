"""AdmissionService: Admit and AdmitStream always answer (NORMAL on any store doubt); Commit and
Release map domain errors to status codes; WatchRoom streams room updates (INVALID_ARGUMENT on a
bad subscription, before the first update)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc
from crossflow_ctl.broker.admit_stream import answer_stream
from crossflow_ctl.broker.auth import owner_filter, reservation_owner
from crossflow_ctl.broker.servicers import maps_errors, maps_stream_errors
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.wire.convert_admission import (
    admission_to_proto,
    admit_request_from_proto,
    explains,
    release_outcome_from_proto,
)
from crossflow_ctl.wire.convert_room import room_update_to_proto, watch_request_from_proto


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    @maps_errors
    async def Admit(
        self, request: admission_pb2.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.AdmitResponse:
        owner = reservation_owner()
        # No turn for others to join a lone one: another RPC's handler rarely starts in the same
        # turn (Admitter.admit_many), so that turn was nearly always a loop iteration for nothing.
        admission = await self._broker.admit(admit_request_from_proto(request), owner, join=False)
        return admission_to_proto(admission, explain=explains(request))

    @maps_stream_errors
    async def AdmitStream(
        self,
        request_iterator: AsyncIterator[admission_pb2.AdmitStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[admission_pb2.AdmitStreamResponse]:
        owner = reservation_owner()
        async for response in answer_stream(self._broker, request_iterator, owner):
            yield response

    @maps_errors
    async def Commit(
        self, request: admission_pb2.CommitRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.CommitResponse:
        res = await self._broker.commit(
            request.reservation_id, owner_filter(), request.request_id, request.attempt
        )
        return admission_pb2.CommitResponse(
            reservation_id=res.reservation_id, expires_unix_ms=res.expires_at_ms
        )

    @maps_errors
    async def Release(
        self, request: admission_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.ReleaseResponse:
        outcome = release_outcome_from_proto(request.outcome)
        res = await self._broker.release(
            request.reservation_id, outcome, owner_filter(), request.request_id, request.attempt
        )
        return admission_pb2.ReleaseResponse(reservation_id=res.reservation_id)

    @maps_stream_errors
    async def WatchRoom(
        self, request: admission_pb2.WatchRoomRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admission_pb2.WatchRoomResponse]:
        async for update in self._broker.watch_room(watch_request_from_proto(request)):
            yield room_update_to_proto(update)
