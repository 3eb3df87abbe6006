"""What each broker worker costs when there is little to do: the per-replica fixed costs of
``crossflow-broker serve --workers N`` (issue #32).

    python benchmarks/workers_idle.py [--workers 1,2] [--streams 256] [--seconds 10]
                                      [--admits-per-s 20]

For each N, a fresh ``serve --workers N`` on a private redis-server, and N-independent load:
``--streams`` agent streams (Hello, one lease, then quiet: each relay waiting for notices on
the worker it landed on), then two phases of ``--seconds``:

* ``idle``: nothing sent. What a worker spends on its own (policy refresh, node expiry sweep,
  its notice subscription, keepalives), per worker and in all, and Redis's CPU;
* ``trickle``: ``--admits-per-s`` unary Admits a second over fresh connections (spread over the
  workers by the kernel) that each borrow, then release: the background work each replica does
  to keep its admission view warm (working-set renewals) grows with the replicas that serve
  Admits, while the Admits themselves do not.

Prints CPU seconds per second (``cpu/s``) for the workers (each, and summed), the supervisor
and Redis, beside the N=1 row of the same run (the floor: one replica's fixed costs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from crossflow_ctl.api.v1 import common_pb2, lease_pb2, lease_pb2_grpc
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.admission import Decision

BIG = common_pb2.Credits(
    compute_tokens=10**9,
    kv_tokens=10**9,
    kv_transfer_bytes=10**15,
    output_tokens=10**9,
    slots=10**5,
)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        return sorted(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    except OSError:
        return []


async def redis_cpu(client: aioredis.Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def open_stream(addr: str, node_id: str, calls: list[tuple[Any, Any]]) -> None:
    """Hello, one lease, then quiet (the stream stays open); also a prefill pool report."""
    channel = grpc.aio.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
    call = lease_pb2_grpc.LeaseServiceStub(channel).Connect()
    calls.append((channel, call))
    hello = lease_pb2.Hello(
        node_id=node_id, role=common_pb2.NODE_ROLE_DECODE, epoch=1, refusal_acks=True
    )
    await call.write(lease_pb2.ConnectRequest(hello=hello))
    assert (await call.read()).WhichOneof("body") == "welcome"
    lease = common_pb2.Lease(
        node_id=node_id, epoch=1, version=1, ttl_ms=60_000, credits=BIG,
        borrowed_prefill_rate_tps=2e8,
    )  # fmt: skip
    await call.write(lease_pb2.ConnectRequest(lease=lease))
    await call.write(lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat()))
    while (await call.read()).WhichOneof("body") != "heartbeat":
        pass


async def open_prefill(addr: str, calls: list[tuple[Any, Any]]) -> None:
    channel = grpc.aio.insecure_channel(addr)
    call = lease_pb2_grpc.LeaseServiceStub(channel).Connect()
    calls.append((channel, call))
    hello = lease_pb2.Hello(node_id="p0", role=common_pb2.NODE_ROLE_PREFILL, epoch=1)
    await call.write(lease_pb2.ConnectRequest(hello=hello))
    await call.read()
    load = common_pb2.PoolLoad(
        node_id="p0", pool="default", outstanding_uncached_tokens=200_000,
        processing_rate_tps=20_000.0, prefill_rate_tps=20_000.0, ttl_ms=60_000,
    )  # fmt: skip
    await call.write(lease_pb2.ConnectRequest(pool_load=load))


async def run(args: argparse.Namespace, workers: int, redis_url: str) -> dict[str, float]:
    namespace = f"widle-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "CROSSFLOW_POLICY__BORROW_SHARE": "1.0",
        "CROSSFLOW_POLICY__MAX_LEASE_TTL_MS": "60000",
        "CROSSFLOW_LOG_LEVEL": "warning",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "crossflow_ctl.broker", "serve", "--listen", "127.0.0.1:0",
        "--redis-url", redis_url, "--redis-namespace", namespace, "--workers", str(workers),
        env=env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=120)).decode()
    assert line.startswith("listening on "), line
    addr = line.split()[-1]
    probe = aioredis.Redis.from_url(redis_url)
    calls: list[tuple[Any, Any]] = []
    try:
        await open_prefill(addr, calls)
        for start in range(0, args.streams, 32):
            batch = range(start, min(args.streams, start + 32))
            await asyncio.gather(*(open_stream(addr, f"n{i:05d}", calls) for i in batch))
        await asyncio.sleep(2.0)  # settle: Hellos' after-effects
        pids = children(proc.pid) if workers > 1 else [proc.pid]
        assert len(pids) == workers, pids
        out: dict[str, float] = {}

        async def measure(phase: str, work: asyncio.Future[None] | None) -> None:
            before = [cpu_s(p) for p in pids]
            sup0, r0, t0 = cpu_s(proc.pid), await redis_cpu(probe), time.monotonic()
            if work is None:
                await asyncio.sleep(args.seconds)
            else:
                await work
            dt = time.monotonic() - t0
            each = [(cpu_s(p) - b) / dt for p, b in zip(pids, before, strict=True)]
            out[f"{phase} workers"] = sum(each)
            out[f"{phase} max worker"] = max(each)
            out[f"{phase} supervisor"] = (cpu_s(proc.pid) - sup0) / dt if workers > 1 else 0.0
            out[f"{phase} redis"] = (await redis_cpu(probe) - r0) / dt

        await measure("idle", None)

        async def trickle() -> None:
            interval = 1.0 / args.admits_per_s
            deadline = time.monotonic() + args.seconds
            granted = sent = 0
            while time.monotonic() < deadline:
                sent += 1
                async with AdmissionClient(addr, timeout_s=10) as client:
                    adm = await client.admit(uncached_prompt_tokens=500)
                    if adm.decision is Decision.BORROW:
                        granted += 1
                        await client.release(adm.reservation_id)
                await asyncio.sleep(interval)
            out["borrowed"], out["admits"] = granted, sent

        await measure("trickle", asyncio.ensure_future(trickle()))
        return out
    finally:
        for channel, call in calls:
            call.cancel()
            await channel.close()
        proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), timeout=60)
        keys = [k async for k in probe.scan_iter(match=f"{namespace}*", count=1000)]
        for start in range(0, len(keys), 500):
            await probe.delete(*keys[start : start + 500])
        await probe.aclose()


async def main(args: argparse.Namespace) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    redis_proc = await asyncio.create_subprocess_exec(
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        probe = aioredis.Redis.from_url(url)
        for _ in range(100):
            with contextlib.suppress(OSError, aioredis.ConnectionError):
                if await probe.ping():
                    break
            await asyncio.sleep(0.05)
        await probe.aclose()
        print(
            f"workers_idle: {args.streams} quiet streams, {args.seconds:.0f} s a phase, "
            f"{args.admits_per_s:.0f} Admits/s in the trickle, load "
            f"{os.getloadavg()[0]:.1f}; CPU seconds per second"
        )
        print(
            " workers  phase    workers(sum)  max worker  supervisor   redis   "
            "vs N=1 (workers sum, redis)"
        )
        rows = {}
        for n in [int(w) for w in args.workers.split(",")]:
            rows[n] = await run(args, n, url)
            base = rows[min(rows)]
            for phase in ("idle", "trickle"):
                r = rows[n]
                ratio = (
                    f"{r[f'{phase} workers'] / base[f'{phase} workers']:.2f}x, "
                    f"{r[f'{phase} redis'] / base[f'{phase} redis']:.2f}x"
                    if base[f"{phase} workers"] > 0 and base[f"{phase} redis"] > 0
                    else "-"
                )
                print(
                    f" {n:7d}  {phase:7s}  {r[f'{phase} workers']:12.4f}  "
                    f"{r[f'{phase} max worker']:10.4f}  {r[f'{phase} supervisor']:10.4f}  "
                    f"{r[f'{phase} redis']:6.4f}   {ratio}"
                )
            r = rows[n]
            print(
                f"          trickle: {r['admits']:.0f} Admits ({r['borrowed']:.0f} borrowed), "
                f"{r['trickle workers'] * args.seconds / r['admits'] * 1e3:.2f} ms of worker CPU "
                f"and {r['trickle redis'] * args.seconds / r['admits'] * 1e3:.2f} ms of Redis "
                "CPU per Admit (a new connection each)"
            )
    finally:
        redis_proc.terminate()
        await redis_proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--admits-per-s", type=float, default=20.0)
    asyncio.run(main(parser.parse_args()))
