"""End to end over loopback gRPC: agents stream leases, a router admits, commits, releases.

Covers DESIGN.md §5.1 (stale refused), §5.2 (replace, never add), §5.4 (causal release, with a
lease computed before the release notice), §5.5 (expired lease counts as zero) and §6 (notices
relayed through the store from replica A's Admit to the agent streaming on replica B).
"""

from __future__ import annotations

from typing import Any

import pytest

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.client import AdminClient, AdmissionClient
from crossflow_ctl.domain.admission import AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.errors import NotFound
from crossflow_ctl.domain.models import ReservationState
from tests.broker.conftest import TEST_POLICY, target


async def _setup(cluster: Any, agents: Any, *, slots: int = 4) -> tuple[Any, Any, Any]:
    server = await cluster.start()
    decode = await agents(server, "d1")
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    ack = await decode.send_lease(credits={"slots": slots})
    assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED, ack
    return server, decode, prefill


async def test_admit_commit_release_with_notices(cluster, agents) -> None:
    server, decode, _ = await _setup(cluster, agents)
    assert decode.welcome is not None and decode.welcome.max_lease_ttl_ms == 2_000
    # the units the agent needs to read its grants as the broker priced them
    assert decode.welcome.borrow_horizon_ms == TEST_POLICY.borrow_horizon_ms
    assert decode.welcome.kv_bytes_per_token == TEST_POLICY.kv_bytes_per_token
    async with (
        AdmissionClient(target(server), timeout_s=5) as client,
        AdminClient(target(server)) as admin,
    ):
        adm = await client.admit(
            request_id="r1", uncached_prompt_tokens=1_000, expected_output_tokens=100
        )
        assert adm.decision is Decision.BORROW, adm.message
        assert adm.node_id == "d1" and adm.reservation_id
        assert adm.plan is None  # no explanation unless asked for (AdmitRequest.explain)
        grant = await decode.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_GRANT)
        assert grant.reservation_id == adm.reservation_id
        assert grant.debit.compute_tokens == 1_000 and grant.debit.slots == 1
        # no prefix pulled in, said by the grant itself (the agent needs no unit to read it)
        assert grant.HasField("pulled_tokens") and grant.pulled_tokens == 0

        committed = await client.commit(adm.reservation_id)
        assert committed.expires_at_ms > adm.expires_at_ms
        detail = await admin.get_node("d1")
        assert [r.state for r in detail.reservations] == [ReservationState.COMMITTED]
        assert detail.node.state.open_debits.compute_tokens == 1_000
        assert detail.node.available.compute_tokens == 8_000 - 1_000

        await client.release(adm.reservation_id)
        await decode.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_RELEASE)
        nodes = await admin.list_nodes()
        assert [n.state.info.node_id for n in nodes] == ["d1", "p1"]
        pools = await admin.list_pools()
        assert pools[0].outstanding_uncached_tokens == 200_000

        explained = await client.admit(
            request_id="r2", uncached_prompt_tokens=1_000, expected_output_tokens=100, explain=True
        )
        assert explained.plan is not None and explained.plan.ranked[0].node_id == "d1"
        # its node's text is built from the check's numbers, on the wire and back
        check = explained.plan.ranked[0]
        assert check.detail == "" and check.text(explained.plan.normal_ms) == (
            f"predicted {check.predicted_ttft_ms:.1f} ms"
        )


async def test_stale_lease_is_refused_and_changes_nothing(cluster, agents) -> None:  # §5.1
    server, decode, _ = await _setup(cluster, agents)
    ack = await decode.send_lease()  # version 2
    assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
    from tests.broker.agents import lease_msg

    stale = lease_msg("d1", 1, 1, credits={"compute_tokens": 1})
    ack = await decode.send_lease(stale)
    assert ack.result == lease_pb2.LEASE_RESULT_STALE
    assert (ack.stored_epoch, ack.stored_version) == (1, 2)
    async with AdminClient(target(server)) as admin:
        node = (await admin.get_node("d1")).node
        assert node.state.lease is not None
        assert node.state.lease.lease.version == 2
        assert node.state.lease.lease.credits.compute_tokens == 8_000
    # A new epoch (agent restart) is newer whatever its version.
    ack = await decode.send_lease(lease_msg("d1", 2, 1))
    assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED


async def test_new_lease_replaces_never_adds(cluster, agents) -> None:  # §5.2
    server, decode, _ = await _setup(cluster, agents, slots=1)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        first = await client.admit(uncached_prompt_tokens=500)
        assert first.decision is Decision.BORROW
        assert (await client.admit(uncached_prompt_tokens=500)).reason is Reason.NO_ROOM
        # The agent re-offers one slot without having seen the grant: still no room.
        ack = await decode.send_lease(credits={"slots": 1}, last_notice_seq=0)
        assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
        assert (await client.admit(uncached_prompt_tokens=500)).reason is Reason.NO_ROOM


async def test_causal_release_waits_for_a_lease_that_saw_it(cluster, agents) -> None:  # §5.4
    server, decode, _ = await _setup(cluster, agents, slots=1)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        adm = await client.admit(uncached_prompt_tokens=500)
        assert adm.decision is Decision.BORROW
        grant = await decode.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_GRANT)
        await client.commit(adm.reservation_id)
        await client.release(adm.reservation_id)
        release = await decode.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_RELEASE)
        # A lease whose snapshot predates the release notice must not free the credit.
        ack = await decode.send_lease(credits={"slots": 1}, last_notice_seq=grant.seq)
        assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
        again = await client.admit(uncached_prompt_tokens=500)
        assert again.decision is Decision.NORMAL and again.reason is Reason.NO_ROOM
        # Once a lease was computed after the agent saw the release, the credit is free.
        ack = await decode.send_lease(credits={"slots": 1}, last_notice_seq=release.seq)
        assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
        assert (await client.admit(uncached_prompt_tokens=500)).decision is Decision.BORROW


async def test_expired_lease_counts_as_zero(cluster, agents, clock) -> None:  # §5.5
    server, decode, prefill = await _setup(cluster, agents)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        assert (await client.admit(uncached_prompt_tokens=500)).decision is Decision.BORROW
        # The agent asks for an hour; the broker caps the TTL at max_lease_ttl_ms (2 s).
        await decode.send_lease(ttl_ms=3_600_000)
        clock.advance(2_001)
        await prefill.send_pool_load()
        await prefill.sync()
        adm = await client.admit(
            uncached_prompt_tokens=500, candidate_node_ids=["d1"], explain=True
        )
        assert adm.decision is Decision.NORMAL and adm.reason is Reason.NO_LEASES
        assert adm.plan is not None and adm.plan.nodes[0].detail == "lease expired"


async def test_zero_lease_and_cordon_stop_borrowing(cluster, agents) -> None:
    server, decode, _ = await _setup(cluster, agents)
    async with (
        AdmissionClient(target(server), timeout_s=5) as client,
        AdminClient(target(server)) as admin,
    ):
        ack = await decode.send_lease(
            credits={
                k: 0
                for k in (
                    "compute_tokens",
                    "kv_tokens",
                    "kv_transfer_bytes",
                    "output_tokens",
                    "slots",
                )
            },
            zero_reason=common_pb2.ZERO_REASON_ITL_OVER_SLO,
        )
        assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
        adm = await client.admit(
            uncached_prompt_tokens=500, candidate_node_ids=["d1"], explain=True
        )
        assert adm.plan is not None and adm.reason is Reason.NO_LEASES
        assert "itl_over_slo" in adm.plan.nodes[0].detail

        await decode.send_lease()
        assert (await client.admit(uncached_prompt_tokens=500)).decision is Decision.BORROW
        view = await admin.cordon("d1", reason="maintenance")
        assert view.state.info.cordoned
        await decode.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_CORDON)
        adm = await client.admit(uncached_prompt_tokens=500, candidate_node_ids=["d1"])
        assert adm.decision is Decision.NORMAL and adm.reason is Reason.NO_LEASES
        await admin.uncordon("d1")
        await decode.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_UNCORDON)
        assert (await client.admit(uncached_prompt_tokens=500)).decision is Decision.BORROW


async def test_notices_relay_from_replica_a_to_agent_on_replica_b(cluster, agents) -> None:
    a = await cluster.start()
    b = await cluster.start()
    decode = await agents(b, "d1")
    prefill = await agents(a, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    assert (await decode.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
    async with AdmissionClient(target(a), timeout_s=5) as client:
        adm = await client.admit(uncached_prompt_tokens=700)
        assert adm.decision is Decision.BORROW
        grant = await decode.wait_notice(lambda n: n.reservation_id == adm.reservation_id)
        assert grant.kind == lease_pb2.NOTICE_KIND_GRANT
        await client.release(adm.reservation_id)
        await decode.wait_notice(lambda n: n.kind == lease_pb2.NOTICE_KIND_RELEASE)
    # An agent reconnecting to replica A resumes after the last notice it saw.
    seen = decode.last_notice_seq
    await decode.close()
    again = await agents(a, "d1", last_notice_seq=seen - 1)
    resumed = await again.wait_notice(lambda n: True)
    assert resumed.seq == seen and resumed.kind == lease_pb2.NOTICE_KIND_RELEASE


@pytest.mark.parametrize("batches", [True, False], ids=["notice-batches", "one-per-message"])
async def test_notices_of_admissions_decided_together_reach_the_agent(
    cluster, agents, batches: bool
) -> None:
    """Admits decided in one group commit write their grants in one script: an agent that set
    Hello.notice_batches gets what one read found as one message, an older agent one message
    per notice; either way every grant, in order."""
    server = await cluster.start()
    decode = await agents(server, "d1", notice_batches=batches)
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    assert (await decode.send_lease(credits={"slots": 8})).result == lease_pb2.LEASE_RESULT_ACCEPTED
    requests = [AdmissionRequest(uncached_prompt_tokens=100) for _ in range(6)]
    answers = await server.broker.admit_many(requests)  # one batch: one script, one wake
    assert [a.decision for a in answers] == [Decision.BORROW] * 6
    last = await decode.wait_notice(lambda n: n.reservation_id == answers[-1].reservation_id)
    grants = [n for n in decode.notices if n.kind == lease_pb2.NOTICE_KIND_GRANT]
    assert [n.reservation_id for n in grants] == [a.reservation_id for a in answers]
    assert [n.seq for n in decode.notices] == sorted({n.seq for n in decode.notices})
    assert last.seq == decode.notices[-1].seq
    if batches:  # the script is atomic: one read finds all six
        assert decode.batches == 1
    else:
        assert decode.batches == 0


async def test_reservations_expire_and_free_their_credit(cluster, agents, clock) -> None:  # §5.5
    server, decode, prefill = await _setup(cluster, agents, slots=1)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        held = await client.admit(uncached_prompt_tokens=500)
        assert held.decision is Decision.BORROW
        assert (await client.admit(uncached_prompt_tokens=500)).reason is Reason.NO_ROOM
        clock.advance(2_001)  # past hold_ttl_ms: never committed
        await decode.send_lease(credits={"slots": 1})
        await prefill.send_pool_load()
        await prefill.sync()
        with pytest.raises(NotFound):
            await client.commit(held.reservation_id)
        assert (await client.admit(uncached_prompt_tokens=500)).decision is Decision.BORROW
