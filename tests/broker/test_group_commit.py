"""Admission's group commit and one-round-trip request records, on the service (no gRPC) over
real Redis: unary Admits arriving together share one debit round trip, each with its own
answer and Safety re-check; a BORROW with a request id is ONE round trip where the store folds
the record into the debit's script (standalone Redis), two where it cannot (Redis Cluster),
with the same replays; a caller that stops waiting has its grant (and record) released."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from crossflow_ctl.domain.admission import AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import ReservationState
from crossflow_ctl.store.redis_store import RedisStore
from tests.broker.conftest import TEST_POLICY, lending_broker
from tests.broker.test_exact_outcomes import SlowDebits
from tests.conftest import eventually, patient_redis_store
from tests.store.test_redis_round_trips import CountingConnection

PATIENT = TEST_POLICY.model_copy(update={"admit_timeout_ms": 10_000})


@pytest.fixture
async def counted(redis_url: str, redis_namespace: str) -> AsyncIterator[RedisStore]:
    """A Redis store whose connections count the round trips they make."""
    client: Redis = Redis.from_url(redis_url, connection_class=CountingConnection)
    store = patient_redis_store(client, redis_namespace, cache_max_age_ms=60_000)
    try:
        yield store
    finally:
        await store.close()
        await client.aclose()


def ask(request_id: str = "", attempt: int = 0) -> AdmissionRequest:
    return AdmissionRequest(request_id=request_id, uncached_prompt_tokens=100, attempt=attempt)


async def test_admits_arriving_together_share_one_round_trip(counted: RedisStore) -> None:
    broker = await lending_broker(counted, PATIENT, slots=3)
    await broker.admit(ask())  # warm: caches filled, script loaded; 2 slots left
    before = CountingConnection.sent
    answers = await asyncio.gather(*(broker.admit(ask()) for _ in range(4)))
    trips = CountingConnection.sent - before
    assert trips == 1
    # Each keeps its own answer, in order of arrival; the script re-checks Safety per debit.
    assert [a.decision for a in answers] == [Decision.BORROW] * 2 + [Decision.NORMAL] * 2
    assert {a.reason for a in answers[2:]} == {Reason.NO_ROOM}
    held = await broker.list_reservations()
    assert {a.reservation_id for a in answers[:2]} <= {r.reservation_id for r in held}
    assert len(held) == 3


@pytest.mark.parametrize("folds", [True, False], ids=["standalone", "cluster-like"])
async def test_a_borrow_with_a_request_id_is_one_round_trip_where_records_fold(
    counted: RedisStore, folds: bool
) -> None:
    counted.folds_request_records = folds  # False: the record's slot is not the node's
    broker = await lending_broker(counted, PATIENT)
    await broker.admit(ask())  # warm: caches filled, script loaded, the debit's connection open
    assert await counted.read_request("admit:none") is None  # and a pooled one for records
    before = CountingConnection.sent
    first = await broker.admit(ask("q-1"))
    trips = CountingConnection.sent - before
    reused = await broker.admit(ask("q-1"))  # a router reusing the id as a first call
    retry = await broker.admit(ask("q-1", attempt=1))
    await broker.drain()  # a debit that lost the race to record is released in the background
    assert first.decision is Decision.BORROW and not first.replayed
    assert trips == (1 if folds else 2)
    # The record written inside the script replays exactly as the one written after it.
    recorded = first.model_copy(update={"plan": None, "replayed": True})
    assert reused == retry == recorded
    live = [r for r in await broker.list_reservations() if r.state is ReservationState.HELD]
    assert [r.request_id for r in live].count("q-1") == 1


async def test_a_grant_for_a_caller_that_stopped_waiting_is_released_with_its_record(
    counted: RedisStore,
) -> None:
    slow = SlowDebits(counted, delay_s=0.0)
    broker = await lending_broker(slow, PATIENT)  # type: ignore[arg-type]  # a wrapped store
    await broker.admit(ask())  # warm
    slow.hold()
    gone = asyncio.create_task(broker.admit(ask("q-2")))
    await eventually(lambda: slow.sent == 2, "its debit on its way")
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    slow.let_go()

    async def released() -> list[Any]:  # the debit lands, then its release runs
        mine = [r for r in await broker.list_reservations() if r.request_id == "q-2"]
        return mine if [r.state for r in mine] == [ReservationState.RELEASED] else []

    mine = await eventually(released, "the grant released in the background")
    assert await counted.read_request("admit:q-2") is None
    again = await broker.admit(ask("q-2"))  # decides afresh: nothing replays the released one
    assert again.decision is Decision.BORROW and not again.replayed
    assert again.reservation_id != mine[0].reservation_id


def group_commit_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "admission-group-commit"]


async def test_a_lone_admit_is_decided_in_its_own_task_and_later_arrivals_wait_for_it(
    counted: RedisStore,
) -> None:
    slow = SlowDebits(counted, delay_s=0.0)
    broker = await lending_broker(slow, PATIENT, slots=3)  # type: ignore[arg-type]  # wrapped
    await broker.admit(ask())  # warm; 2 slots left
    warm, sent = slow.debits, slow.sent
    slow.hold()
    lone = asyncio.create_task(broker.admit(ask()))
    await eventually(lambda: slow.sent == sent + 1, "its debit on its way")
    assert slow.debits == warm and not group_commit_tasks()  # no hand-off to a flusher task
    later = [asyncio.create_task(broker.admit(ask())) for _ in range(2)]
    await asyncio.sleep(0.05)  # time to debit beside it, were they to (held, it cannot land)
    assert slow.sent == sent + 1  # they queue behind the lone one rather than debit beside it
    slow.pass_waiting()
    first = await lone
    assert first.decision is Decision.BORROW and slow.debits == warm + 1
    await eventually(lambda: slow.sent == sent + 2, "the two that waited debiting")
    slow.let_go()
    answers = await asyncio.gather(*later)
    assert slow.debits == warm + 2  # the two that waited went together, in one batch
    assert [a.decision for a in answers] == [Decision.BORROW, Decision.NORMAL]
    assert answers[1].reason is Reason.NO_ROOM


async def test_a_warm_lone_admit_starts_no_task_on_standalone_redis(
    redis_url: str, redis_namespace: str
) -> None:
    """Its debit is waited for in its own task on the dedicated connection (no task per debit
    round; the store's own connections write in the caller's task too)."""
    store = patient_redis_store(redis_url, redis_namespace, cache_max_age_ms=60_000)
    try:
        await _no_task_for_a_warm_admit(store)
    finally:
        await store.close()


async def _no_task_for_a_warm_admit(store: RedisStore) -> None:
    broker = await lending_broker(store, PATIENT)
    await broker.admit(ask())  # warm: caches filled, script loaded, the debit's connection open
    loop = asyncio.get_running_loop()
    started: list[str] = []
    default = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        started.append(getattr(coro, "__qualname__", repr(coro)))
        if default is not None:
            return default(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)
    try:
        answer = await broker.admit(ask())
    finally:
        loop.set_task_factory(default)
    assert answer.decision is Decision.BORROW
    assert started == []


class StalledDebits(SlowDebits):
    """Debits whose reply never comes: the store's own read timeout ends each one, as redis-py
    bounds a read with an ``asyncio.timeout`` set up inside the call."""

    async def try_debits(self, *args: object, **kwargs: object) -> object:
        try:
            async with asyncio.timeout(0.05):
                await asyncio.Event().wait()  # the reply that never comes
        except TimeoutError:
            raise StoreUnavailable("redis try_debits failed: Timeout reading from socket") from None
        raise AssertionError("unreachable")


async def test_a_store_timeout_inside_the_debit_fails_closed_and_spares_the_caller(
    counted: RedisStore,
) -> None:
    stalled = StalledDebits(counted, delay_s=0.0)
    broker = await lending_broker(stalled, PATIENT)  # type: ignore[arg-type]  # a wrapped store
    answer = await broker.admit(ask())  # a lone Admit: the store call is set up in its turn
    assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.STORE_UNAVAILABLE)
    await asyncio.sleep(0.1)  # were the timeout the caller's, it would cancel this
    answers = await asyncio.gather(*(broker.admit(ask()) for _ in range(3)))  # a batch too
    assert {(a.decision, a.reason) for a in answers} == {
        (Decision.NORMAL, Reason.STORE_UNAVAILABLE)
    }
