"""Issue 12: random and malformed requests to every RPC over real gRPC (tests/fuzzing.py).

Asserts that no call answers UNKNOWN or INTERNAL (no exception escapes a servicer) and that a
refusal changes nothing in the store (a snapshot of every key before and after). Kept to a few
hundred cases so CI stays fast; ``python benchmarks/fuzz.py`` runs 10,000 and more.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from tests.broker.conftest import TEST_POLICY, target
from tests.fuzzing import HISTOGRAM, Case, Snapshot, cases, run_case

FUZZ_POLICY = TEST_POLICY.updated({"hold_ttl_ms": 600_000, "commit_ttl_ms": 600_000})
"""Nothing expires during the run, so only the fuzzed calls change the store."""


async def _fuzz_target(cluster, agents, redis_url, redis_namespace):
    server = await cluster.start(policy=FUZZ_POLICY)
    decode = await agents(server, "d1")
    assert (await decode.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    return server


@settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=cases())
async def test_every_rpc_refuses_cleanly(fuzz_server, fuzz_io, case: Case) -> None:
    channel, snapshot = fuzz_io
    problems = await run_case(channel, case, snapshot)
    assert not problems, problems


@pytest.fixture(params=["redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """The snapshot reads Redis keys: fuzz the Redis store."""
    return str(request.param)


@pytest.fixture
async def fuzz_server(cluster, agents, redis_url, redis_namespace):
    return await _fuzz_target(cluster, agents, redis_url, redis_namespace)


@pytest.fixture
async def fuzz_io(fuzz_server, redis_url, redis_namespace):
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    async with grpc.aio.insecure_channel(target(fuzz_server)) as channel:
        yield channel, Snapshot(client, redis_namespace)
    await client.aclose()
    print("fuzz outcomes:", dict(sorted(HISTOGRAM.items())))
