"""DESIGN.md §5.3, no over-commit, as a property over SEVERAL broker processes on one Redis.

Three ``crossflow-broker serve`` processes share one Redis namespace (on one Redis, and on a
real 3-master Redis Cluster). For each generated scenario,
decode agents stream to different replicas and keep replacing their leases (random credits and
borrowed-prefill rates) while hundreds of concurrent Admits race over all replicas (half unary,
half on AdmitStreams, whose debits go to Redis in batches). Afterwards, reading the store:
ordering each node's reservations by grant sequence (the order the atomic check-and-debit ran
in), every grant plus all grants before it fits in the policy's shares (each credit its own) x
the lease it was granted against, credit by credit, the compute debits counted in that lease's
unit (their node time at its rate, :mod:`crossflow_ctl.domain.safety`). Reservations never
expire or get released here, so every earlier grant was still open.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.client import AdminClient, AdmissionClient, AdmissionStream
from crossflow_ctl.domain.admission import Decision
from crossflow_ctl.domain.models import ComputeTime, Credits
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.safety import over_committed
from tests.broker.agents import FakeAgent
from tests.conftest import delete_cluster_namespace

REPLICAS = 3
POLICY = PolicySettings(borrow_share=0.75, borrow_kv_share=0.9)
SHARES = POLICY.shares
"""Each credit at its own share (the brokers' policy): kv and kv_transfer at 0.9, the rest 0.75."""

pytestmark = pytest.mark.slow


class Replicas:
    def __init__(self) -> None:
        self.addrs: list[str] = []
        self.procs: list[asyncio.subprocess.Process] = []
        self.admissions = 0
        self.borrowed = 0
        self.lease_updates = 0
        self.examples = itertools.count()


@pytest.fixture(params=["redis", "redis-cluster"])
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[Replicas]:
    """Three broker processes on one Redis, or on a real 3-master Redis Cluster."""
    on_cluster = request.param == "redis-cluster"
    if on_cluster:
        redis_url = request.getfixturevalue("redis_cluster_url")
        redis_namespace = f"cft-{uuid.uuid4().hex[:12]}"
    else:
        redis_url = request.getfixturevalue("redis_url")
        redis_namespace = request.getfixturevalue("redis_namespace")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "CROSSFLOW_POLICY__BORROW_SHARE": str(POLICY.borrow_share),
        "CROSSFLOW_POLICY__BORROW_KV_SHARE": str(POLICY.borrow_kv_share),
        "CROSSFLOW_POLICY__HOLD_TTL_MS": "60000",
        "CROSSFLOW_POLICY__COMMIT_TTL_MS": "60000",
        "CROSSFLOW_POLICY__MAX_LEASE_TTL_MS": "60000",
        "CROSSFLOW_POLICY__ADMIT_TIMEOUT_MS": "5000",
        "CROSSFLOW_LOG_LEVEL": "warning",
    }
    r = Replicas()
    cmd = [
        sys.executable,
        "-m",
        "crossflow_ctl.broker",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--redis-url",
        redis_url,
        "--redis-namespace",
        redis_namespace,
        *(["--redis-cluster"] if on_cluster else []),
    ]
    try:
        for _ in range(REPLICAS):
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, stdout=asyncio.subprocess.PIPE
            )
            r.procs.append(proc)
        for proc in r.procs:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
            assert line.startswith("listening on "), line
            r.addrs.append(line.split()[-1])
        prefill = FakeAgent(r.addrs[0], "prefill-0", role=common_pb2.NODE_ROLE_PREFILL)
        await prefill.connect()
        try:
            await prefill.send_pool_load(ttl_ms=60_000)
            await prefill.sync()
            yield r
        finally:
            await prefill.close()
        # The race must be real: some admissions won room and some found it taken.
        assert 0 < r.borrowed < r.admissions, (r.borrowed, r.admissions)
        print(
            f"\n§5.3 on {request.param}: {r.admissions} concurrent admissions over {REPLICAS} "
            "broker processes, "
            f"{r.borrowed} borrowed, {r.lease_updates} racing lease updates"
        )
    finally:
        for proc in r.procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in r.procs:
            try:
                await asyncio.wait_for(proc.wait(), timeout=15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if on_cluster:
            delete_cluster_namespace(redis_url, redis_namespace)


credits_st = st.builds(
    Credits,
    compute_tokens=st.integers(2_000, 30_000),
    kv_tokens=st.integers(5_000, 80_000),
    kv_transfer_bytes=st.integers(10**7, 10**9),
    output_tokens=st.integers(500, 8_000),
    slots=st.integers(1, 16),
)
rate_st = st.sampled_from([5_000.0, 10_000.0, 20_000.0, 40_000.0, 2329.3333333333335, 1e5 / 3])
"""Borrowed-prefill rates: the compute credit's unit changes lease by lease (and two no double
holds exactly, whose products with node time round)."""
request_st = st.tuples(
    st.integers(1, 1_500), st.integers(0, 1_000), st.integers(0, 300), st.booleans()
)


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    leases=st.lists(
        st.lists(st.tuples(credits_st, rate_st), min_size=2, max_size=6), min_size=2, max_size=3
    ),
    requests=st.lists(request_st, min_size=100, max_size=160),
)
async def test_open_debits_never_exceed_the_lease(
    replicas: Replicas, leases: list[list[tuple[Credits, float]]], requests: list[Any]
) -> None:
    example = next(replicas.examples)
    nodes = [f"e{example}-d{i}" for i in range(len(leases))]
    agents = [FakeAgent(replicas.addrs[i % REPLICAS], n) for i, n in enumerate(nodes)]
    granted_against: dict[tuple[str, int], tuple[Credits, float]] = {}

    async def send(agent: FakeAgent, credits: Credits, rate: float) -> None:
        ack = await agent.send_lease(
            credits=credits.model_dump(), borrowed_prefill_rate_tps=rate, last_notice_seq=0
        )
        assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
        granted_against[(agent.node_id, agent.version)] = (credits, rate)

    for agent, seq in zip(agents, leases, strict=True):
        await agent.connect()
        await send(agent, *seq[0])
    clients = [AdmissionClient(a, timeout_s=30) for a in replicas.addrs]
    streams = [AdmissionStream(a, timeout_s=30) for a in replicas.addrs]  # batched debits race too

    async def update_leases(agent: FakeAgent, seq: list[tuple[Credits, float]]) -> None:
        for credits, rate in seq[1:]:
            await asyncio.sleep(0.002)
            await send(agent, credits, rate)
            replicas.lease_updates += 1

    async def admit(i: int, req: Any) -> Any:
        uncached, cached, output, remote = req
        client = streams[i % REPLICAS] if i % 2 else clients[i % REPLICAS]
        return await client.admit(
            request_id=f"e{example}-{i}",
            uncached_prompt_tokens=uncached,
            cached_prefix_tokens=cached,
            cached_prefix_node_id=None if remote else nodes[i % len(nodes)],
            expected_output_tokens=output,
            candidate_node_ids=nodes,
        )

    try:
        results = await asyncio.gather(
            *(admit(i, r) for i, r in enumerate(requests)),
            *(update_leases(a, s) for a, s in zip(agents, leases, strict=True)),
        )
    finally:
        await asyncio.gather(
            *(a.close() for a in agents),
            *(c.close() for c in clients),
            *(s.close() for s in streams),
        )
    answers = results[: len(requests)]
    replicas.admissions += len(answers)
    borrowed = {a.reservation_id for a in answers if a.decision is Decision.BORROW}
    replicas.borrowed += len(borrowed)

    async with AdminClient(replicas.addrs[-1]) as admin:
        for node in nodes:
            reservations = sorted(await admin.list_reservations(node), key=lambda r: r.grant_seq)
            open_debits, time = Credits(), ComputeTime()
            for r in reservations:
                lease, rate = granted_against[(node, r.lease_version)]
                open_debits = open_debits.plus(r.debit)
                time = time.plus(r.compute_time)
                over = over_committed(lease, open_debits, SHARES, rate, time)
                assert not over, (node, r.reservation_id, over, open_debits, time, lease, rate)
            borrowed -= {r.reservation_id for r in reservations}
    assert not borrowed, f"BORROW answers without a stored reservation: {borrowed}"
