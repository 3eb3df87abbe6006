"""What admission computes once and reuses (``Admitter._demand``, ``Admitter._rooms``) still
answers each request on its own facts: a prompt bound for one prefill server gets that server's
Demand whichever server the Admit before it named, and a node's room is recomputed once its
state changes, even in a list object the store hands out again."""

from __future__ import annotations

import pytest

from crossflow_ctl.domain.admission import AdmissionRequest, Reason, node_rooms
from crossflow_ctl.domain.models import Credits, NodeRole, PoolLoad, Shares
from crossflow_ctl.domain.room import node_room
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.service.room import NodeRooms
from crossflow_ctl.store.memory import MemoryStore
from tests.broker.conftest import TEST_POLICY, lending_broker
from tests.domain.test_admission import NOW, node


def _to(server: str) -> AdmissionRequest:
    return AdmissionRequest(uncached_prompt_tokens=100, prefill_node_id=server)


async def _jammed_and_idle(sequential: bool) -> Broker:
    """A lending broker whose pool reports waits in time: p0 jammed (30 s), p1 idle."""
    broker = await lending_broker(MemoryStore(seed=1), TEST_POLICY, sequential=sequential)
    await broker.register("p0", NodeRole.PREFILL, "default", {})
    for node_id, wait_ms in (("p0", 30_000.0), ("p1", 0.0)):
        load = PoolLoad(
            node_id=node_id,
            outstanding_uncached_tokens=1000,
            processing_rate_tps=1e4,
            ttl_ms=60_000,
            queue_wait_ms=wait_ms,
        )
        await broker.ingest_pool_load(load)
    return broker


@pytest.mark.parametrize("sequential", [True, False])
async def test_each_admit_gets_its_own_prefill_servers_demand(sequential: bool) -> None:
    broker = await _jammed_and_idle(sequential)
    answers = [await broker.admit(_to(server)) for server in ("p0", "p1", "p0")]
    assert [a.reason for a in answers] == [Reason.BORROWED, Reason.NO_DEMAND, Reason.BORROWED]
    broker = await _jammed_and_idle(sequential)  # nothing sent to p1 yet
    batch = await broker.admit_many([_to("p0"), _to("p1"), _to("p0")])
    assert [a.reason for a in batch] == [Reason.BORROWED, Reason.NO_DEMAND, Reason.BORROWED]


async def test_servers_that_do_not_report_are_not_kept() -> None:
    """Routers name the server: names without a report (their wait unknown) are answered, not
    kept, so a router cycling names cannot grow the broker's memory."""
    broker = await _jammed_and_idle(sequential=True)
    await broker.admit(_to("p0"))
    for i in range(20):
        answer = await broker.admit(_to(f"gone{i}"))
        assert answer.reason is Reason.POOL_LOAD_MISSING
    memo = broker._admitter._last_demand
    assert memo is not None and set(memo.by_server) <= {"p0", "p1"}


async def test_rooms_follow_node_states_even_in_a_list_handed_out_again() -> None:
    broker = await lending_broker(MemoryStore(seed=1), TEST_POLICY)
    admitter = broker._admitter
    nodes = [node("d0"), node("d1")]
    assert admitter._rooms(nodes, 1.0) == node_rooms(nodes, 1.0)
    nodes[1] = node("d1", debits=Credits(compute_tokens=500, slots=1))  # same list, new state
    assert admitter._rooms(nodes, 1.0) == node_rooms(nodes, 1.0)
    assert admitter._rooms(nodes, 0.5) == node_rooms(nodes, 0.5)


def test_room_views_node_rooms_follow_state_share_and_expiry() -> None:
    """A room view's node rooms (kept per node state) are node_room's: a new state of a node,
    another share, and the lease's expiry passing each give the room afresh."""
    rooms = NodeRooms()
    d0 = node("d0", expires_at=NOW + 500)
    first = rooms(d0, 1.0, NOW)
    assert first is not None and first == node_room(d0, 1.0, NOW)
    assert rooms(d0, 1.0, NOW + 499) is first  # the same state, before expiry: kept
    assert rooms(d0, 1.0, NOW + 500) is None  # expired: no room, as node_room says
    assert rooms(d0, 1.0, NOW) == first
    # Same node, share and side of its expiry; a new state (a debit): the room afresh.
    busier = node("d0", expires_at=NOW + 500, debits=Credits(compute_tokens=500, slots=1))
    assert rooms(busier, 1.0, NOW) == node_room(busier, 1.0, NOW) != first
    half = Shares(0.5, 1.0, 1.0, 0.5, 0.5)
    assert rooms(d0, half, NOW) == node_room(d0, half, NOW) != first
