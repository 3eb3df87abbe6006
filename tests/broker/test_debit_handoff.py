"""The debit hand-off (``Store.try_debits_settled``): the outcome or error reaches the waiting
Admit, and an Admit that stops waiting (timeout or cancel) leaves the debits to land and hands
their outcomes to ``late`` (which releases what was granted).

Two forms: the default (the debit in a task of its own, the caller waiting on its outcome) and
the Redis store's, on a standalone Redis, where the caller's own task waits on the dedicated
connection and the replies a cancelled caller left are read in the background (no task per
debit round): proved here over real Redis behind a proxy that holds the replies back."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, Sum
from redis.asyncio import Redis

from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.domain.admission import AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import Credits, ReservationState
from crossflow_ctl.observability import BrokerMetrics
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.base import DebitOutcome, DebitRequest, Store
from crossflow_ctl.store.redis_store import RedisStore
from tests.broker.conftest import PATIENT_ADMIN_MS, TEST_POLICY, lending_broker
from tests.conftest import PATIENCE_S, eventually, patient_redis_store


class _Gated:
    """A store whose ``try_debits`` waits for ``gate``, then answers ``outcome`` (or raises
    it); the hand-off is the base class's."""

    def __init__(self, gate: asyncio.Event, outcome: Any = "granted") -> None:
        self.gate = gate
        self.outcome = outcome

    async def try_debits(self, *args: Any) -> Any:
        await self.gate.wait()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return [self.outcome]

    try_debits_settled = Store.try_debits_settled
    _late = None
    _late_debits = Store._late_debits
    settle = Store.settle


async def _settled(store: _Gated, late: list[Any]) -> Any:
    return await store.try_debits_settled([], 1.0, 0, 1, late.append)  # type: ignore[arg-type]


async def test_the_outcome_reaches_the_waiting_admit() -> None:
    late: list[Any] = []
    gate = asyncio.Event()
    gate.set()
    assert await _settled(_Gated(gate), late) == ["granted"]
    assert late == []


async def test_a_debit_error_reaches_the_admit_and_is_never_reported_unretrieved() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        gate = asyncio.Event()
        gate.set()
        with pytest.raises(StoreUnavailable):
            await _settled(_Gated(gate, StoreUnavailable("down")), [])
        await asyncio.sleep(0)
        gc.collect()  # an unretrieved task exception is reported when the task is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert reported == []


async def test_an_admit_that_stops_waiting_leaves_the_debit_to_land_and_hands_it_over() -> None:
    late: list[Any] = []
    gate = asyncio.Event()
    admit = asyncio.ensure_future(_settled(_Gated(gate), late))
    await asyncio.sleep(0.01)
    admit.cancel()
    with pytest.raises(asyncio.CancelledError):
        await admit
    assert late == []  # handed over once the debit is done
    gate.set()  # the debit lands after its Admit went away
    for _ in range(5):
        await asyncio.sleep(0)
    assert late == [["granted"]]


async def test_settle_waits_for_a_debit_its_caller_stopped_waiting_for_and_its_hand_over() -> None:
    """At shutdown the store settles first: a debit still running for a caller that went away
    lands and is handed over before the broker waits for its releases (here: the task path,
    which a Redis Cluster client and a busy in-process store take)."""
    late: list[Any] = []
    gate = asyncio.Event()
    store = _Gated(gate)
    admit = asyncio.ensure_future(_settled(store, late))
    await asyncio.sleep(0.01)
    admit.cancel()
    with pytest.raises(asyncio.CancelledError):
        await admit
    asyncio.get_running_loop().call_later(0.05, gate.set)
    await store.settle(30.0)  # a hang guard: it returns once the debit is handed over
    assert late == [["granted"]]


class HeldReplies:
    """A TCP proxy to Redis that holds the replies back: each ``delay_s`` (0: passes at once),
    and all of them from :meth:`hold` until :meth:`let_go` (so an Admit past a short deadline
    times out by construction, however slow the machine)."""

    def __init__(self, redis_url: str) -> None:
        url = urlsplit(redis_url)
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 6379
        self._db = url.path
        self.delay_s = 0.0
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def hold(self) -> None:
        self._open.clear()

    def let_go(self) -> None:
        self._open.set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}{self._db}"

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        redis_r, redis_w = await asyncio.open_connection(self._host, self._port)
        ups = [
            asyncio.create_task(self._pipe(client_r, redis_w, held=False)),
            asyncio.create_task(self._pipe(redis_r, client_w, held=True)),
        ]
        self._tasks.update(ups)
        await asyncio.wait(ups, return_when=asyncio.FIRST_COMPLETED)
        for task in ups:
            task.cancel()
        client_w.close()
        redis_w.close()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, held: bool) -> None:
        while data := await r.read(65536):
            if held:
                await self._open.wait()
            if held and self.delay_s:
                await asyncio.sleep(self.delay_s)
            w.write(data)
            await w.drain()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def held(
    redis_url: str, redis_namespace: str
) -> AsyncIterator[tuple[HeldReplies, RedisStore]]:
    proxy = HeldReplies(redis_url)
    store = patient_redis_store(await proxy.start(), redis_namespace, cache_max_age_ms=60_000)
    try:
        yield proxy, store
    finally:
        proxy.delay_s = 0.0
        proxy.let_go()
        await store.close()
        await proxy.close()


PATIENT = TEST_POLICY.updated({"admit_timeout_ms": 10_000, "hold_ttl_ms": 600_000})
"""Admits that must BORROW (warming the line) get a deadline no loaded machine misses; a test
shortens it (:func:`_deadline`) only for the Admit that must run past it, its replies held."""


async def _deadline(broker: Broker, admit_timeout_ms: int) -> None:
    await broker.set_policy({"admit_timeout_ms": admit_timeout_ms})
    assert broker.policy.admit_timeout_ms == admit_timeout_ms


async def _in_redis(redis_url: str, namespace: str, count: int) -> None:
    """Wait until ``count`` reservations are in Redis (read past the proxy): the debits sent
    have run, whatever their replies are doing."""
    fresh = patient_redis_store(redis_url, namespace)
    try:

        async def landed() -> list[Any]:
            listed = await fresh.list_reservations(None, 1_700_000_000_000)
            return listed if len(listed) >= count else []

        listed = await eventually(landed, f"{count} reservations in Redis")
    finally:
        await fresh.close()
    assert len(listed) == count


def _debit(node_id: str = "d1") -> DebitRequest:
    return DebitRequest(node_id, Credits(compute_tokens=100, slots=1), "", "", None, 0, None)


async def test_redis_a_cancelled_debit_lands_is_handed_over_and_the_line_stays_in_step(
    held: tuple[HeldReplies, RedisStore], redis_url: str, redis_namespace: str
) -> None:
    proxy, store = held
    broker = await lending_broker(store, TEST_POLICY, slots=2)
    share, now = TEST_POLICY.shares, 1_700_000_000_000
    first = await store.try_debits_settled([_debit()], share, now, 10_000, lambda _: None)
    assert first[0].granted  # warm: the dedicated connection is open
    late: list[Sequence[DebitOutcome]] = []
    proxy.hold()
    waiting = asyncio.create_task(
        store.try_debits_settled([_debit(), _debit()], share, now, 10_000, late.append)
    )
    await _in_redis(redis_url, redis_namespace, 2)  # the debits ran; their replies are held
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert late == []
    proxy.let_go()  # the replies come, are read in the background and handed over
    await eventually(lambda: late, "the late outcomes handed over")
    assert [[o.granted for o in outcomes] for outcomes in late] == [[True, False]]
    granted = late[0][0].reservation
    assert granted is not None
    assert late[0][1].short_credits == ("slots",)  # the second saw the first: one slot left
    held_ids = {r.reservation_id for r in await broker.list_reservations()}
    assert granted.reservation_id in held_ids
    # The same connection answers the next call with ITS replies, not the late ones.
    again = await store.try_debits_settled([_debit("nope")], share, now, 10_000, late.append)
    assert [o.refusal for o in again] == ["unknown_node"]
    after = await store.try_debits_settled([_debit()], share, now, 10_000, late.append)
    assert after[0].short_credits == ("slots",) and len(late) == 1  # both slots are held


async def test_redis_an_admit_past_its_deadline_answers_timeout_and_its_grant_is_released(
    held: tuple[HeldReplies, RedisStore],
) -> None:
    proxy, store = held
    broker = await lending_broker(store, PATIENT)
    ask = AdmissionRequest(uncached_prompt_tokens=100)
    assert (await broker.admit(ask)).decision is Decision.BORROW  # warm
    await _deadline(broker, 100)
    proxy.hold()
    answer = await broker.admit(ask)
    assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.TIMEOUT)
    proxy.let_go()

    async def released() -> bool:  # the debit lands after the answer, then is released
        states = sorted(r.state for r in await broker.list_reservations())
        return states == [ReservationState.HELD, ReservationState.RELEASED]

    await eventually(released, "the late grant released in the background")
    await _deadline(broker, PATIENT.admit_timeout_ms)
    assert (await broker.admit(ask)).decision is Decision.BORROW  # the line is in step


async def test_a_batch_whose_later_round_misses_the_deadline_releases_its_earlier_grants() -> None:
    """Two Admits in one batch race for d1's one slot: round 1 grants one, the other's round 2
    (d2) is stuck past the deadline, so the batch answers NORMAL (TIMEOUT) to both. Round 1's
    grant then reached no caller and was never released: HELD until its hold TTL."""
    from crossflow_ctl.store.memory import MemoryStore

    store = MemoryStore(seed=1)
    # Round 2 never ends, so the batch times out whatever the deadline; 1 s (not 100 ms) lets
    # round 1 land first even on a machine that stalls the test for a while.
    policy = TEST_POLICY.updated({"admit_timeout_ms": 1_000, "hold_ttl_ms": 600_000})
    broker = await lending_broker(store, policy, decode=("d1", "d2"), slots=1)
    rounds = 0
    stuck = asyncio.Event()  # never set
    debits_settled = store.try_debits_settled

    async def second_round_stuck(*args: Any, **kwargs: Any) -> list[DebitOutcome]:
        nonlocal rounds
        rounds += 1
        if rounds == 2:
            await stuck.wait()
        return await debits_settled(*args, **kwargs)

    store.try_debits_settled = second_round_stuck  # type: ignore[method-assign]
    first = AdmissionRequest(uncached_prompt_tokens=100, candidate_node_ids=("d1",))
    second = AdmissionRequest(uncached_prompt_tokens=100, candidate_node_ids=("d1", "d2"))
    answers = await broker.admit_many([first, second])
    assert rounds == 2
    assert [(a.decision, a.reason) for a in answers] == [(Decision.NORMAL, Reason.TIMEOUT)] * 2
    await broker.drain(PATIENCE_S)  # the release runs in the background
    listed = await broker.list_reservations()
    assert [r.state for r in listed] == [ReservationState.RELEASED]


async def test_redis_a_failed_call_hands_the_other_nodes_grants_over(
    held: tuple[HeldReplies, RedisStore], redis_url: str
) -> None:
    """One debit round on two nodes: d2's script fails (its reservations key of the wrong
    type), d1's grants. The round raises StoreUnavailable, and d1's grant, which no caller
    gets, was dropped with it: HELD until its hold TTL. Now it goes to ``late`` (released)."""
    _, store = held
    await lending_broker(store, TEST_POLICY, decode=("d1", "d2"), slots=5)
    raw = Redis.from_url(redis_url)
    try:
        key = store._k.node("d2").reservations
        await raw.delete(key)
        await raw.set(key, "not a hash")
        late: list[Sequence[DebitOutcome]] = []
        share, now = TEST_POLICY.shares, 1_700_000_000_000
        with pytest.raises(StoreUnavailable):
            await store.try_debits_settled(
                [_debit("d1"), _debit("d2")], share, now, 10_000, late.append
            )
        assert [[o.granted for o in outcomes] for outcomes in late] == [[True, False]]
    finally:
        await raw.delete(store._k.node("d2").reservations)
        await raw.aclose()


@pytest.mark.parametrize("path", ["debit line", "debit task"])
async def test_redis_a_late_debit_read_at_shutdown_is_released_before_the_store_closes(
    held: tuple[HeldReplies, RedisStore], redis_url: str, redis_namespace: str, path: str
) -> None:
    """An Admit past its deadline leaves its debit's reply to be read in the background, and the
    broker stops at once. The late read used to end in the store's close, after the broker had
    waited for its orphan releases: the release it started (deleting the request record written
    with the debit, then releasing) was cut off by the close and the grant stayed HELD, its
    record naming it (room lost for nobody until the hold TTL). Now the store settles its late
    reads first, then the broker waits for the releases, then the store closes.

    "debit task": the debit in a task of its own (``Store.try_debits_settled``), the path a
    Redis Cluster client takes (no dedicated line): settle waits for those tasks too."""
    proxy, store = held
    if path == "debit task":
        store._debit_line = None  # what a RedisCluster client gets
    await lending_broker(store, PATIENT)
    # the grace bounds the stop's waits; the test is that it waits, not how fast it is
    settings = BrokerSettings(
        listen="127.0.0.1:0",
        policy=PATIENT,
        stream_grace_s=PATIENCE_S,
        admin_timeout_ms=PATIENT_ADMIN_MS,
    )
    server = BrokerServer(settings, store, ManualClock(1_700_000_000_000))
    await server.start()
    warm = AdmissionRequest(uncached_prompt_tokens=100, request_id="warm")
    assert (await server.broker.admit(warm)).decision is Decision.BORROW  # kept HELD
    await _deadline(server.broker, 100)
    proxy.hold()
    late = AdmissionRequest(uncached_prompt_tokens=100, request_id="late")
    answer = await server.broker.admit(late)
    assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.TIMEOUT)
    proxy.delay_s = 0.4  # every reply from now on held back, the release's too
    proxy.let_go()
    await server.stop()
    fresh = patient_redis_store(redis_url, redis_namespace)  # not through the proxy
    try:
        listed = await fresh.list_reservations(None, 1_700_000_000_000)
        record = await fresh.read_request("admit:late")
    finally:
        await fresh.close()
    states = sorted(r.state for r in listed)
    assert states == [ReservationState.HELD, ReservationState.RELEASED]
    assert record is None  # deleted before the release: a retry decides afresh


async def test_redis_a_batch_decided_at_shutdown_for_callers_gone_is_released(
    held: tuple[HeldReplies, RedisStore], redis_url: str, redis_namespace: str
) -> None:
    """A batch (the group commit's flusher) is mid-round when its callers go away (AdmitStream
    calls cut at the server's grace) and the broker stops. Only the flusher releases what such
    a batch grants, once its round lands; the store's settle does not see it (a live call, not
    a late read). Shutdown used to close the store under it: its grants stayed HELD for nobody.
    Now the broker waits for the batch first (review of 74e85e3)."""
    proxy, store = held
    await lending_broker(store, PATIENT, slots=10)
    settings = BrokerSettings(
        listen="127.0.0.1:0",
        policy=PATIENT,
        stream_grace_s=PATIENCE_S,
        admin_timeout_ms=PATIENT_ADMIN_MS,
    )
    server = BrokerServer(settings, store, ManualClock(1_700_000_000_000))
    await server.start()
    warm = AdmissionRequest(uncached_prompt_tokens=100)
    assert (await server.broker.admit(warm)).decision is Decision.BORROW  # kept HELD
    proxy.hold()
    batch = [AdmissionRequest(uncached_prompt_tokens=100) for _ in range(2)]
    caller = asyncio.ensure_future(server.broker.admit_many(batch))
    await _in_redis(redis_url, redis_namespace, 3)  # the round is written, its replies held
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    proxy.delay_s = 0.4  # every reply from now on held back
    proxy.let_go()
    await server.stop()
    fresh = patient_redis_store(redis_url, redis_namespace)  # not through the proxy
    try:
        listed = await fresh.list_reservations(None, 1_700_000_000_000)
    finally:
        await fresh.close()
    states = sorted(r.state for r in listed)
    assert states.count(ReservationState.HELD) == 1, states  # the warm one only
    assert states.count(ReservationState.RELEASED) == 2, states


async def test_redis_closing_does_not_wait_for_good_on_a_late_read_that_never_ends(
    redis_url: str, redis_namespace: str
) -> None:
    """A client without a socket timeout and a Redis gone silent: the late read of an Admit past
    its deadline would wait for good, holding the debit line, and the store's close with it (a
    broker that never stops). The close stops it after its settle and hands its replies over
    as lost (counted)."""
    proxy = HeldReplies(redis_url)
    client = Redis.from_url(await proxy.start(), socket_timeout=None)  # none (default: 5 s)
    store = patient_redis_store(client, redis_namespace, cache_max_age_ms=60_000)
    reader = InMemoryMetricReader()
    metrics = BrokerMetrics(MeterProvider(metric_readers=[reader]))
    try:
        broker = await lending_broker(store, PATIENT, metrics=metrics)
        ask = AdmissionRequest(uncached_prompt_tokens=100)
        assert (await broker.admit(ask)).decision is Decision.BORROW  # warm
        await _deadline(broker, 100)
        proxy.hold()  # silent
        answer = await broker.admit(ask)
        assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.TIMEOUT)
        async with asyncio.timeout(30):  # a hang guard, not a latency assertion
            await store.close()
        assert _lost_debits(reader) == 1
    finally:
        proxy.let_go()
        await proxy.close()
        await client.aclose()


def _lost_debits(reader: InMemoryMetricReader, name: str = "lost_debit_replies") -> float:
    data = reader.get_metrics_data()
    total = 0.0
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == f"crossflow_broker_{name}":
                    assert isinstance(metric.data, Sum)
                    total += sum(point.value for point in metric.data.data_points)
    return total


async def test_redis_a_late_debit_whose_reply_is_lost_is_counted(
    held: tuple[HeldReplies, RedisStore], redis_url: str, redis_namespace: str
) -> None:
    """An Admit past its deadline leaves its debit's reply to be read in the background, and the
    connection breaks before it comes: whether the debit was granted is unknown (it was: HELD
    until its hold TTL, room lost for nobody). That was only logged; now it is counted, so an
    operator can alert on it."""
    proxy, store = held
    reader = InMemoryMetricReader()
    metrics = BrokerMetrics(MeterProvider(metric_readers=[reader]))
    broker = await lending_broker(store, PATIENT, metrics=metrics)
    ask = AdmissionRequest(uncached_prompt_tokens=100)
    assert (await broker.admit(ask)).decision is Decision.BORROW  # warm
    await _deadline(broker, 100)
    proxy.hold()
    answer = await broker.admit(ask)
    assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.TIMEOUT)
    assert _lost_debits(reader) == 0
    await proxy.close()  # the connection breaks while the late reply is held back
    await eventually(lambda: _lost_debits(reader), "the lost reply counted")
    assert _lost_debits(reader) == 1
    assert _lost_debits(reader, "store_errors") == 1  # the debit call failed, late
    fresh = patient_redis_store(redis_url, redis_namespace)  # not through the proxy
    try:
        listed = await fresh.list_reservations(None, 1_700_000_000_000)
    finally:
        await fresh.close()
    assert [r.state for r in listed] == [ReservationState.HELD] * 2  # the lost one too
