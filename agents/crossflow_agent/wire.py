"""The agent's side of the ``crossflow.v1`` lease stream: domain -> proto for what it sends.

The agent talks to the broker only through the contract (import-linter forbids the broker's own
converters), so the few messages it sends are built here, field by field from the domain models.
"""

from __future__ import annotations

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.domain.models import Credits, Lease, NodeRole, PoolLoad, ZeroReason

AGENT_VERSION = "crossflow-agent/0.1.0"


def credits_to_proto(c: Credits) -> common_pb2.Credits:
    return common_pb2.Credits(**c.model_dump())


def zero_reason_to_proto(reason: ZeroReason | None) -> common_pb2.ZeroReason.ValueType:
    name = "ZERO_REASON_UNSPECIFIED" if reason is None else f"ZERO_REASON_{reason.name}"
    return common_pb2.ZeroReason.Value(name)


def role_to_proto(role: NodeRole) -> common_pb2.NodeRole.ValueType:
    return common_pb2.NodeRole.Value(f"NODE_ROLE_{role.name}")


def lease_request(lease: Lease) -> lease_pb2.ConnectRequest:
    msg = common_pb2.Lease(
        node_id=lease.node_id,
        epoch=lease.epoch,
        version=lease.version,
        ttl_ms=lease.ttl_ms,
        credits=credits_to_proto(lease.credits),
        zero_reason=zero_reason_to_proto(lease.zero_reason),
        zero_detail=lease.zero_detail,
        queue_wait_ms=lease.queue_wait_ms,
        borrowed_prefill_rate_tps=lease.borrowed_prefill_rate_tps,
        itl_ms=lease.itl_ms,
        itl_slo_ms=lease.itl_slo_ms,
        last_notice_seq=lease.last_notice_seq,
        snapshot_unix_ms=lease.snapshot_unix_ms,
    )
    return lease_pb2.ConnectRequest(lease=msg)


def pool_load_request(load: PoolLoad) -> lease_pb2.ConnectRequest:
    return lease_pb2.ConnectRequest(pool_load=common_pb2.PoolLoad(**load.model_dump()))


def hello_request(
    *,
    node_id: str,
    role: NodeRole,
    epoch: int,
    pool: str,
    labels: dict[str, str],
    last_notice_seq: int,
) -> lease_pb2.ConnectRequest:
    hello = lease_pb2.Hello(
        node_id=node_id,
        role=role_to_proto(role),
        epoch=epoch,
        pool=pool,
        labels=labels,
        last_notice_seq=last_notice_seq,
        agent_version=AGENT_VERSION,
    )
    return lease_pb2.ConnectRequest(hello=hello)


def heartbeat_request(sent_unix_ms: int) -> lease_pb2.ConnectRequest:
    return lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat(sent_unix_ms=sent_unix_ms))
