"""Proto <-> domain conversion for AdmissionService.WatchRoom (late binding)."""

from __future__ import annotations

from crossflow_ctl.api.v1 import admission_pb2
from crossflow_ctl.domain.room import (
    NodeRoom,
    RoomStatus,
    RoomUpdate,
    RoomView,
    RoomWatchRequest,
)
from crossflow_ctl.wire import convert as c


def watch_request_to_proto(req: RoomWatchRequest) -> admission_pb2.WatchRoomRequest:
    return admission_pb2.WatchRoomRequest(
        pool=req.pool,
        candidate_node_ids=list(req.candidate_node_ids),
        max_updates_per_s=req.max_updates_per_s,
        heartbeat_ms=req.heartbeat_ms,
    )


def watch_request_from_proto(msg: admission_pb2.WatchRoomRequest) -> RoomWatchRequest:
    """Validated; InvalidArgument naming the field (``max_updates_per_s``, ...) otherwise."""
    result: RoomWatchRequest = c._validated(
        RoomWatchRequest,
        "",
        pool=msg.pool or "default",
        candidate_node_ids=tuple(msg.candidate_node_ids),
        max_updates_per_s=msg.max_updates_per_s,
        heartbeat_ms=msg.heartbeat_ms,
    )
    return result


def node_room_to_proto(room: NodeRoom) -> admission_pb2.NodeRoom:
    return admission_pb2.NodeRoom(
        node_id=room.node_id,
        compute_tokens=room.compute_tokens,
        kv_tokens=room.kv_tokens,
        slots=room.slots,
        queue_wait_ms=room.queue_wait_ms,
        lease_epoch=room.lease_epoch,
        lease_version=room.lease_version,
        borrowed_prefill_rate_tps=room.borrowed_prefill_rate_tps,
        prefill_s_per_token=room.prefill_s_per_token,
        prefill_s_per_token_context=room.prefill_s_per_token_context,
    )


def node_room_from_proto(msg: admission_pb2.NodeRoom) -> NodeRoom:
    result: NodeRoom = c._validated(
        NodeRoom,
        "nodes",
        node_id=msg.node_id,
        compute_tokens=msg.compute_tokens,
        kv_tokens=msg.kv_tokens,
        slots=msg.slots,
        queue_wait_ms=msg.queue_wait_ms,
        lease_epoch=msg.lease_epoch,
        lease_version=msg.lease_version,
        borrowed_prefill_rate_tps=msg.borrowed_prefill_rate_tps,
        prefill_s_per_token=msg.prefill_s_per_token,
        prefill_s_per_token_context=msg.prefill_s_per_token_context,
    )
    return result


def room_update_to_proto(update: RoomUpdate) -> admission_pb2.WatchRoomResponse:
    view = update.view
    return admission_pb2.WatchRoomResponse(
        seq=update.seq,
        at_unix_ms=update.at_ms,
        heartbeat=update.heartbeat,
        pool=view.pool,
        status=c.enum_to_proto(view.status, admission_pb2.RoomStatus, "ROOM_STATUS_"),  # type: ignore[arg-type]
        detail=view.detail,
        nodes=[node_room_to_proto(n) for n in view.nodes],
        pool_wait_known=view.pool_wait_ms is not None,
        pool_wait_ms=view.pool_wait_ms or 0.0,
        demand_threshold_ms=view.demand_threshold_ms,
        demand_holds=view.demand_holds,
    )


def room_update_from_proto(msg: admission_pb2.WatchRoomResponse) -> RoomUpdate:
    """An unspecified status reads as UNKNOWN (no room): a broker that does not say has none."""
    status = c.enum_from_proto(
        msg.status, admission_pb2.RoomStatus, "ROOM_STATUS_", RoomStatus, "status"
    )
    view: RoomView = c._validated(
        RoomView,
        "",
        pool=msg.pool or "default",
        status=status or RoomStatus.UNKNOWN,
        detail=msg.detail,
        nodes=tuple(node_room_from_proto(n) for n in msg.nodes),
        pool_wait_ms=msg.pool_wait_ms if msg.pool_wait_known else None,
        demand_threshold_ms=msg.demand_threshold_ms,
        demand_holds=msg.demand_holds,
    )
    result: RoomUpdate = c._validated(
        RoomUpdate,
        "",
        seq=msg.seq,
        at_ms=msg.at_unix_ms,
        heartbeat=msg.heartbeat,
        view=view,
    )
    return result
