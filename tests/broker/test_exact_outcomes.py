"""Issue 12, phantom holds: outcomes are exact under timeouts and retries.

An Admit the broker answered NORMAL because the store was slow must not leave a debit that no
router can release; a retry with the same request_id gets the first call's outcome and never a
second debit; Commit and Release replay their recorded outcome. Real gRPC, both stores; the
slow store delays the debit so it lands after the broker gave up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc, common_pb2, lease_pb2
from crossflow_ctl.client import AdminClient, AdmissionClient, AdmissionStream
from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.errors import FailedPrecondition
from crossflow_ctl.domain.models import ReservationState
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.store.base import Store
from crossflow_ctl.wire.convert_admission import admission_from_proto
from tests.broker.conftest import TEST_POLICY, target
from tests.conftest import eventually


class SlowDebits:
    """The broker's store, with every debit landing ``delay_s`` late, and not before
    :meth:`let_go` while held (:meth:`hold`), as a Redis script does whose reply is slow: once
    sent it runs, whether or not the caller still waits. Holding makes "the debit is still on
    its way" true by construction; a delay alone was a race a loaded machine lost."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner = inner
        self.delay_s = delay_s
        self.debits = 0
        """Debit calls that have landed (gone on to the store)."""
        self.sent = 0
        """Debit calls made, landed or not."""
        self._open = asyncio.Event()
        self._open.set()

    def hold(self) -> None:
        self._open.clear()

    def let_go(self) -> None:
        self._open.set()

    def pass_waiting(self) -> None:
        """The debits held now go on; later ones are held."""
        self._open.set()
        self._open.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # The hand-off every store has by default, around this wrapper's own (late) debits.
    try_debits_settled = Store.try_debits_settled

    async def try_debits(self, *args: Any, **kwargs: Any) -> Any:
        self.sent += 1
        return await asyncio.shield(asyncio.ensure_future(self._land(*args, **kwargs)))

    async def _land(self, *args: Any, **kwargs: Any) -> Any:
        await self._open.wait()
        await asyncio.sleep(self.delay_s)
        self.debits += 1
        return await self._inner.try_debits(*args, **kwargs)


PATIENT = TEST_POLICY.updated({"admit_timeout_ms": 2_000})
"""A loaded machine must not turn an Admit into NORMAL (TIMEOUT) where that is not the point."""


async def _lending_cluster(cluster, agents, policy: PolicySettings = PATIENT):
    """A broker over a SlowDebits store (no delay until a test sets one), one decode node
    leasing and one prefill node reporting; returns the server, the decode agent and the
    store."""
    inner = cluster.store_factory
    cluster.store_factory = lambda: SlowDebits(inner(), delay_s=0.0)
    server = await cluster.start(policy=policy)
    decode = await agents(server, "d1")
    assert (await decode.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    return server, decode, server.store


async def _settled_reservations(server, want: int) -> list[Any]:
    """Open reservations once ``want`` exist and none is HELD or COMMITTED any more."""
    async with AdminClient(target(server)) as admin:

        async def settled() -> list[Any]:
            found = await admin.list_reservations()
            done = len(found) >= want and all(r.state is ReservationState.RELEASED for r in found)
            return found if done else []

        return await eventually(settled, f"{want} reservations, all released", every_s=0.05)


async def test_a_debit_landing_after_a_timeout_is_released(cluster, agents) -> None:
    # The debit is held until its Admit has timed out: the deadline (PATIENT's, not 50 ms)
    # can only pass in the debit, never in the reads before it.
    server, decode, slow = await _lending_cluster(cluster, agents)
    slow.hold()
    async with AdmissionClient(target(server), timeout_s=5) as client:
        answer = await client.admit(request_id="late-1", uncached_prompt_tokens=100)
        assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.TIMEOUT)
        assert slow.sent == 1  # timed out in its debit
        slow.let_go()
        found = await _settled_reservations(server, 1)
        assert slow.debits == 1 and [r.request_id for r in found] == ["late-1"]
        # The agent heard of both the grant and its release (its next lease frees the credit).
        rid = found[0].reservation_id
        await decode.wait_notice(
            lambda n: n.reservation_id == rid and n.kind == lease_pb2.NOTICE_KIND_RELEASE
        )
        # A retry times out the same way, and its late debit is released too.
        slow.hold()
        again = await client.admit(
            AdmissionRequest(request_id="late-1", uncached_prompt_tokens=100, attempt=1)
        )
        assert again.reason is Reason.TIMEOUT
        slow.let_go()
        assert len(await _settled_reservations(server, 2)) == 2 and slow.debits == 2


async def test_a_retried_admit_gets_the_same_reservation(cluster, agents) -> None:
    server, _, _ = await _lending_cluster(cluster, agents)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        first = await client.admit(request_id="r-1", uncached_prompt_tokens=100)
        assert first.decision is Decision.BORROW and not first.replayed
        for attempt in (1, 0):  # a retry, and a router reusing the id without saying so
            retry = await client.admit(
                AdmissionRequest(request_id="r-1", uncached_prompt_tokens=100, attempt=attempt)
            )
            assert retry.replayed and retry.reservation_id == first.reservation_id
        other = await client.admit(request_id="r-2", uncached_prompt_tokens=100)
        assert other.reservation_id not in ("", first.reservation_id)
    async with AdminClient(target(server)) as admin:
        live = [r for r in await admin.list_reservations() if r.state is ReservationState.HELD]
        assert sorted(r.reservation_id for r in live) == sorted(
            (first.reservation_id, other.reservation_id)
        )


async def test_a_retry_over_admit_stream_gets_the_first_outcome(cluster, agents) -> None:
    """AdmitStream keeps Admit's exactly-once promise: a retry (attempt > 0) sent over the
    stream replays the recorded answer, on every store, instead of debiting again."""
    server, _, _ = await _lending_cluster(cluster, agents)
    async with (
        AdmissionClient(target(server), timeout_s=5) as client,
        AdmissionStream(target(server), timeout_s=5) as stream,
    ):
        unary = await client.admit(request_id="u-1", uncached_prompt_tokens=100)
        streamed = await stream.admit(request_id="s-1", uncached_prompt_tokens=100)
        assert unary.decision is Decision.BORROW and streamed.decision is Decision.BORROW
        retries = await asyncio.gather(
            *(
                stream.admit(
                    AdmissionRequest(request_id=rid, uncached_prompt_tokens=100, attempt=1)
                )
                for rid in ("u-1", "s-1")
            )
        )
    assert all(r.replayed for r in retries)
    assert [r.reservation_id for r in retries] == [unary.reservation_id, streamed.reservation_id]
    async with AdminClient(target(server)) as admin:
        live = [r for r in await admin.list_reservations() if r.state is ReservationState.HELD]
    assert sorted(r.reservation_id for r in live) == sorted(
        (unary.reservation_id, streamed.reservation_id)
    )


async def test_a_retry_racing_the_first_call_gets_one_outcome_and_no_orphan(
    cluster, agents
) -> None:
    server, _, slow = await _lending_cluster(
        cluster, agents, TEST_POLICY.updated({"admit_timeout_ms": 5_000})
    )
    slow.hold()  # the first call's debit cannot land before the retry has come
    async with AdmissionClient(target(server), timeout_s=5, retries=0) as client:
        first = asyncio.create_task(client.admit(request_id="r-3", uncached_prompt_tokens=100))
        await eventually(lambda: slow.sent == 1, "the first call debiting")
        retried = asyncio.create_task(
            client.admit(AdmissionRequest(request_id="r-3", uncached_prompt_tokens=100, attempt=1))
        )
        await asyncio.sleep(0.2)  # for the retry to come (were it later, the outcome is the same)
        slow.let_go()
        retry, late = await retried, await first
    # Both calls answer the one recorded outcome ...
    assert retry.decision is late.decision is Decision.BORROW
    assert retry.reservation_id == late.reservation_id and (retry.replayed or late.replayed)
    # ... and the other debit is released, not left for nobody; where the record rides in the
    # debit's script (standalone Redis) the later call finds it there and debits nothing.
    debits = 1 if server.store.folds_request_records else 2
    async with AdminClient(target(server)) as admin:

        async def one_left() -> bool:
            found = await admin.list_reservations()
            held = [r.reservation_id for r in found if r.state is ReservationState.HELD]
            return len(found) == debits and held == [late.reservation_id]

        await eventually(one_left, "the other debit released", every_s=0.05)


async def test_commit_and_release_replay_their_recorded_outcome(cluster, agents) -> None:
    server, _, _ = await _lending_cluster(cluster, agents)
    async with (
        AdmissionClient(target(server), timeout_s=5) as client,
        grpc.aio.insecure_channel(target(server)) as channel,
    ):
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        rid = (await client.admit(uncached_prompt_tokens=100)).reservation_id
        commit = admission_pb2.CommitRequest(reservation_id=rid, request_id="c-1")
        committed = await stub.Commit(commit, timeout=5)
        await client.release(rid, request_id="x-1")
        # Retries with the same ids replay the first outcomes, though the reservation moved on
        commit.attempt = 1
        assert await stub.Commit(commit, timeout=5) == committed
        release = admission_pb2.ReleaseRequest(reservation_id=rid, request_id="x-1", attempt=1)
        assert (await stub.Release(release, timeout=5)).reservation_id == rid
        # ... while a new commit sees the release, and its refusal records nothing.
        for attempt in (0, 1):
            with pytest.raises(FailedPrecondition):
                await client.commit(rid, request_id=f"c-2-{attempt}")


async def test_a_retry_reads_no_record_apart_where_its_debit_writes_it(cluster, agents) -> None:
    """Where the record rides in the debit's script (standalone Redis), a retry is one round
    trip, as a first call: no read of the record before deciding, none written after a
    BORROW; the script answers an existing record instead of debiting, and a retry answering
    NORMAL by policy records it with SET NX GET, which hands back an earlier record. Elsewhere
    a retry reads the record first. The outcomes are the same on every store."""
    server, _, slow = await _lending_cluster(cluster, agents)
    calls: dict[str, int] = {"read_request": 0, "record_request": 0}
    for name in calls:
        inner = getattr(slow, name)

        async def counted(*args: Any, _inner: Any = inner, _name: str = name) -> Any:
            calls[_name] += 1
            return await _inner(*args)

        setattr(slow, name, counted)
    folds = server.store.folds_request_records

    async with grpc.aio.insecure_channel(target(server)) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)

        async def admit(rid: str, attempt: int, *nodes: str) -> Admission:
            # On the wire, as the client does not send an attempt of its caller's choosing.
            request = admission_pb2.AdmitRequest(
                request_id=rid, uncached_prompt_tokens=100, attempt=attempt
            )
            request.candidate_node_ids.extend(nodes)
            return admission_from_proto(await stub.Admit(request, timeout=5))

        first = await admit("f-1", 1)  # a retry whose first call never came
        assert first.decision is Decision.BORROW and not first.replayed
        assert calls == ({"read_request": 0, "record_request": 0} if folds else
                         {"read_request": 1, "record_request": 1})  # fmt: skip
        again = await admit("f-1", 2)  # plans BORROW: the record answers
        unknown = await admit("f-1", 3, "nosuch")  # plans NORMAL (no such node)
        for answer in (again, unknown):
            assert answer.replayed and answer.reservation_id == first.reservation_id
        # A retry answering NORMAL by policy is recorded; a later one replays it, not borrows.
        normal = await admit("n-1", 1, "nosuch")
        assert normal.decision is Decision.NORMAL and not normal.replayed
        later = await admit("n-1", 2)
        assert later.replayed and later.decision is Decision.NORMAL
        assert later.reason is normal.reason
    # Standalone: every BORROW plan went to the script (4), which debited only the first;
    # elsewhere the reads answered before any debit but the first.
    assert slow.debits == (3 if folds else 1)
    assert calls == ({"read_request": 0, "record_request": 2} if folds else
                     {"read_request": 5, "record_request": 2})  # fmt: skip
    async with AdminClient(target(server)) as admin:
        held = [r.reservation_id for r in await admin.list_reservations()]
    assert held == [first.reservation_id]
