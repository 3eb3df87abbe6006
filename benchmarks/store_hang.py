"""Admit latency while Redis hangs (SIGSTOP), next to the same figures with Redis healthy.

    python benchmarks/store_hang.py [--concurrency 16] [--healthy-s 3] [--hang-s 5]
                                    [--after-s 2] [--no-compare]

Starts a redis-server of its own on a free port (it is stopped with SIGSTOP: never the shared
one), and a ``crossflow-broker serve`` process on it with the production admission deadline
(``admit_timeout_ms`` 50). One decode lease and one prefill pool load make every healthy Admit a
BORROW. ``--concurrency`` callers then send unary Admits back to back: ``--healthy-s`` seconds
with Redis healthy (the floor), ``--hang-s`` seconds with Redis stopped, ``--after-s`` seconds
after SIGCONT. Prints, per phase, Admit p50/p99 and calls per second, the decisions' reasons, the
broker's log lines per second (stderr), and the time from SIGCONT to the first BORROW.

Issue 29's targets: during the hang, from 200 ms after it starts, p99 <= 10 ms; first BORROW
within 0.5 s after Redis answers again. With ``--compare`` (the default) the same run is made a
second time with the breaker off (``CROSSFLOW_STORE_BREAKER__ENABLED=false``): what a hang cost
before it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from crossflow_ctl.api.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    lease_pb2,
    lease_pb2_grpc,
)

SETTLE_S = 0.2
"""The hang's first moments, reported apart: the breaker needs a few failed calls to open."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_redis(workdir: str) -> tuple[asyncio.subprocess.Process, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        cwd=workdir, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            await asyncio.sleep(0.05)
    raise SystemExit("redis-server did not start")


@dataclass
class Broker:
    proc: asyncio.subprocess.Process
    address: str
    lines: list[tuple[float, str]] = field(default_factory=list)
    """(perf_counter time, level) of each log line the broker wrote on stderr."""

    async def read_logs(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode(errors="replace")
            level = "warning" if '"level": "warning"' in text else "other"
            self.lines.append((time.perf_counter(), level))


async def start_broker(redis_url: str, breaker: bool) -> Broker:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "CROSSFLOW_POLICY__BORROW_SHARE": "1.0",
        "CROSSFLOW_POLICY__HOLD_TTL_MS": "2000",
        "CROSSFLOW_POLICY__MAX_LEASE_TTL_MS": "60000",
        "CROSSFLOW_STORE_BREAKER__ENABLED": "true" if breaker else "false",
        "CROSSFLOW_LOG_LEVEL": "warning",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "crossflow_ctl.broker", "serve", "--listen", "127.0.0.1:0",
        "--redis-url", redis_url, "--redis-namespace", f"hang-{uuid.uuid4().hex[:8]}",
        "--workers", "1", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
    if not line.startswith("listening on "):
        raise SystemExit(f"broker did not start: {line!r}")
    return Broker(proc, line.split()[-1])


async def feed(channel: grpc.aio.Channel) -> list[Any]:
    """One decode node with a large lease and one prefill server with a long queue."""
    stub = lease_pb2_grpc.LeaseServiceStub(channel)
    calls = []
    for node_id, role in (
        ("hang-d1", common_pb2.NODE_ROLE_DECODE),
        ("hang-p1", common_pb2.NODE_ROLE_PREFILL),
    ):
        call = stub.Connect()
        await call.write(
            lease_pb2.ConnectRequest(hello=lease_pb2.Hello(node_id=node_id, role=role))
        )
        await call.read()  # Welcome
        calls.append(call)
    credits = common_pb2.Credits(
        compute_tokens=10**9, kv_tokens=10**9, kv_transfer_bytes=10**15,
        output_tokens=10**9, slots=100_000,
    )  # fmt: skip
    lease = common_pb2.Lease(
        node_id="hang-d1", epoch=1, version=1, ttl_ms=60_000, credits=credits,
        queue_wait_ms=1.0, borrowed_prefill_rate_tps=200_000_000.0,
    )  # fmt: skip
    await calls[0].write(lease_pb2.ConnectRequest(lease=lease))
    ack = await calls[0].read()
    assert ack.lease_ack.result == lease_pb2.LEASE_RESULT_ACCEPTED, ack
    load = common_pb2.PoolLoad(
        node_id="hang-p1", outstanding_uncached_tokens=500_000, processing_rate_tps=20_000.0,
        ttl_ms=60_000,
    )  # fmt: skip
    await calls[1].write(lease_pb2.ConnectRequest(pool_load=load))
    await calls[1].write(lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat()))
    await calls[1].read()  # heartbeat echo: the pool load is stored
    return calls


Sample = tuple[float, float, int, str]
"""(start time, latency s, decision, reason) of one Admit."""


async def load(
    stub: Any, stop_at: list[float], concurrency: int, out: list[Sample], reasons: dict[int, str]
) -> None:
    request = admission_pb2.AdmitRequest(uncached_prompt_tokens=2_000, expected_output_tokens=50)

    async def caller() -> None:
        while time.perf_counter() < stop_at[0]:
            t0 = time.perf_counter()
            try:
                answer = await stub.Admit(request, timeout=5.0)
                decision = answer.decision
                reason = reasons.get(answer.reason, str(answer.reason))
            except grpc.aio.AioRpcError as exc:
                decision, reason = -1, f"error:{exc.code().name}"
            out.append((t0, time.perf_counter() - t0, decision, reason))

    await asyncio.gather(*(caller() for _ in range(concurrency)))


def quantiles_ms(samples: list[Sample]) -> tuple[float, float, int]:
    latencies = [s[1] for s in samples]
    if len(latencies) < 2:
        return float("nan"), float("nan"), len(latencies)
    q = statistics.quantiles(latencies, n=100)
    return q[49] * 1e3, q[98] * 1e3, len(latencies)


def report_phase(name: str, samples: list[Sample], seconds: float, lines: int) -> dict[str, float]:
    p50, p99, n = quantiles_ms(samples)
    reasons = Counter(s[3] for s in samples)
    top = ", ".join(f"{r} {c}" for r, c in reasons.most_common(4))
    print(
        f"  {name:<28} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  {n / seconds:8.0f} Admits/s"
        f"  {lines / seconds:6.1f} warning lines/s   [{top}]"
    )
    return {"p50_ms": p50, "p99_ms": p99, "rate": n / seconds}


async def run(redis_proc: Any, redis_url: str, args: argparse.Namespace, breaker: bool) -> None:
    broker = await start_broker(redis_url, breaker)
    logs = asyncio.create_task(broker.read_logs())
    reasons = {v.number: v.name.removeprefix("REASON_").lower() for v in
               admission_pb2.DESCRIPTOR.enum_types_by_name["Reason"].values}  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(broker.address) as channel:
            agents = await feed(channel)
            stub = admission_pb2_grpc.AdmissionServiceStub(channel)
            samples: list[Sample] = []
            total_s = args.healthy_s + args.hang_s + args.after_s
            stop_at = [time.perf_counter() + total_s]
            started = time.perf_counter()
            loader = asyncio.create_task(load(stub, stop_at, args.concurrency, samples, reasons))
            await asyncio.sleep(args.healthy_s)
            hang_at = time.perf_counter()
            os.kill(redis_proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(args.hang_s)
            finally:
                cont_at = time.perf_counter()
                os.kill(redis_proc.pid, signal.SIGCONT)
            await loader
            for call in agents:
                call.cancel()
    finally:
        broker.proc.send_signal(signal.SIGTERM)
        await broker.proc.wait()
        await logs

    def between(a: float, b: float) -> list[Sample]:
        return [s for s in samples if a <= s[0] < b]

    def warnings(a: float, b: float) -> int:
        return sum(1 for t, level in broker.lines if a <= t < b and level == "warning")

    warm = started + min(1.0, args.healthy_s / 2)  # connections and caches warm
    title = "breaker on (default)" if breaker else "breaker off (as before issue 29)"
    print(f"{title}, {args.concurrency} concurrent callers, admit_timeout_ms 50:")
    floor = report_phase("Redis healthy (floor)", between(warm, hang_at), hang_at - warm,
                         warnings(warm, hang_at))  # fmt: skip
    settle = hang_at + SETTLE_S
    report_phase(f"hang, first {SETTLE_S * 1e3:.0f} ms", between(hang_at, settle), SETTLE_S,
                 warnings(hang_at, settle))  # fmt: skip
    hang = report_phase(f"hang, {SETTLE_S * 1e3:.0f} ms on", between(settle, cont_at),
                        cont_at - settle, warnings(settle, cont_at))  # fmt: skip
    end = started + total_s
    report_phase("after SIGCONT", between(cont_at, end), end - cont_at, warnings(cont_at, end))
    borrows = [s[0] + s[1] for s in samples if s[0] >= cont_at and s[2] == 1]  # DECISION_BORROW
    first = (min(borrows) - cont_at) * 1e3 if borrows else float("nan")
    print(f"  first BORROW after SIGCONT: {first:.0f} ms")
    print(
        f"  hang p99 / healthy p99: {hang['p99_ms'] / floor['p99_ms']:.2f}x;"
        f" hang rate / healthy rate: {hang['rate'] / floor['rate']:.2f}x"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--healthy-s", type=float, default=3.0)
    parser.add_argument("--hang-s", type=float, default=5.0)
    parser.add_argument("--after-s", type=float, default=2.0)
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="skip the second run with the breaker off")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        redis_proc, redis_url = await start_redis(workdir)
        try:
            await run(redis_proc, redis_url, args, breaker=True)
            if args.compare:
                await run(redis_proc, redis_url, args, breaker=False)
        finally:
            os.kill(redis_proc.pid, signal.SIGCONT)
            redis_proc.terminate()
            await redis_proc.wait()


if __name__ == "__main__":
    asyncio.run(main())
