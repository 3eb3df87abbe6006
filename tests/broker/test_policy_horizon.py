"""A live change of the borrow horizon (DESIGN.md §4: the commit TTL must outlast the longest
borrowed prefill the horizon allows): every replica pushes the new settings down its open agent
streams; until agents adopt them, a lease is capped to the replica's horizon at ingest, and the
commit TTL may not drop below a horizon that leases may still be sized over."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from crossflow_ctl.api.v1 import lease_pb2
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.errors import FailedPrecondition
from crossflow_ctl.domain.models import Credits, Lease
from crossflow_ctl.domain.policy import PolicySettings, retire_horizon
from crossflow_ctl.domain.session import within_horizon
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from tests.broker.agents import FakeAgent
from tests.broker.conftest import TEST_POLICY, Cluster

HORIZON = TEST_POLICY.borrow_horizon_ms
REFRESH_MS = 50


async def test_every_replica_pushes_a_policy_change_down_its_open_streams(
    cluster: Cluster, agents: Callable[..., Awaitable[FakeAgent]]
) -> None:
    first = await cluster.start(policy_refresh_ms=REFRESH_MS)
    second = await cluster.start(policy_refresh_ms=REFRESH_MS)
    on_first, on_second = await agents(first, "d1"), await agents(second, "d2")
    assert on_first.welcome is not None and on_first.welcome.borrow_horizon_ms == HORIZON

    changed = await second.broker.set_policy({"borrow_horizon_ms": HORIZON // 2})
    for agent in (on_first, on_second):  # the first replica learns it on its next re-read
        (settings,) = await agent.wait_settings(1)
        assert settings.borrow_horizon_ms == HORIZON // 2
        assert settings.policy_version == changed.version
        assert settings.max_lease_ttl_ms == TEST_POLICY.max_lease_ttl_ms
        assert settings.kv_bytes_per_token == TEST_POLICY.kv_bytes_per_token

    # A change that leaves the agents' settings alone sends nothing; the next that does, does.
    await second.broker.set_policy({"demand_threshold_ms": 5.0})
    await second.broker.set_policy({"kv_bytes_per_token": 1024})
    for agent in (on_first, on_second):
        settings = (await agent.wait_settings(2))[1]
        assert settings.kv_bytes_per_token == 1024 and settings.borrow_horizon_ms == HORIZON // 2
        assert settings.policy_version == changed.version + 2
        await agent.sync()
        assert len(agent.settings) == 2 and agent.ended is None


async def test_a_lease_sized_over_a_longer_horizon_is_capped_at_ingest(
    cluster: Cluster, agents: Callable[..., Awaitable[FakeAgent]]
) -> None:
    """An agent that has not adopted the new horizon yet (or never will: an older agent) offers
    compute over the old one; the replica stores no more than its rate covers in the new one."""
    server = await cluster.start()
    agent = await agents(server, "d1")
    rate, wait_ms = 20_000.0, 500.0
    over_old = int(rate * (HORIZON - wait_ms) / 1000)
    ack = await agent.send_lease(
        credits={"compute_tokens": over_old}, borrowed_prefill_rate_tps=rate, queue_wait_ms=wait_ms
    )
    assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
    detail = await server.broker.get_node("d1")
    assert detail.state.lease is not None
    assert detail.state.lease.lease.credits.compute_tokens == over_old  # within the horizon

    await server.broker.set_policy({"borrow_horizon_ms": HORIZON // 4})
    ack = await agent.send_lease(
        credits={"compute_tokens": over_old}, borrowed_prefill_rate_tps=rate, queue_wait_ms=wait_ms
    )
    assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
    detail = await server.broker.get_node("d1")
    assert detail.state.lease is not None
    stored = detail.state.lease.lease
    assert stored.credits.compute_tokens == int(rate * (HORIZON // 4 - wait_ms) / 1000)
    assert stored.credits.kv_tokens == 100_000  # the other credits as sent
    assert stored.credits.output_tokens == 8_000  # the lease does not say its horizon


async def test_a_lease_that_says_a_longer_horizon_is_stored_with_output_scaled(
    cluster: Cluster, agents: Callable[..., Awaitable[FakeAgent]]
) -> None:
    server = await cluster.start()
    agent = await agents(server, "d1")
    await server.broker.set_policy({"borrow_horizon_ms": HORIZON // 4})
    ack = await agent.send_lease(
        credits={"output_tokens": 8_001, "kv_transfer_bytes": 10**9 + 3}, horizon_ms=HORIZON
    )
    assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
    detail = await server.broker.get_node("d1")
    assert detail.state.lease is not None
    stored = detail.state.lease.lease
    assert stored.horizon_ms == HORIZON  # what the agent said, kept
    assert stored.credits.output_tokens == 8_001 * (HORIZON // 4) // HORIZON
    assert stored.credits.kv_transfer_bytes == (10**9 + 3) * (HORIZON // 4) // HORIZON
    assert stored.credits.kv_tokens == 100_000 and stored.credits.slots == 4


def test_the_cap_leaves_a_lease_within_the_horizon_alone() -> None:
    lease = Lease(
        node_id="d1",
        epoch=1,
        version=1,
        ttl_ms=1_000,
        credits=Credits(compute_tokens=1_000, kv_tokens=5),
        queue_wait_ms=100.0,
        borrowed_prefill_rate_tps=1_000.0,
    )
    assert within_horizon(lease, 1_100) is lease  # 1,000 tokens/s x (1.1 s - 0.1 s)
    assert within_horizon(lease, 1_099).credits.compute_tokens == 999
    assert within_horizon(lease, 50).credits == Credits(compute_tokens=0, kv_tokens=5)
    unsized = lease.model_copy(update={"borrowed_prefill_rate_tps": 0.0})
    assert within_horizon(unsized, 50) is unsized  # no rate: nothing to size by


SIZED = Credits(
    compute_tokens=0, kv_tokens=500, kv_transfer_bytes=10**9 + 7, output_tokens=999, slots=4
)


def test_output_and_kv_transfer_scale_by_the_horizon_the_lease_was_sized_over() -> None:
    lease = Lease(node_id="d1", epoch=1, version=1, ttl_ms=1_000, credits=SIZED, horizon_ms=8_000)
    assert within_horizon(lease, 8_000) is lease  # sized over this horizon
    assert within_horizon(lease, 9_000) is lease  # or a shorter one
    quarter = within_horizon(lease, 2_000).credits
    assert quarter.output_tokens == 249  # floor(999 / 4)
    assert quarter.kv_transfer_bytes == (10**9 + 7) // 4
    assert (quarter.kv_tokens, quarter.slots, quarter.compute_tokens) == (500, 4, 0)
    assert within_horizon(lease, 7_999).credits.output_tokens == 998  # floor(999 x 7999 / 8000)


def test_a_lease_that_does_not_say_its_horizon_keeps_output_and_kv_transfer() -> None:
    """An agent older than ``Lease.horizon_ms``: only compute, which its rate sizes, is capped."""
    lease = Lease(
        node_id="d1",
        epoch=1,
        version=1,
        ttl_ms=1_000,
        credits=SIZED.model_copy(update={"compute_tokens": 8_000}),
        borrowed_prefill_rate_tps=1_000.0,
    )
    capped = within_horizon(lease, 2_000).credits
    assert capped == SIZED.model_copy(update={"compute_tokens": 2_000})
    said = lease.model_copy(update={"horizon_ms": 8_000})
    assert within_horizon(said, 2_000).credits == Credits(
        compute_tokens=2_000,
        kv_tokens=500,
        kv_transfer_bytes=(10**9 + 7) // 4,
        output_tokens=249,
        slots=4,
    )


async def test_the_commit_ttl_outlasts_a_lowered_horizon_until_it_has_settled() -> None:
    """Lowered together, a commit TTL below the old horizon would let a reservation granted
    against a lease sized over it expire while its prefill runs: refused until the leases
    sized over the old horizon, and the grants against them, are gone."""
    clock, store = ManualClock(1_700_000_000_000), MemoryStore()
    policy = PolicySettings(borrow_horizon_ms=8_000, commit_ttl_ms=30_000)
    one = Broker(store, clock, BrokerSettings(policy=policy, policy_refresh_ms=1_000))
    other = Broker(store, clock, BrokerSettings(policy=policy, policy_refresh_ms=1_000))
    await one.load_policy()
    await other.load_policy()
    with pytest.raises(FailedPrecondition, match="at least 8000") as refused:
        await one.set_policy({"borrow_horizon_ms": 2_000, "commit_ttl_ms": 3_000})
    assert refused.value.field == "commit_ttl_ms"
    assert (await one.get_policy()).policy.borrow_horizon_ms == 8_000  # nothing changed

    await one.set_policy({"borrow_horizon_ms": 2_000})
    await other.load_policy()  # the other replica's re-read
    settle_ms = 1_000 + policy.max_lease_ttl_ms + policy.hold_ttl_ms
    clock.advance(settle_ms - 1)
    for broker in (one, other):
        with pytest.raises(FailedPrecondition, match="commit_ttl_ms"):
            await broker.set_policy({"commit_ttl_ms": 3_000})
    await one.set_policy({"commit_ttl_ms": 8_000})  # not below the old horizon: allowed
    clock.advance(1)
    assert (await other.set_policy({"commit_ttl_ms": 3_000})).policy.commit_ttl_ms == 3_000
    # Raising the horizon retires nothing: the commit TTL only has to outlast the new one. (A
    # commit TTL write right after a raise cannot show it: the TTL already outlasts the raised
    # horizon, and one equal to the stored is no write at all; so the rule itself.)
    raised = await one.set_policy({"borrow_horizon_ms": 3_000})
    assert raised.policy.borrow_horizon_ms == 3_000
    assert retire_horizon(policy, policy.updated({"borrow_horizon_ms": 9_000}), 0, 1_000) is None
    assert retire_horizon(policy, policy.updated({"borrow_horizon_ms": 2_000}), 0, 1_000)
