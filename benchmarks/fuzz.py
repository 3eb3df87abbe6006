"""Fuzz every broker RPC with >= 10,000 random and malformed requests over real gRPC (issue 12).

    python benchmarks/fuzz.py [--redis-url redis://127.0.0.1:6379/0] [--cases 10000] [--seed 12]

Starts a broker in this process on a loopback port over Redis (its own key namespace, deleted
afterwards), with one decode node leasing and one prefill node reporting load, then sends the
cases of tests/fuzzing.py one after the other: every RPC of every crossflow.v1 service, requests
built field by field from the descriptors (extreme numbers, NaN, unknown enums, odd and huge
strings, nested JSON in policy values), a share of corrupt or random bytes, and agent streams
(Hello, then leases and pool loads). Before and after each call it DUMPs every key of the
namespace. Prints the status-code histogram per RPC, the count of UNKNOWN/INTERNAL answers and of
refusals that changed the store (both must be 0: exit status 1 otherwise), and the case rate
next to its floor in the same run (a bare Health/Check plus the two snapshots each case takes).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.observability.logs import setup_logging
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.redis_store import RedisStore
from tests.broker.agents import FakeAgent
from tests.fuzzing import FORBIDDEN, HISTOGRAM, Case, Snapshot, cases, run_case

POLICY = PolicySettings(borrow_share=1.0, hold_ttl_ms=600_000, commit_ttl_ms=600_000)
"""Nothing expires during the run, so only the fuzzed calls change the store."""


def draw_cases(n: int, at_seed: int) -> list[Case]:
    """``n`` cases from the hypothesis strategy, generation only (no shrinking), reproducible."""
    drawn: list[Case] = []

    @seed(at_seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases())
    def collect(case: Case) -> None:
        drawn.append(case)

    while len(drawn) < n:
        before = len(drawn)
        collect()
        if len(drawn) == before:
            break
        at_seed += 1
        collect = seed(at_seed)(collect)
    return drawn[:n]


async def floor_rate(channel: grpc.aio.Channel, snapshot: Snapshot, n: int = 300) -> float:
    stub = health_pb2_grpc.HealthStub(channel)
    started = time.perf_counter()
    for _ in range(n):
        await snapshot.take()
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        await snapshot.take()
    return n / (time.perf_counter() - started)


async def main(args: argparse.Namespace) -> int:
    setup_logging(json=False, level="critical")
    t0 = time.perf_counter()
    drawn = draw_cases(args.cases, args.seed)
    draw_s = time.perf_counter() - t0
    namespace = f"cffuzz-{uuid.uuid4().hex[:8]}"
    redis = Redis.from_url(args.redis_url)
    settings = BrokerSettings(listen="127.0.0.1:0", policy=POLICY, stream_grace_s=0.5)
    server = BrokerServer(settings, RedisStore(args.redis_url, namespace=namespace), SystemClock())
    await server.start()
    target = f"127.0.0.1:{server.port}"
    decode = FakeAgent(target, "d1")
    prefill = FakeAgent(target, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    problems: list[str] = []
    try:
        await decode.connect()
        assert (await decode.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
        await prefill.connect()
        await prefill.send_pool_load()
        await prefill.sync()
        snapshot = Snapshot(redis, namespace)
        async with grpc.aio.insecure_channel(target) as channel:
            floor = await floor_rate(channel, snapshot)
            started = time.perf_counter()
            for case in drawn:
                problems += await run_case(channel, case, snapshot)
            elapsed = time.perf_counter() - started
    finally:
        await decode.close()
        await prefill.close()
        await server.stop(grace_s=0.5)
        keys = [k async for k in redis.scan_iter(match=f"{namespace}*", count=1000)]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
    report(drawn, problems, elapsed, floor, draw_s)
    return 1 if problems else 0


def report(
    drawn: list[Case], problems: list[str], elapsed: float, floor: float, draw_s: float
) -> None:
    total = sum(HISTOGRAM.values())
    by_code: Counter[str] = Counter()
    print(
        f"fuzz: {len(drawn)} cases ({total} judged calls) in {elapsed:.1f} s "
        f"(drawn in {draw_s:.1f} s)"
    )
    print(f"{'rpc':<18} {'status':<34} {'count':>7}")
    for key, count in sorted(HISTOGRAM.items()):
        rpc, code = key.split(" ", 1)
        by_code[code.split("/")[0]] += count
        print(f"{rpc:<18} {code:<34} {count:>7}")
    print("by status: " + ", ".join(f"{c} {n}" for c, n in sorted(by_code.items())))
    forbidden = sum(n for k, n in HISTOGRAM.items() if k.split(" ", 1)[1] in FORBIDDEN)
    changed = sum("yet the store changed" in p for p in problems)
    print(
        f"UNKNOWN/INTERNAL answers: {forbidden}   refusals that changed the store: {changed}   "
        f"other problems: {len(problems) - changed - forbidden}"
    )
    print(
        f"rate: {len(drawn) / elapsed:.0f} cases/s   floor (Health/Check + 2 snapshots): "
        f"{floor:.0f} calls/s"
    )
    for line in problems[:20]:
        print("PROBLEM", line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=12)
    sys.exit(asyncio.run(main(parser.parse_args())))
