"""Store latency and throughput, next to a floor measured in the same run.

    python benchmarks/bench_store.py [--redis-url redis://127.0.0.1:6379/0] [--n 2000]

Prints, for the MemoryStore, debit->commit->release cycles per second (what the simulator
pays), and for the RedisStore the per-call latency of try_debit, commit, release, upsert_lease
and admission_view (8 named candidates, and 8 sampled from 1,000 lenders), beside the floor:
a raw EVALSHA of ``return 1`` on the same connection. Keys live under a random namespace and
are deleted afterwards. Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from crossflow_ctl.domain.models import Credits, Lease, NodeRole
from crossflow_ctl.store.base import Store
from crossflow_ctl.store.memory import MemoryStore
from crossflow_ctl.store.redis_store import RedisStore

NOW = 1_700_000_000_000
BIG = Credits(
    compute_tokens=10**8,
    kv_tokens=10**8,
    kv_transfer_bytes=10**12,
    output_tokens=10**8,
    slots=10**5,
)
ONE = Credits(compute_tokens=100, kv_tokens=200, kv_transfer_bytes=1_000, output_tokens=50, slots=1)


async def timed(n: int, fn: Callable[[int], Awaitable[object]]) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        await fn(i)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def show(name: str, us: list[float]) -> None:
    us = sorted(us)
    p99 = us[min(len(us) - 1, int(len(us) * 0.99))]
    print(f"  {name:<34} p50 {statistics.median(us):8.1f} us   p99 {p99:8.1f} us   n={len(us)}")


async def setup(store: Store, nodes: int) -> None:
    for i in range(nodes):
        node = f"d{i}"
        await store.register_node(node, NodeRole.DECODE, "default", {}, NOW)
        lease = Lease(node_id=node, epoch=1, version=1, ttl_ms=3_600_000, credits=BIG)
        await store.upsert_lease(lease, NOW, 3_600_000)


async def memory(n: int) -> None:
    store = MemoryStore(seed=1)
    await setup(store, 8)
    t0 = time.perf_counter()
    for i in range(n):
        out = await store.try_debit(f"d{i % 8}", ONE, 0.5, NOW + i, 60_000)
        assert out.reservation is not None
        await store.commit(out.reservation.reservation_id, NOW + i, 60_000)
        await store.release(out.reservation.reservation_id, NOW + i)
    elapsed = time.perf_counter() - t0
    print(f"MemoryStore: {n / elapsed:,.0f} debit+commit+release cycles/s ({n} cycles)")
    version = 2

    async def upsert(i: int) -> None:
        nonlocal version
        version += 1
        lease = Lease(node_id="d0", epoch=1, version=version, ttl_ms=3_600_000, credits=BIG)
        await store.upsert_lease(lease, NOW + n, 3_600_000)

    show("upsert_lease", await timed(n, upsert))
    show(
        "admission_view (8 sampled)",
        await timed(n, lambda i: store.admission_view("default", [], 8, NOW + n)),
    )


async def redis_bench(url: str, n: int) -> None:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    store = RedisStore(url, namespace=namespace)
    raw = Redis.from_url(url)
    floor = raw.register_script("return 1")
    try:
        await setup(store, 8)
        print(f"RedisStore on {url}:")
        show("floor: EVALSHA 'return 1'", await timed(n, lambda i: floor(keys=[], args=[])))
        show("floor: PING", await timed(n, lambda i: raw.ping()))
        ids: list[str] = []

        async def debit(i: int) -> None:
            out = await store.try_debit(f"d{i % 8}", ONE, 0.5, NOW, 600_000)
            assert out.reservation is not None
            ids.append(out.reservation.reservation_id)

        show("try_debit", await timed(n, debit))
        show("commit", await timed(n, lambda i: store.commit(ids[i], NOW, 600_000)))
        show("release", await timed(n, lambda i: store.release(ids[i], NOW)))
        candidates = [f"d{i}" for i in range(8)]
        show(
            f"admission_view (8 named, ~{n // 8} res)",
            await timed(n, lambda i: store.admission_view("default", candidates, 8, NOW)),
        )

        async def upsert(i: int) -> None:
            lease = Lease(
                node_id=f"d{i % 8}",
                epoch=1,
                version=2 + i,
                ttl_ms=3_600_000,
                credits=BIG,
                last_notice_seq=10**9,
            )
            await store.upsert_lease(lease, NOW, 3_600_000)

        show("upsert_lease (purges released)", await timed(n, upsert))
        for i in range(8, 1_000):
            await store.register_node(f"d{i}", NodeRole.DECODE, "default", {}, NOW)
        pipe = raw.pipeline(transaction=False)
        for i in range(8, 1_000):
            pipe.zadd(f"{namespace}:{{{namespace}:g}}:lenders", {f"d{i}": NOW + 3_600_000})
        await pipe.execute()
        show(
            "admission_view (8 of 1,000 sampled)",
            await timed(n, lambda i: store.admission_view("default", [], 8, NOW)),
        )
    finally:
        keys = [k async for k in raw.scan_iter(match=f"{namespace}*", count=1000)]
        if keys:
            await raw.delete(*keys)
        await raw.aclose()
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--n", type=int, default=2_000)
    args = parser.parse_args()
    asyncio.run(memory(args.n * 10))
    asyncio.run(redis_bench(args.redis_url, args.n))


if __name__ == "__main__":
    main()
