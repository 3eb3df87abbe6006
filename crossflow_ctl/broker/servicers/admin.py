"""AdminService for crossflowctl: nodes with lease and open debits, reservations, pools,
cordon, policy. Store trouble answers UNAVAILABLE with the reason."""

from __future__ import annotations

from typing import TypeAlias

import grpc

from crossflow_ctl.api.v1 import admin_pb2, admin_pb2_grpc
from crossflow_ctl.broker.servicers import maps_errors
from crossflow_ctl.domain.models import NodeState
from crossflow_ctl.domain.policy import parse_policy_updates
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.wire import convert as c

Ctx: TypeAlias = grpc.aio.ServicerContext


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def _status(self, node: NodeState) -> admin_pb2.NodeStatus:
        b = self._broker
        return c.node_status_to_proto(node, b.clock.now_ms(), b.policy.shares)

    @maps_errors
    async def ListNodes(
        self, request: admin_pb2.ListNodesRequest, context: Ctx
    ) -> admin_pb2.ListNodesResponse:
        role = c.role_from_proto(request.role)
        nodes = await self._broker.list_nodes(role, request.selector)
        return admin_pb2.ListNodesResponse(
            nodes=[self._status(n) for n in nodes], broker_warnings=self._broker.warnings
        )

    @maps_errors
    async def GetNode(
        self, request: admin_pb2.GetNodeRequest, context: Ctx
    ) -> admin_pb2.GetNodeResponse:
        d = await self._broker.get_node(request.node_id)
        step_model = c.step_model_to_proto(d.step_model) if d.step_model is not None else None
        return admin_pb2.GetNodeResponse(
            node=self._status(d.state),
            step_model=step_model,
            reservations=[c.reservation_to_proto(r) for r in d.reservations],
            recent_leases=[c.lease_to_proto(s.lease) for s in d.recent_leases],
            events=[
                admin_pb2.LeaseEvent(at_unix_ms=e.at_ms, kind=e.kind, message=e.message)
                for e in d.events
            ],
        )

    @maps_errors
    async def ListReservations(
        self, request: admin_pb2.ListReservationsRequest, context: Ctx
    ) -> admin_pb2.ListReservationsResponse:
        res = await self._broker.list_reservations(request.node_id)
        return admin_pb2.ListReservationsResponse(
            reservations=[c.reservation_to_proto(r) for r in res]
        )

    @maps_errors
    async def ListPools(
        self, request: admin_pb2.ListPoolsRequest, context: Ctx
    ) -> admin_pb2.ListPoolsResponse:
        pools = await self._broker.list_pools()
        return admin_pb2.ListPoolsResponse(pools=[c.pool_to_proto(p) for p in pools])

    @maps_errors
    async def Cordon(
        self, request: admin_pb2.CordonRequest, context: Ctx
    ) -> admin_pb2.CordonResponse:
        node = await self._broker.cordon(request.node_id, True, request.reason)
        return admin_pb2.CordonResponse(node=self._status(node))

    @maps_errors
    async def Uncordon(
        self, request: admin_pb2.UncordonRequest, context: Ctx
    ) -> admin_pb2.UncordonResponse:
        node = await self._broker.cordon(request.node_id, False)
        return admin_pb2.UncordonResponse(node=self._status(node))

    @maps_errors
    async def DeleteNode(
        self, request: admin_pb2.DeleteNodeRequest, context: Ctx
    ) -> admin_pb2.DeleteNodeResponse:
        dropped = await self._broker.delete_node(request.node_id, request.force)
        return admin_pb2.DeleteNodeResponse(
            node_id=request.node_id, open_reservations_dropped=dropped
        )

    @maps_errors
    async def GetPolicy(
        self, request: admin_pb2.GetPolicyRequest, context: Ctx
    ) -> admin_pb2.GetPolicyResponse:
        current = await self._broker.get_policy()
        return admin_pb2.GetPolicyResponse(
            policy_json=c.policy_to_json(current.policy), version=current.version
        )

    @maps_errors
    async def SetPolicy(
        self, request: admin_pb2.SetPolicyRequest, context: Ctx
    ) -> admin_pb2.SetPolicyResponse:
        updates = parse_policy_updates(dict(request.updates))
        expected = request.expected_version if request.HasField("expected_version") else None
        new = await self._broker.set_policy(updates, expected)
        return admin_pb2.SetPolicyResponse(
            policy_json=c.policy_to_json(new.policy), version=new.version
        )
