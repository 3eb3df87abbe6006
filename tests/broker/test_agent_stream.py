"""One agent stream carries pipelined leases, heartbeats and notices at once.

Leases are acked in the order sent and heartbeats echoed while the relay sends notices down the
same stream; none is lost and the stream stays up.
"""

from __future__ import annotations

import asyncio

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.admission import Decision
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
