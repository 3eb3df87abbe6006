"""Issue 12, phantom holds: outcomes are exact under timeouts and retries.

An Admit the broker answered NORMAL because the store was slow must not leave a debit that no
router can release; a retry with the same request_id gets the first call's outcome and never a
second debit; Commit and Release replay their recorded outcome. Real gRPC, both stores; the
slow store delays the debit so it lands after the broker gave up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.client import AdminClient, AdmissionClient
from crossflow_ctl.domain.admission import Decision, Reason
from crossflow_ctl.domain.errors import FailedPrecondition
from crossflow_ctl.domain.models import ReservationState
from crossflow_ctl.domain.policy import PolicySettings
from tests.broker.conftest import TEST_POLICY, target


class SlowDebits:
    """The broker's store, with every debit landing ``delay_s`` late, as a Redis script does
    whose reply is slow: once sent it runs, whether or not the caller still waits."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner = inner
        self.delay_s = delay_s
        self.debits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def try_debit(self, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.shield(asyncio.ensure_future(self._land(*args, **kwargs)))

    async def _land(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(self.delay_s)
        self.debits += 1
        return await self._inner.try_debit(*args, **kwargs)


async def _lending_cluster(cluster, agents, policy: PolicySettings = TEST_POLICY):
    server = await cluster.start(policy=policy)
    decode = await agents(server, "d1")
    assert (await decode.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    return server, decode


async def _settled_reservations(server, want: int) -> list[Any]:
    """Open reservations once ``want`` exist and none is HELD or COMMITTED any more."""
    async with AdminClient(target(server)) as admin:
        async with asyncio.timeout(10):
            while True:
                found = await admin.list_reservations()
                if len(found) >= want and all(r.state is ReservationState.RELEASED for r in found):
                    return found
                await asyncio.sleep(0.05)


async def test_a_debit_landing_after_a_timeout_is_released(cluster, agents) -> None:
    server, decode = await _lending_cluster(
        cluster, agents, TEST_POLICY.updated({"admit_timeout_ms": 50})
    )
    slow = server.broker.store = SlowDebits(server.broker.store, delay_s=0.3)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        answer = await client.admit(request_id="late-1", uncached_prompt_tokens=100)
        assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.TIMEOUT)
        found = await _settled_reservations(server, 1)
        assert slow.debits == 1 and [r.request_id for r in found] == ["late-1"]
        # The agent heard of both the grant and its release (its next lease frees the credit).
        rid = found[0].reservation_id
        await decode.wait_notice(
            lambda n: n.reservation_id == rid and n.kind == lease_pb2.NOTICE_KIND_RELEASE
        )
        # A retry gets the same NORMAL, not a new decision.
        again = await client.admit(request_id="late-1", uncached_prompt_tokens=100)
        assert again.replayed and again.reason is Reason.TIMEOUT
        assert slow.debits == 1


async def test_a_retried_admit_gets_the_same_reservation(cluster, agents) -> None:
    server, _ = await _lending_cluster(cluster, agents)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        first = await client.admit(request_id="r-1", uncached_prompt_tokens=100)
        assert first.decision is Decision.BORROW and not first.replayed
        retry = await client.admit(request_id="r-1", uncached_prompt_tokens=100)
        assert retry.replayed and retry.reservation_id == first.reservation_id
        other = await client.admit(request_id="r-2", uncached_prompt_tokens=100)
        assert other.reservation_id not in ("", first.reservation_id)
    async with AdminClient(target(server)) as admin:
        assert len(await admin.list_reservations()) == 2


async def test_a_retry_while_the_first_call_hangs_wins_and_the_late_debit_is_released(
    cluster, agents
) -> None:
    server, _ = await _lending_cluster(
        cluster, agents, TEST_POLICY.updated({"admit_timeout_ms": 5_000})
    )
    server.broker.store = SlowDebits(server.broker.store, delay_s=0.8)
    async with AdmissionClient(target(server), timeout_s=5, retries=0) as client:
        first = asyncio.create_task(client.admit(request_id="r-3", uncached_prompt_tokens=100))
        await asyncio.sleep(0.3)  # the first call has claimed the record and is debiting
        retry = await client.admit(request_id="r-3", uncached_prompt_tokens=100)
        assert (retry.decision, retry.reason) == (Decision.NORMAL, Reason.TIMEOUT)
        late = await first
        # The first call lost the race to settle: it answers the retry's outcome ...
        assert late.decision is Decision.NORMAL and late.replayed and not late.reservation_id
    # ... and the debit it made is released, not left for nobody.
    await _settled_reservations(server, 1)


async def test_commit_and_release_replay_their_recorded_outcome(cluster, agents) -> None:
    server, _ = await _lending_cluster(cluster, agents)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        adm = await client.admit(uncached_prompt_tokens=100)
        rid = adm.reservation_id
        committed = await client.commit(rid, request_id="c-1")
        await client.release(rid, request_id="x-1")
        # The same ids replay the first outcomes, although the reservation moved on since ...
        assert await client.commit(rid, request_id="c-1") == committed
        assert await client.release(rid, request_id="x-1") == rid
        # ... while a new commit sees the release.
        with pytest.raises(FailedPrecondition):
            await client.commit(rid, request_id="c-2")
        with pytest.raises(FailedPrecondition):  # a refusal records nothing: refused again
            await client.commit(rid, request_id="c-2")
