"""The broker's per-lease work without gRPC: the lease stream's ack path (wire decoding, the
Broker's checks, RedisStore.upsert_lease through the coalescer and the ``upsert_leases``
script, metrics) driven in-process by N concurrent "streams" (issue #32, lease ingest).

    python benchmarks/ingest_path.py [--redis-url redis://127.0.0.1:6379/0] [--streams 64]
                                     [--leases 20000] [--profile FILE] [--credits-move] [--rounds 3]

Prints the process CPU per accepted lease, and beside it, measured in the same run, the floor:
the same loop with the store's upsert replaced by an already-resolved future (the servicer, the
proto-to-domain decoding and the Broker's checks alone), so ``path - floor`` is the store write
path. Redis's own CPU per lease (INFO's used_cpu_*) is printed too. ``--profile FILE`` writes a
cProfile of the measured (real store) phase; ``--credits-move`` changes the credits on every
lease (as a busy node's leases do), otherwise only the version moves (as in scale.py).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from crossflow_ctl.api.v1 import common_pb2
from crossflow_ctl.broker.streams import LeaseStreamServicer, StreamRegistry, _Accepted
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.models import NodeRole
from crossflow_ctl.observability import BrokerMetrics
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.base import LeaseOutcome
from crossflow_ctl.store.redis_store import RedisStore

BIG = common_pb2.Credits(
    compute_tokens=10**9,
    kv_tokens=10**9,
    kv_transfer_bytes=10**15,
    output_tokens=10**9,
    slots=100_000,
)


class _NoOut:
    """The stream's way out, with nothing to write to (refusal-only acks: none are sent)."""

    sent = 0

    async def send(self, message: Any) -> None:
        self.sent += 1


async def _redis_cpu(client: aioredis.Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def _drive(
    servicer: LeaseStreamServicer,
    infos: list[Any],
    leases: int,
    credits_move: bool,
    version0: int,
) -> int:
    out = _NoOut()
    per_stream = leases // len(infos)

    async def stream(info: Any) -> None:
        msg = common_pb2.Lease(
            node_id=info.node_id,
            epoch=1,
            ttl_ms=60_000,
            credits=BIG,
            queue_wait_ms=1.0,
            borrowed_prefill_rate_tps=2e8,
        )
        accepted = _Accepted()
        for v in range(version0 + 1, version0 + per_stream + 1):
            msg.version = v
            if credits_move:
                msg.credits.compute_tokens = 10**9 - v
            await servicer._lease(msg, info, out, accepted, True)  # type: ignore[arg-type]

    await asyncio.gather(*(stream(info) for info in infos))
    assert out.sent == 0, f"{out.sent} leases refused"
    return per_stream * len(infos)


async def main(args: argparse.Namespace) -> None:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    settings = BrokerSettings(redis_url=args.redis_url, redis_namespace=namespace)
    store = RedisStore(
        args.redis_url, namespace=namespace, socket_timeout_s=10.0, op_timeout_s=30.0
    )
    broker = Broker(store, SystemClock(), settings, "bench", BrokerMetrics())
    servicer = LeaseStreamServicer(broker, StreamRegistry())
    probe = aioredis.Redis.from_url(args.redis_url)
    try:
        infos = [
            await broker.register(f"n{i:05d}", NodeRole.DECODE, "default", {})
            for i in range(args.streams)
        ]
        await _drive(servicer, infos, args.streams * 4, args.credits_move, 0)  # warm up
        version = args.leases

        # the floor: everything but the store's write
        real_upsert = store.upsert_lease

        async def no_store(lease: Any, now_ms: int, max_ttl_ms: int) -> LeaseOutcome:
            return LeaseOutcome(
                accepted=True, stored_epoch=lease.epoch, stored_version=lease.version
            )

        async def phase(write: bool) -> tuple[float, float, float, float]:
            """CPU per lease (us), Redis CPU per lease (us), leases/s, leases per pipeline."""
            nonlocal version
            store.upsert_lease = real_upsert if write else no_store  # type: ignore[method-assign]
            b0 = store._ingest.batches
            r0, c0, w0 = await _redis_cpu(probe), time.process_time(), time.perf_counter()
            n = await _drive(servicer, infos, args.leases, args.credits_move, version)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            redis_us = (await _redis_cpu(probe) - r0) / n * 1e6
            version += args.leases
            batches = max(1, store._ingest.batches - b0)
            return cpu / n * 1e6, redis_us, n / wall, n / batches

        print(
            f"ingest path: {args.streams} streams, {args.leases} leases a phase, credits "
            f"{'move' if args.credits_move else 'fixed'}; us of CPU per lease"
        )
        print(" round  floor(no write)  path  redis  leases/pipeline")
        for rnd in range(args.rounds):
            floor_us = (await phase(False))[0]
            path_us, redis_us, _, per_pipe = await phase(True)
            print(
                f" {rnd:5d}  {floor_us:15.1f}  {path_us:4.1f}  {redis_us:5.1f}  "
                f"{per_pipe:15.1f}   store path {path_us - floor_us:.1f}"
            )
        if args.profile:
            store.upsert_lease = real_upsert  # type: ignore[method-assign]
            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
            await _drive(servicer, infos, args.leases, args.credits_move, version)
            profiler.disable()
            profiler.dump_stats(args.profile)
    finally:
        await store.close()
        keys = [k async for k in probe.scan_iter(match=f"{namespace}*", count=1000)]
        for start in range(0, len(keys), 500):
            await probe.delete(*keys[start : start + 500])
        await probe.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--leases", type=int, default=20_000)
    parser.add_argument("--profile", help="write a cProfile of the real-store phase here")
    parser.add_argument("--credits-move", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
