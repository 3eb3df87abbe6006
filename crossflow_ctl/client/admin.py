"""Async client of AdminService, for crossflowctl and operators: nodes (with lease and open
debits), reservations, pools, cordon/uncordon, policy. Errors come back as domain errors."""

from __future__ import annotations

import json
from typing import Any

import grpc

from crossflow_ctl.api.v1 import admin_pb2, admin_pb2_grpc
from crossflow_ctl.client.base import BrokerClient
from crossflow_ctl.client.models import NodeDetailView, NodeEventView, NodeView
from crossflow_ctl.domain.models import NodeRole, PoolSnapshot, Reservation
from crossflow_ctl.domain.policy import VersionedPolicy
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.wire import convert as c


def _node_view(msg: admin_pb2.NodeStatus) -> NodeView:
    return NodeView(
        state=c.node_state_from_proto(msg),
        available=c.credits_from_proto(msg.available, "available"),
        lease_expired=msg.lease_expired,
    )


class AdminClient(BrokerClient):
    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 5.0,
        channel: grpc.aio.Channel | None = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        super().__init__(target, timeout_s=timeout_s, channel=channel, credentials=credentials)
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)
        self.broker_warnings: tuple[str, ...] = ()
        """What the broker said about itself with its last ListNodes answer (for example that
        it serves unauthenticated callers beyond loopback); empty when nothing."""

    async def list_nodes(self, role: NodeRole | None = None, selector: str = "") -> list[NodeView]:
        req = admin_pb2.ListNodesRequest(selector=selector)
        if role is not None:
            req.role = c.role_to_proto(role)  # type: ignore[assignment]
        msg = await self._call(self._stub.ListNodes, req)
        self.broker_warnings = tuple(msg.broker_warnings)
        return [_node_view(n) for n in msg.nodes]

    async def get_node(self, node_id: str) -> NodeDetailView:
        msg = await self._call(self._stub.GetNode, admin_pb2.GetNodeRequest(node_id=node_id))
        return NodeDetailView(
            node=_node_view(msg.node),
            reservations=tuple(c.reservation_from_proto(r) for r in msg.reservations),
            recent_leases=tuple(c.lease_from_proto(x) for x in msg.recent_leases),
            events=tuple(
                NodeEventView(at_ms=e.at_unix_ms, kind=e.kind, message=e.message)
                for e in msg.events
            ),
            step_model=(
                c.step_model_from_proto(msg.step_model) if msg.HasField("step_model") else None
            ),
        )

    async def list_reservations(self, node_id: str | None = None) -> list[Reservation]:
        req = admin_pb2.ListReservationsRequest(node_id=node_id or "")
        msg = await self._call(self._stub.ListReservations, req)
        return [c.reservation_from_proto(r) for r in msg.reservations]

    async def list_pools(self) -> list[PoolSnapshot]:
        msg = await self._call(self._stub.ListPools, admin_pb2.ListPoolsRequest())
        return [c.pool_from_proto(p) for p in msg.pools]

    async def cordon(self, node_id: str, reason: str = "") -> NodeView:
        req = admin_pb2.CordonRequest(node_id=node_id, reason=reason)
        msg = await self._call(self._stub.Cordon, req)
        return _node_view(msg.node)

    async def uncordon(self, node_id: str) -> NodeView:
        msg = await self._call(self._stub.Uncordon, admin_pb2.UncordonRequest(node_id=node_id))
        return _node_view(msg.node)

    async def delete_node(self, node_id: str, force: bool = False) -> int:
        """Remove a node; FailedPrecondition while it has open reservations (unless ``force``).
        Returns the open reservations dropped with it."""
        req = admin_pb2.DeleteNodeRequest(node_id=node_id, force=force)
        msg = await self._call(self._stub.DeleteNode, req)
        return int(msg.open_reservations_dropped)

    async def get_policy(self) -> VersionedPolicy:
        msg = await self._call(self._stub.GetPolicy, admin_pb2.GetPolicyRequest())
        return VersionedPolicy(policy=c.policy_from_json(msg.policy_json), version=msg.version)

    async def set_policy(
        self, updates: dict[str, Any], expected_version: int | None = None
    ) -> VersionedPolicy:
        """Apply ``updates`` (name -> value) as a new policy version; the broker validates them.
        With ``expected_version``, Aborted (nothing changed) when the stored policy has another
        version (someone else changed it since it was read)."""
        text = {k: v if isinstance(v, str) else json.dumps(v) for k, v in updates.items()}
        req = admin_pb2.SetPolicyRequest(updates=text)
        if expected_version is not None:
            req.expected_version = expected_version
        msg = await self._call(self._stub.SetPolicy, req)
        return VersionedPolicy(policy=c.policy_from_json(msg.policy_json), version=msg.version)
