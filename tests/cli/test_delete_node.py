"""``crossflowctl delete node`` on the real CLI against a real broker process (issue #11)."""

from __future__ import annotations

import asyncio
import json

import grpc

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.admission import Decision
from tests.broker.agents import FakeAgent, lease_msg
from tests.cli.conftest import Ctl, Fleet


async def _names(ctl: Ctl) -> list[str]:
    return [i["name"] for i in json.loads((await ctl("get", "nodes", "-o", "json")).out)["items"]]


async def test_delete_node_refuses_open_reservations_unless_forced(ctl: Ctl, fleet: Fleet) -> None:
    async with AdmissionClient(ctl.server, timeout_s=5) as client:
        granted = await client.admit(uncached_prompt_tokens=1000, candidate_node_ids=("decode-1",))
        assert granted.decision is Decision.BORROW
        await client.commit(granted.reservation_id)  # open for the commit TTL, not the hold
    refused = await ctl("delete", "node", "decode-1")
    assert refused.rc == 1
    assert refused.err.splitlines() == [
        "error: node 'decode-1' has 1 open reservation(s): use --force to delete it anyway"
    ]
    assert "decode-1" in await _names(ctl)

    forced = await ctl("delete", "node", "decode-1", "--force")
    assert (forced.rc, forced.out.strip()) == (
        0,
        "node/decode-1 deleted (1 open reservation(s) dropped)",
    )
    assert "decode-1" not in await _names(ctl)
    assert json.loads((await ctl("get", "reservations", "-o", "json")).out)["items"] == []
    missing = await ctl("delete", "node", "decode-1")
    assert (missing.rc, missing.err.splitlines()) == (
        3,
        ["error: node_id: unknown node 'decode-1' (`crossflowctl get nodes` lists them)"],
    )
    bad = await ctl("delete", "node", "no/such")
    assert bad.rc == 2 and bad.err.startswith("error: node_id: must match")


async def test_an_agent_of_a_deleted_node_reconnects_and_registers_again(ctl: Ctl) -> None:
    agent = FakeAgent(ctl.server, "decode-9")
    await agent.connect()
    try:
        await agent.send_lease()
        assert (await ctl("delete", "node", "decode-9")).rc == 0
        # Its next lease finds the node gone: the stream ends so the agent says Hello again.
        lease = lease_msg(agent.node_id, agent.epoch, agent.version + 1)
        await agent._call.write(lease_pb2.ConnectRequest(lease=lease))
        assert agent._reader is not None
        await asyncio.wait_for(agent._reader, timeout=10)  # the reader ends with the stream
        assert agent.ended is grpc.StatusCode.NOT_FOUND
    finally:
        await agent.close()
    again = FakeAgent(ctl.server, "decode-9")
    welcome = await again.connect()
    try:
        assert welcome.notice_seq == 0
        assert "decode-9" in await _names(ctl)
    finally:
        await again.close()


async def test_a_deleted_prefill_nodes_next_report_ends_its_stream_so_it_registers_again(
    ctl: Ctl,
) -> None:
    """As with a decode node's next lease: a deleted prefill node's next load report ends its
    stream (NOT_FOUND), so its agent says Hello again and the node is listed; before, the
    stream went on and the node's load kept counting in its pool, the node unlisted."""
    agent = FakeAgent(ctl.server, "prefill-9", role=common_pb2.NODE_ROLE_PREFILL)
    await agent.connect()
    try:
        await agent.send_pool_load()
        await agent.sync()
        assert (await ctl("delete", "node", "prefill-9")).rc == 0
        await agent.send_pool_load()
        assert agent._reader is not None
        await asyncio.wait_for(agent._reader, timeout=10)  # the reader ends with the stream
        assert agent.ended is grpc.StatusCode.NOT_FOUND
    finally:
        await agent.close()
    again = FakeAgent(ctl.server, "prefill-9", role=common_pb2.NODE_ROLE_PREFILL)
    await again.connect()
    try:
        await again.send_pool_load()
        await again.sync()
        assert "prefill-9" in await _names(ctl)
    finally:
        await again.close()
    help_text = (await ctl("delete", "node", "--help", server=False)).out
    assert "next lease or load report ends its stream" in " ".join(help_text.split())
