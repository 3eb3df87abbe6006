"""One agent stream carries pipelined leases, heartbeats and notices at once.

Leases are acked in the order sent and heartbeats echoed while the relay sends notices down the
same stream; none is lost and the stream stays up. Both write straight to the call, one write
at a time.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.broker.streams import _batch_response, _End, _Out
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.admission import Decision
from tests.broker.agents import FakeAgent
from tests.broker.conftest import target

LEASES = 30
ADMITS = 20


async def test_pipelined_leases_and_heartbeats_answer_in_order_beside_notices(
    cluster, agents
) -> None:
    server = await cluster.start()
    decode = await agents(server, "d1")
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    roomy = {"slots": 100, "compute_tokens": 100_000, "output_tokens": 100_000}
    assert (await decode.send_lease(credits=roomy)).result == lease_pb2.LEASE_RESULT_ACCEPTED
    async with AdmissionClient(target(server), timeout_s=5) as client:
        admits = asyncio.gather(
            *(
                client.admit(uncached_prompt_tokens=100, expected_output_tokens=10)
                for _ in range(ADMITS)
            )
        )
        for n in range(LEASES):
            await decode.write_lease(credits=roomy)
            if n % 5 == 0:
                await decode.write_heartbeat()
        answers = await admits
    async with asyncio.timeout(5):
        acks = [await decode.acks.get() for _ in range(LEASES)]
        beats = [await decode.heartbeats.get() for _ in range(LEASES // 5)]
    assert [a.version for a in acks] == list(range(2, LEASES + 2))
    assert {a.result for a in acks} == {lease_pb2.LEASE_RESULT_ACCEPTED}
    assert all(b.sent_unix_ms > 0 for b in beats)
    borrowed = [a for a in answers if a.decision is Decision.BORROW]
    assert borrowed, [a.message for a in answers]
    for adm in borrowed:
        await decode.wait_notice(
            lambda n, rid=adm.reservation_id: (
                n.kind == lease_pb2.NOTICE_KIND_GRANT and n.reservation_id == rid
            )
        )
    seqs = [n.seq for n in decode.notices]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert decode.ended is None, "the stream stays up"


class _SlowCall:
    """A call whose writes take a few loop turns, recording overlaps (gRPC takes one at a
    time: a second write while one is in flight fails the stream)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most_in_flight = 0
        self.written: list[int] = []

    async def write(self, message: lease_pb2.ConnectResponse) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        for _ in range(3):
            await asyncio.sleep(0)
        self.written.append(message.lease_ack.version)
        self.in_flight -= 1


async def test_acks_and_notices_share_the_call_one_write_at_a_time() -> None:
    """The reader's acks and the relay's notices write straight to the call: never two at
    once, each writer's messages in its order; the first end of the stream wins."""
    call = _SlowCall()
    out = _Out(call)  # type: ignore[arg-type]

    async def writer(first: int) -> None:
        for v in range(first, first + 5):
            ack = lease_pb2.ConnectResponse()
            ack.lease_ack.version = v
            await out.send(ack)

    await asyncio.gather(writer(100), writer(200))
    assert call.most_in_flight == 1
    assert [v for v in call.written if v < 200] == list(range(100, 105))
    assert [v for v in call.written if v >= 200] == list(range(200, 205))
    out.end(_End(grpc.StatusCode.UNAVAILABLE, "store down"))
    out.end(_End())
    assert (await out.ended).code is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("count", [0, 1, 5])
def test_a_batch_response_is_the_batch_in_a_connect_response(count: int) -> None:
    """The relay's message for a batch is ``ConnectResponse(notices=batch)``, a copy: the same
    bytes, the same oneof, and what the batch becomes later is not what was sent."""
    batch = lease_pb2.NoticeBatch()
    for seq in range(count):
        notice = batch.notices.add(seq=seq + 1, kind=lease_pb2.NOTICE_KIND_GRANT)
        notice.reservation_id, notice.at_unix_ms = f"r{seq}@d1", 1_000 + seq
        notice.debit.compute_tokens = 10 * seq
    response = _batch_response(batch)
    expected = lease_pb2.ConnectResponse(notices=batch)
    assert response == expected and response.WhichOneof("body") == "notices"
    assert response.SerializeToString() == expected.SerializeToString()
    batch.notices.add(seq=99)
    assert len(response.notices.notices) == count


async def test_refusal_acks_ack_refused_leases_only_and_heartbeats_ack_the_rest(
    cluster, agents
) -> None:
    """An agent that says Hello.refusal_acks hears of refused leases only; each heartbeat's
    answer names the newest lease accepted before it (a cumulative ack)."""
    server = await cluster.start()
    decode = await agents(server, "d1", refusal_acks=True)
    before = await _beat(decode)
    assert (before.acked_epoch, before.acked_version) == (0, 0)
    for _ in range(5):
        await decode.write_lease(credits={"slots": 1})
    beat = await _beat(decode)
    assert (beat.acked_epoch, beat.acked_version) == (1, 5)
    assert decode.acks.empty(), "accepted leases are not acked one by one"
    decode.version = 2  # a stale one: refused, acked with the stored version
    await decode.write_lease(credits={"slots": 1})
    async with asyncio.timeout(5):
        refused = await decode.acks.get()
    assert refused.result == lease_pb2.LEASE_RESULT_STALE
    assert (refused.version, refused.stored_version) == (3, 5)
    beat = await _beat(decode)
    assert beat.acked_version == 5, "the refused lease is not acked as accepted"
    decode.version = 9
    await decode.write_lease(credits={"slots": 2})
    assert (await _beat(decode)).acked_version == 10
    assert decode.acks.empty()
    assert decode.ended is None


async def test_without_refusal_acks_every_lease_is_acked_as_before(cluster, agents) -> None:
    """An agent that predates refusal acks still gets an ack per lease."""
    server = await cluster.start()
    decode = await agents(server, "d1")
    ack = await decode.send_lease(credits={"slots": 1})
    assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
    assert (await _beat(decode)).acked_version == 1


async def _beat(agent: FakeAgent) -> lease_pb2.Heartbeat:
    await agent.write_heartbeat()
    async with asyncio.timeout(5):
        return await agent.heartbeats.get()
