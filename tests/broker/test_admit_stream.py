"""AdmitStream over loopback gRPC, on both stores: decisions matched by the client's ids, one
error per bad item with the stream kept up, fail closed per request, batched debits (one Redis
round trip per batch), no over-commit, and late grants handed back."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc, common_pb2, lease_pb2
from crossflow_ctl.broker import admit_stream
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdminClient, AdmissionStream
from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import ReservationState
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from crossflow_ctl.wire.convert_admission import admission_to_proto, admit_request_from_proto
from tests.broker.conftest import TEST_POLICY, lending_broker, target
from tests.broker.test_fail_closed import _broker_on, _closed_port
from tests.conftest import eventually, patient_redis_store
from tests.store.test_redis_round_trips import CountingConnection

# Decisions here must not hinge on a loaded test machine answering within the default 50 ms.
PATIENT = TEST_POLICY.model_copy(update={"admit_timeout_ms": 10_000})


async def _ready(cluster: Any, agents: Any, slots: int) -> Any:
    server = await cluster.start(policy=PATIENT)
    decode = await agents(server, "d1")
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    ack = await decode.send_lease(credits={"slots": slots})
    assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
    return server


async def test_concurrent_admits_share_the_stream_and_never_over_commit(cluster, agents) -> None:
    server = await _ready(cluster, agents, slots=5)
    async with (
        AdmissionStream(target(server), timeout_s=5) as stream,
        AdminClient(target(server)) as admin,
    ):
        answers = await asyncio.gather(
            *(stream.admit(uncached_prompt_tokens=500, request_id=f"r{i}") for i in range(12))
        )
        borrowed = [a for a in answers if a.decision is Decision.BORROW]
        assert len(borrowed) == 5  # the lease's slots, whatever the batching
        assert {a.reason for a in answers if a.decision is Decision.NORMAL} == {Reason.NO_ROOM}
        assert len({a.reservation_id for a in borrowed}) == 5
        assert all(a.plan is None for a in answers)  # no explanation on streamed decisions
        held = await admin.list_reservations()
        assert sorted(r.reservation_id for r in held) == sorted(a.reservation_id for a in borrowed)


async def test_decisions_come_back_to_their_own_requests(cluster, agents) -> None:
    server = await _ready(cluster, agents, slots=5)
    async with AdmissionStream(target(server), timeout_s=5) as stream:
        sizes = [100 + 37 * i for i in range(40)]
        answers = await asyncio.gather(
            *(stream.admit(uncached_prompt_tokens=n, dry_run=True) for n in sizes)
        )
    for size, answer in zip(sizes, answers, strict=True):
        assert answer.reason is Reason.DRY_RUN  # dry runs keep their explanation
        assert answer.plan is not None and answer.plan.nodes[0].debit.compute_tokens == size


async def test_a_bad_item_gets_its_own_error_and_the_stream_stays_up(cluster, agents) -> None:
    server = await _ready(cluster, agents, slots=5)
    good = admission_pb2.AdmitRequest(uncached_prompt_tokens=500)
    bad = admission_pb2.AdmitRequest(uncached_prompt_tokens=-5)
    async with grpc.aio.insecure_channel(target(server)) as channel:
        call = admission_pb2_grpc.AdmissionServiceStub(channel).AdmitStream()
        await call.write(
            admission_pb2.AdmitStreamRequest(
                items=[
                    admission_pb2.AdmitStreamItem(id=7, request=good),
                    admission_pb2.AdmitStreamItem(id=8, request=bad),
                    admission_pb2.AdmitStreamItem(id=9, request=good),
                ]
            )
        )
        results: dict[int, Any] = {}
        while len(results) < 3:
            for r in (await call.read()).results:
                results[r.id] = r
        assert results[8].WhichOneof("result") == "error"
        assert results[8].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert results[8].error.message.startswith("uncached_prompt_tokens: ")
        for i in (7, 9):
            assert results[i].decision.decision == admission_pb2.DECISION_BORROW
        await call.write(
            admission_pb2.AdmitStreamRequest(items=[admission_pb2.AdmitStreamItem(id=10)])
        )
        (after,) = (await call.read()).results
        assert after.id == 10 and after.WhichOneof("result") == "decision"
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    # The client raises the broker's refusal for that request only.
    async with AdmissionStream(target(server), timeout_s=5) as stream:
        forged = AdmissionRequest.model_construct(
            **{**AdmissionRequest(uncached_prompt_tokens=1).model_dump(), "pool": "no such!"}
        )
        with pytest.raises(InvalidArgument) as err:
            await stream.admit(forged)
        assert err.value.field == "pool"
        granted = await stream.admit(uncached_prompt_tokens=500)
        # a stream answer has no explanation, but says what the grant took from its node
        assert granted.decision is Decision.BORROW and granted.plan is None
        assert granted.debit is not None and granted.debit.slots == 1
        assert granted.debit.kv_tokens >= 500 and granted.debit.compute_tokens > 0


async def test_stream_fails_closed_per_request(blackhole: int) -> None:
    # A broker whose store is down answers NORMAL on the stream, never an error.
    server = await _broker_on(f"redis://127.0.0.1:{_closed_port()}/0")
    try:
        async with AdmissionStream(target(server), timeout_s=5) as stream:
            answers = await asyncio.gather(
                *(stream.admit(uncached_prompt_tokens=1_000) for _ in range(3))
            )
        assert {(a.decision, a.reason) for a in answers} == {
            (Decision.NORMAL, Reason.STORE_UNAVAILABLE)
        }
    finally:
        await server.stop(grace_s=0.5)
    # No broker at all, or one that never answers: NORMAL on the client's side.
    async with AdmissionStream(f"127.0.0.1:{_closed_port()}", timeout_s=2) as stream:
        dead = await stream.admit(uncached_prompt_tokens=10)
        assert dead.decision is Decision.NORMAL
        assert dead.reason in (Reason.BROKER_UNAVAILABLE, Reason.TIMEOUT)
        again = await stream.admit(uncached_prompt_tokens=10)  # reopened, fails closed again
        assert again.decision is Decision.NORMAL
    async with AdmissionStream(f"127.0.0.1:{blackhole}", timeout_s=0.3) as stream:
        hung = await stream.admit(uncached_prompt_tokens=10)
        assert (hung.decision, hung.reason) == (Decision.NORMAL, Reason.TIMEOUT)


async def test_a_grant_that_arrives_after_its_request_gave_up_is_released(cluster, agents) -> None:
    server = await _ready(cluster, agents, slots=5)
    async with (
        AdmissionStream(target(server), timeout_s=1e-6) as stream,
        AdminClient(target(server)) as admin,
    ):
        late = await stream.admit(uncached_prompt_tokens=500)
        assert (late.decision, late.reason) == (Decision.NORMAL, Reason.TIMEOUT)

        async def released() -> bool:
            return [r.state for r in await admin.list_reservations()] == [ReservationState.RELEASED]

        await eventually(released, "the grant released in the background")


async def test_a_batch_is_decided_with_one_redis_round_trip(
    redis_url: str, redis_namespace: str
) -> None:
    client: Redis = Redis.from_url(redis_url, connection_class=CountingConnection)
    store = patient_redis_store(client, redis_namespace, cache_max_age_ms=60_000)
    broker = await lending_broker(store, PATIENT, ("d1", "d2"), slots=3)
    try:
        requests = [AdmissionRequest(uncached_prompt_tokens=100) for _ in range(5)]
        await broker.admit_many(requests[:1])  # warm: caches filled, script loaded
        before = CountingConnection.sent
        answers = await broker.admit_many(requests)
        trips = CountingConnection.sent - before
    finally:
        await store.close()
        await client.aclose()
    # Six slots in all (three per node), one taken while warming: five grants.
    assert [a.decision for a in answers] == [Decision.BORROW] * 5
    # Both nodes rank alike, so every plan tries the same node first: its room runs out within
    # the batch and the refused ones go to the next ranked node in a second round.
    assert trips == 2
    assert [a.node_id for a in answers].count("d1") == 2


async def test_a_bug_behind_the_stream_ends_it_internal_not_unknown() -> None:
    """The streaming handlers map errors as the unary ones do (servicers.maps_stream_errors)."""
    server = BrokerServer(BrokerSettings(listen="127.0.0.1:0", policy=PATIENT), MemoryStore())
    await server.start()

    async def broken(*_: object, **__: object) -> list[Any]:
        raise RuntimeError("a bug")

    server.broker.admit_many = broken  # type: ignore[method-assign]
    try:
        async with grpc.aio.insecure_channel(target(server)) as channel:
            call = admission_pb2_grpc.AdmissionServiceStub(channel).AdmitStream()
            item = admission_pb2.AdmitStreamItem(
                id=1, request=admission_pb2.AdmitRequest(uncached_prompt_tokens=100)
            )
            await call.write(admission_pb2.AdmitStreamRequest(items=[item]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
    finally:
        await server.stop()
    assert err.value.code() == grpc.StatusCode.INTERNAL


# -- decoding and encoding (broker.admit_stream.decide) ----------------------------------------
class _FixedBroker:
    """admit_many's answers, one per request in order, recording what it was asked."""

    def __init__(self) -> None:
        self.asked: list[list[AdmissionRequest]] = []

    async def admit_many(self, requests: Any, owner: str = "") -> list[Any]:
        self.asked.append(list(requests))
        return [
            Admission.normal(Reason.NO_ROOM, f"#{i}")
            if r.dry_run
            else Admission(
                decision=Decision.BORROW,
                reason=Reason.BORROWED,
                message=f"#{i}",
                node_id="d1",
                reservation_id=f"r{i}@d1",
                lease_epoch=1,
                lease_version=2,
                expires_at_ms=3,
                predicted_ttft_ms=math.inf,
                normal_ttft_ms=9.0,
            )
            for i, r in enumerate(requests)
        ]


async def test_decide_answers_as_one_message_built_item_by_item_would() -> None:
    """The response decide writes in place is the one built from admission_to_proto per item:
    errors first, then the decisions in item order (a dry run's with its explanation)."""
    good = admission_pb2.AdmitRequest(uncached_prompt_tokens=500, expected_output_tokens=9)
    named = admission_pb2.AdmitRequest(request_id="q1", uncached_prompt_tokens=7)
    dry = admission_pb2.AdmitRequest(uncached_prompt_tokens=5, dry_run=True)
    bad = admission_pb2.AdmitRequest(uncached_prompt_tokens=5, attempt=5_000)
    items = [
        admission_pb2.AdmitStreamItem(id=i, request=r)
        for i, r in enumerate([good, bad, named, good, dry, bad])
    ]
    broker = _FixedBroker()
    got = await admit_stream.decide(broker, items)  # type: ignore[arg-type]
    (asked,) = broker.asked
    assert [r.request_id for r in asked] == ["", "q1", "", ""]
    answers = await _FixedBroker().admit_many(asked)
    errors = []
    for i in (1, 5):
        with pytest.raises(InvalidArgument) as err:
            admit_request_from_proto(items[i].request)
        error = admission_pb2.AdmitStreamError(code=3, message=str(err.value))
        errors.append(admission_pb2.AdmitStreamResult(id=i, error=error))
    decisions = [
        admission_pb2.AdmitStreamResult(id=i, decision=admission_to_proto(a, explain=r.dry_run))
        for i, r, a in zip((0, 2, 3, 4), asked, answers, strict=True)
    ]
    expected = admission_pb2.AdmitStreamResponse(results=[*errors, *decisions])
    assert got == expected
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(
        deterministic=True
    )
