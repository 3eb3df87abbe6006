"""Issue 12: epochs that would brick a node, a node's fixed identity, label limits, and which
role may send what. Real gRPC on loopback, both stores."""

from __future__ import annotations

import grpc
import pytest

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.client import AdminClient
from crossflow_ctl.domain.models import MAX_EPOCH_LEAD_MS, MAX_LABELS, NodeRole
from tests.broker.agents import FakeAgent, lease_msg
from tests.broker.conftest import target


async def _refused_hello(server, node_id: str, **kw) -> grpc.aio.AioRpcError:
    agent = FakeAgent(target(server), node_id, **kw)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent.connect()
        return err.value
    finally:
        await agent.close()


async def test_an_absurd_epoch_is_refused_and_does_not_brick_the_node(cluster, agents, clock):
    server = await cluster.start()
    now = clock.now_ms()
    agent = await agents(server, "d1", epoch=now)
    assert (await agent.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
    for epoch in (2**63 - 1, now + MAX_EPOCH_LEAD_MS + 1):
        ack = await agent.send_lease(lease_msg("d1", epoch, 1))
        assert ack.result == lease_pb2.LEASE_RESULT_INVALID
        assert ack.message.startswith("lease.epoch:"), ack.message
    # The agent's next start (a later start time) is still accepted.
    restarted = await agents(server, "d1", epoch=now + 1_000)
    assert (await restarted.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
    async with AdminClient(target(server)) as admin:
        stored = (await admin.get_node("d1")).node.state.lease
        assert stored is not None and stored.lease.epoch == now + 1_000


async def test_identity_is_fixed_until_the_node_is_cordoned(cluster, agents):
    server = await cluster.start()
    await agents(server, "d1", labels={"zone": "a"})
    err = await _refused_hello(server, "d1", role=common_pb2.NODE_ROLE_PREFILL)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.details() or "").startswith("hello.role:"), err.details()
    err = await _refused_hello(server, "d1", pool="elsewhere")
    assert (err.details() or "").startswith("hello.pool:"), err.details()
    async with AdminClient(target(server)) as admin:
        info = (await admin.get_node("d1")).node.state.info
        assert (info.role, info.pool, info.labels) == (NodeRole.DECODE, "default", {"zone": "a"})
        await admin.cordon("d1", "moving to prefill")
        await agents(server, "d1", role=common_pb2.NODE_ROLE_PREFILL, pool="p2")
        info = (await admin.get_node("d1")).node.state.info
        assert (info.role, info.pool, info.cordoned) == (NodeRole.PREFILL, "p2", True)


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        ({f"k{i}": "v" for i in range(MAX_LABELS + 1)}, "hello.labels"),
        ({"k": "v" * 10_000}, "hello.labels"),
        ({"bad key!": "v"}, "hello.labels"),
        ({"k" * 1_000: "v"}, "hello.labels"),
    ],
)
async def test_label_limits(cluster, labels, named):
    server = await cluster.start()
    err = await _refused_hello(server, "d1", labels=labels)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith(named), err.details()
    async with AdminClient(target(server)) as admin:
        assert await admin.list_nodes() == []


async def test_leases_only_from_decode_and_load_only_from_prefill(cluster, agents):
    server = await cluster.start()
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL, pool="pa")
    ack = await prefill.send_lease()
    assert ack.result == lease_pb2.LEASE_RESULT_INVALID
    assert ack.message.startswith("lease:") and "only decode nodes lease" in ack.message
    decode = await agents(server, "d1")
    await decode.send_pool_load(pool="pa")
    await decode.sync()
    await prefill.send_pool_load(pool="pb")  # not its registered pool
    await prefill.sync()
    async with AdminClient(target(server)) as admin:
        assert (await admin.get_node("p1")).node.state.lease is None
        assert all(not p.reports for p in await admin.list_pools())
        await prefill.send_pool_load(pool="pa")
        await prefill.sync()
        pools = {p.pool: [r.node_id for r in p.reports] for p in await admin.list_pools()}
        assert pools == {"pa": ["p1"]}
