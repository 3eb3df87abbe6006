"""Admission latency and throughput over gRPC with Redis, next to two floors from the same run.

    python benchmarks/admission.py [--redis-url redis://127.0.0.1:6379/0] [--seconds 2]
                                   [--only-unary | --only-stream]

Starts one ``crossflow-broker serve`` process on a loopback port over Redis (its own key
namespace, deleted afterwards), streams one decode lease and one prefill pool load to it, then
measures, each sequentially (latency) and with ``--concurrency`` callers (throughput):

* ``admit``   : AdmissionService.Admit that borrows (view + plan + atomic debit in Redis)
* ``grpc``    : grpc.health.v1.Health/Check on the same broker (the bare grpc.aio unary floor)
* ``evalsha`` : EVALSHA of a trivial Lua script on the same Redis (the bare Redis floor)
* ``grpc.aio + 1 EVALSHA``: a bare grpc.aio server process (no broker code) whose handler runs
  one such EVALSHA: Admit's own round trip with no work, the floor of its design
* ``grpc.aio Admit + grant relay``: the same bare server's Admit, whose one EVALSHA also XADDs
  a grant to a per-node stream and PUBLISHes its wake, while this process holds that server's
  agent stream (LeaseService.Connect), which relays each grant the way the broker's relay does
  (the wake, then one XRANGE, then one message per grant): Admit's design floor including the
  grant relay DESIGN.md §5.4 and §6 require, with no admission work at all

and prints admit's p50 and p99 over the floors' sum (issue 13's targets: p50 <= 1.25x, p99 <= 2x)
and its throughput with ``--concurrency`` callers over the bare grpc.aio call's (target >= 70%),
and, where Linux's /proc allows, each serving process's CPU per sequential call (the broker's
per Admit and per health Check, the floor server's) with the debit script's time inside Redis:
on a shared machine CPU per call says more than wall time.
A warm Admit is ONE Redis round trip (the atomic debit): the plan uses the replica's cached view
(pool load, lender draw, node states; refreshed by each debit's reply).

Then AdmitStream, the streaming Admit for high-QPS routers (target >= 10,000 decisions/s per
broker process): raw, ``--stream-batch`` items per message with ``--stream-window`` messages in
flight, next to its floor, the same messages echoed by a bare grpc.aio bidirectional stream
(no broker code), with the broker's CPU per streamed decision (all its threads; on a shared
machine it says more than the rate); and through the client's ``AdmissionStream`` with
``--stream-callers`` concurrent callers.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crossflow_ctl.api.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    lease_pb2,
    lease_pb2_grpc,
)
from crossflow_ctl.client import AdmissionStream
from crossflow_ctl.domain.admission import Decision

THIS_FILE = os.path.abspath(__file__)
WARM_UP = 50
"""Calls :func:`measure` makes before it measures."""

BENCH_RATE_TPS = 200_000_000.0
"""The benchmark lease's borrowed-prefill rate: high enough that the broker's cap of a lease's
compute to rate x borrow horizon (``domain.session.within_horizon``) leaves its 10^9 compute
tokens whole, so admission always finds room and every phase measures grants."""


async def start_broker(
    redis_url: str, namespace: str, hold_ttl_ms: int
) -> tuple[asyncio.subprocess.Process, str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "CROSSFLOW_POLICY__BORROW_SHARE": "1.0",
        "CROSSFLOW_POLICY__HOLD_TTL_MS": str(hold_ttl_ms),
        "CROSSFLOW_POLICY__MAX_LEASE_TTL_MS": "60000",
        "CROSSFLOW_POLICY__ADMIT_TIMEOUT_MS": "1000",
        "CROSSFLOW_LOG_LEVEL": "warning",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "crossflow_ctl.broker",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--redis-url",
        redis_url,
        "--redis-namespace",
        namespace,
        "--workers",
        "1",  # one process, whose CPU is measured
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
    if not line.startswith("listening on "):
        raise SystemExit(f"broker did not start: {line!r}")
    return proc, line.split()[-1]


FLOOR_GRANT = """
local seq = redis.call('XADD', KEYS[1], 'MAXLEN', '~', 10000, '*', 'k', 'grant')
redis.call('PUBLISH', KEYS[2], 'n')
return seq
"""
"""The floor's grant: one stream entry and its wake (the debit script's ``cf_notice``, no debit)."""


async def floor_server(redis_url: str, key: str, evalshas: int) -> None:
    """A bare grpc.aio server (no broker code) whose health Check first runs ``evalshas``
    EVALSHAs of ``return 1`` one after another (Admit's transport floor: its round trips with no
    work), whose AdmitStream echoes each message's items as NORMAL results (AdmitStream's
    floor), and whose Admit runs ONE EVALSHA of :data:`FLOOR_GRANT` and answers BORROW, while
    Connect relays each grant to the stream's caller as the broker's relay does: one
    subscription to the wake channel, one XRANGE per wake, one message per grant (Admit's
    design floor with its grant relay). Prints ``listening on HOST:PORT`` like the broker; runs
    until terminated."""
    r = aioredis.Redis.from_url(redis_url, socket_timeout=1.0)
    script = r.register_script("return 1")
    grant = r.register_script(FLOOR_GRANT)
    notices, wakes = f"{key}:notices", f"{key}:wakes"

    class Servicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped stubs
        async def Check(self, request: Any, context: Any) -> Any:
            for _ in range(evalshas):
                await script(keys=[key])
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    class Floor(admission_pb2_grpc.AdmissionServiceServicer):  # type: ignore[misc]
        async def Admit(self, request: Any, context: Any) -> Any:
            seq = await grant(keys=[notices, wakes])
            return admission_pb2.AdmitResponse(
                decision=admission_pb2.DECISION_BORROW, node_id="floor", reservation_id=seq.decode()
            )

        async def AdmitStream(self, requests: Any, context: Any) -> Any:
            normal = admission_pb2.AdmitResponse(decision=admission_pb2.DECISION_NORMAL)
            async for message in requests:
                yield admission_pb2.AdmitStreamResponse(
                    results=[
                        admission_pb2.AdmitStreamResult(id=item.id, decision=normal)
                        for item in message.items
                    ]
                )

    class Relay(lease_pb2_grpc.LeaseServiceServicer):  # type: ignore[misc]
        async def Connect(self, requests: Any, context: Any) -> None:
            await anext(aiter(requests))  # the Hello
            pubsub: Any = r.pubsub()
            await pubsub.subscribe(wakes)
            await context.write(lease_pb2.ConnectResponse(welcome=lease_pb2.Welcome()))
            last = "0-0"
            async for wake in pubsub.listen():
                if wake["type"] != "message":
                    continue
                for entry_id, _ in await r.xrange(notices, min=f"({last}", count=256):
                    last = entry_id.decode()
                    notice = lease_pb2.Notice(kind=lease_pb2.NOTICE_KIND_GRANT, reservation_id=last)
                    await context.write(lease_pb2.ConnectResponse(notice=notice))

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(Servicer(), server)
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(Floor(), server)
    lease_pb2_grpc.add_LeaseServiceServicer_to_server(Relay(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


async def start_floor_server(
    redis_url: str, key: str, evalshas: int
) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        THIS_FILE,
        "--floor-server",
        str(evalshas),
        "--floor-key",
        key,
        "--redis-url",
        redis_url,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
    if not line.startswith("listening on "):
        raise SystemExit(f"floor server did not start: {line!r}")
    return proc, line.split()[-1]


async def feed(channel: grpc.aio.Channel) -> list[Any]:
    """One decode node with a large lease and one prefill server with a long queue."""
    stub = lease_pb2_grpc.LeaseServiceStub(channel)
    calls = []
    for node_id, role in (
        ("bench-d1", common_pb2.NODE_ROLE_DECODE),
        ("bench-p1", common_pb2.NODE_ROLE_PREFILL),
    ):
        call = stub.Connect()
        hello = lease_pb2.Hello(node_id=node_id, role=role, notice_batches=True)  # as the agent
        await call.write(lease_pb2.ConnectRequest(hello=hello))
        await call.read()  # Welcome
        calls.append(call)
    credits = common_pb2.Credits(
        compute_tokens=10**9,
        kv_tokens=10**9,
        kv_transfer_bytes=10**15,
        output_tokens=10**9,
        slots=100_000,
    )
    lease = common_pb2.Lease(
        node_id="bench-d1",
        epoch=1,
        version=1,
        ttl_ms=60_000,
        credits=credits,
        queue_wait_ms=1.0,
        borrowed_prefill_rate_tps=BENCH_RATE_TPS,
    )
    await calls[0].write(lease_pb2.ConnectRequest(lease=lease))
    ack = await calls[0].read()
    assert ack.lease_ack.result == lease_pb2.LEASE_RESULT_ACCEPTED, ack
    load = common_pb2.PoolLoad(
        node_id="bench-p1",
        outstanding_uncached_tokens=500_000,
        processing_rate_tps=20_000.0,
        ttl_ms=60_000,
    )
    await calls[1].write(lease_pb2.ConnectRequest(pool_load=load))
    await calls[1].write(lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat()))
    await calls[1].read()  # heartbeat echo: the pool load is stored
    return calls


async def relayed(call: Any, counts: dict[str, int]) -> None:
    """Read an agent stream's messages to its end, counting the notices in ``counts["notices"]``:
    an agent reads what its stream relays (a stream nobody reads stalls the relay's writes once
    gRPC's flow-control window is full)."""
    while (message := await call.read()) is not grpc.aio.EOF:  # read() as feed() did: one style
        body = message.WhichOneof("body")
        counts["notices"] += len(message.notices.notices) if body == "notices" else body == "notice"


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system, all threads) process ``pid`` has used; NaN without a pid or
    without Linux's /proc. On a shared, noisy machine it says more than wall time."""
    if pid is None:
        return math.nan
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    call: Callable[[], Awaitable[Any]], seconds: float, concurrency: int, pid: int | None = None
) -> dict[str, float]:
    """Sequential latency (and ``pid``'s CPU per sequential call: the serving process's), then
    throughput with ``concurrency`` callers."""
    for _ in range(WARM_UP):
        await call()
    latencies: list[float] = []
    cpu_before = cpu_seconds(pid)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - t0)
    cpu_per_call = (cpu_seconds(pid) - cpu_before) / len(latencies)
    done = 0

    async def worker(stop: float) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await call()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(t0 + seconds) for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100)
    return {
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "n": len(latencies),
        "ops_per_s": done / elapsed,
        "cpu_us": cpu_per_call * 1e6,
    }


async def evalsha_stats(r: aioredis.Redis) -> tuple[int, int]:
    """EVALSHA calls and microseconds inside Redis so far (INFO commandstats)."""
    stats = (await r.info("commandstats")).get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


async def stream_rate(
    stub: Any, request: admission_pb2.AdmitRequest, seconds: float, batch: int, window: int
) -> tuple[float, float]:
    """Decisions per second on one AdmitStream, and the share of them that borrowed."""
    call = stub.AdmitStream()
    sent = received = borrowed = 0
    room = asyncio.Event()

    async def send() -> None:
        nonlocal sent
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            if sent - received >= batch * window:
                room.clear()
                await room.wait()
                continue
            items = [
                admission_pb2.AdmitStreamItem(id=sent + i, request=request) for i in range(batch)
            ]
            await call.write(admission_pb2.AdmitStreamRequest(items=items))
            sent += batch
        await call.done_writing()

    async def receive() -> None:
        nonlocal received, borrowed
        async for response in call:
            received += len(response.results)
            borrowed += sum(
                r.decision.decision == admission_pb2.DECISION_BORROW for r in response.results
            )
            room.set()

    t0 = time.perf_counter()
    await asyncio.gather(send(), receive())
    elapsed = time.perf_counter() - t0
    return received / elapsed, borrowed / max(1, received)


async def helper_rate(addr: str, seconds: float, callers: int) -> tuple[float, float]:
    """Decisions per second through the client's AdmissionStream, ``callers`` at once."""
    done = borrowed = 0
    async with AdmissionStream(addr, timeout_s=5) as stream:

        async def caller(stop: float) -> None:
            nonlocal done, borrowed
            while time.perf_counter() < stop:
                answer = await stream.admit(uncached_prompt_tokens=512, expected_output_tokens=64)
                done += 1
                borrowed += answer.decision is Decision.BORROW

        for _ in range(20):
            await stream.admit(uncached_prompt_tokens=512, expected_output_tokens=64)
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(t0 + seconds) for _ in range(callers)))
        elapsed = time.perf_counter() - t0
    return done / elapsed, borrowed / max(1, done)


async def unary_phases(
    args: argparse.Namespace,
    procs: tuple[asyncio.subprocess.Process, asyncio.subprocess.Process],
    r: aioredis.Redis,
    namespace: str,
    channels: tuple[grpc.aio.Channel, grpc.aio.Channel],
    request: admission_pb2.AdmitRequest,
    notices: tuple[dict[str, int], dict[str, int]],
) -> float:
    """Admit and its floors (the module docstring), printed; returns Admit's rate with
    ``--concurrency`` callers. ``procs``, ``channels`` and ``notices``: the broker's, then the
    floor server's."""
    proc, floor_proc = procs
    channel, floor_channel = channels
    counts, floor_counts = notices
    admission = admission_pb2_grpc.AdmissionServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)

    async def admit() -> None:
        reply = await admission.Admit(request, timeout=5)
        assert reply.decision == admission_pb2.DECISION_BORROW, reply.message

    async def check() -> None:
        await health.Check(health_pb2.HealthCheckRequest(), timeout=5)

    floor_health = health_pb2_grpc.HealthStub(floor_channel)

    async def check_one_evalsha() -> None:
        await floor_health.Check(health_pb2.HealthCheckRequest(), timeout=5)

    floor_admission = admission_pb2_grpc.AdmissionServiceStub(floor_channel)

    async def admit_floor() -> None:
        await floor_admission.Admit(request, timeout=5)

    script = r.register_script("return 1")

    async def evalsha() -> None:
        await script(keys=[f"{namespace}:bench"])

    calls0, usec0 = await evalsha_stats(r)
    notices0 = counts["notices"]  # the warm-up's notices count too (calls() counts them)
    admitted = await measure(admit, args.seconds, args.concurrency, proc.pid)
    calls1, usec1 = await evalsha_stats(r)
    admit_notices = counts["notices"] - notices0
    relay_floor = await measure(admit_floor, args.seconds, args.concurrency, floor_proc.pid)
    await asyncio.sleep(0.2)  # the last grants' messages
    rows = [
        ("admit (gRPC + Redis)", admitted),
        (
            "floor: grpc.aio health Check",
            await measure(check, args.seconds, args.concurrency, proc.pid),
        ),
        (
            "floor: Redis EVALSHA 'return 1'",
            await measure(evalsha, args.seconds, args.concurrency),
        ),
        (
            "floor: grpc.aio + 1 EVALSHA inside",
            await measure(check_one_evalsha, args.seconds, args.concurrency, floor_proc.pid),
        ),
        ("floor: grpc.aio Admit + grant relay", relay_floor),
    ]
    print(
        f"loopback, broker pid {proc.pid}, {args.seconds:.1f} s per phase, "
        f"throughput with {args.concurrency} concurrent callers, hold TTL {args.hold_ttl_ms} ms"
    )
    print(f"{'call':34} {'p50 ms':>8} {'p99 ms':>8} {'seq n':>7} {'ops/s':>9} {'srv CPU us':>10}")
    for name, m in rows:
        cpu = "-" if math.isnan(m["cpu_us"]) else f"{m['cpu_us']:.0f}"
        print(
            f"{name:34} {m['p50_ms']:8.3f} {m['p99_ms']:8.3f} {m['n']:7.0f} "
            f"{m['ops_per_s']:9.0f} {cpu:>10}"
        )
    admit_p50, grpc_p50, redis_p50, trips_p50, relay_p50 = (m["p50_ms"] for _, m in rows)
    admit_p99, grpc_p99, redis_p99, _, relay_p99 = (m["p99_ms"] for _, m in rows)
    admit_ops, grpc_ops = rows[0][1]["ops_per_s"], rows[1][1]["ops_per_s"]
    print(
        f"admit p50 over floors: {admit_p50 / grpc_p50:.1f}x gRPC, "
        f"{admit_p50 / redis_p50:.1f}x EVALSHA, "
        f"{admit_p50 / (grpc_p50 + redis_p50):.2f}x their sum (target: <= 1.25x)"
    )
    print(
        f"admit p99 over the floors' p99 sum: {admit_p99 / (grpc_p99 + redis_p99):.2f}x "
        f"(target: <= 2x)"
    )
    print(
        f"admit throughput with {args.concurrency} callers: {admit_ops:.0f}/s = "
        f"{admit_ops / grpc_ops:.0%} of the bare grpc.aio call's {grpc_ops:.0f}/s "
        f"(target: >= 70%)"
    )
    # Admit makes one Redis round trip (the atomic debit) inside a grpc.aio handler: with no
    # work at all it could not beat that floor.
    print(
        f"admit p50 over grpc.aio + 1 EVALSHA inside (its round trip, no work): "
        f"{admit_p50 / trips_p50:.2f}x; that floor is "
        f"{trips_p50 / (grpc_p50 + redis_p50):.2f}x the floors' sum"
    )
    # CPU is what a busy broker runs out of: the serving process's CPU per sequential call
    # (all its threads), the debit script's time inside Redis, and what Admit adds to a
    # bare unary call on the same broker and to the floor of its design.
    admit_cpu, check_cpu, trips_cpu = (rows[i][1]["cpu_us"] for i in (0, 1, 3))
    script_us = (usec1 - usec0) / max(1, calls1 - calls0)
    print(
        f"CPU per sequential call: broker {admit_cpu:.0f} us per Admit, {check_cpu:.0f} us "
        f"per health Check (Admit adds {admit_cpu - check_cpu:.0f} us); the grpc.aio + 1 "
        f"EVALSHA server {trips_cpu:.0f} us; inside Redis {script_us:.1f} us per EVALSHA "
        f"during the Admit phase"
    )

    # The grant relay is part of Admit's design (DESIGN.md §5.4, §6): every BORROW writes a
    # grant that the replica holding the node's agent stream reads back from Redis and sends.
    def calls(m: dict[str, float]) -> float:  # warm-up, sequential and concurrent calls
        return WARM_UP + m["n"] + m["ops_per_s"] * args.seconds

    print(
        f"admit over its design floor with the grant relay (grpc.aio Admit, 1 EVALSHA that "
        f"XADDs + PUBLISHes, relayed by XRANGE, 1 message per grant): p50 "
        f"{admit_p50 / relay_p50:.2f}x, p99 {admit_p99 / relay_p99:.2f}x, CPU per call "
        f"{admit_cpu:.0f} us vs {relay_floor['cpu_us']:.0f} us "
        f"({admit_cpu / relay_floor['cpu_us']:.2f}x, Admit adds "
        f"{admit_cpu - relay_floor['cpu_us']:.0f} us); notices relayed per call: broker "
        f"{admit_notices / calls(admitted):.2f} (grant + expiry), floor "
        f"{floor_counts['notices'] / calls(relay_floor):.2f}"
    )
    return float(admit_ops)


async def stream_phases(
    args: argparse.Namespace,
    pid: int,
    channel: grpc.aio.Channel,
    floor_channel: grpc.aio.Channel,
    request: admission_pb2.AdmitRequest,
    addr: str,
    admit_ops: float | None,
) -> None:
    """AdmitStream raw, next to the bare bidi echo, then through the client's AdmissionStream;
    ``admit_ops`` (unary Admit's rate) is compared with when the unary phases ran."""
    stream_stub = admission_pb2_grpc.AdmissionServiceStub(channel)
    echo_stub = admission_pb2_grpc.AdmissionServiceStub(floor_channel)
    batch, window = args.stream_batch, args.stream_window
    await stream_rate(stream_stub, request, 0.3, batch, window)  # warm up
    cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
    rate, share = await stream_rate(stream_stub, request, args.seconds, batch, window)
    stream_cpu_us = (cpu_seconds(pid) - cpu0) / (rate * (time.perf_counter() - wall0))
    echo, _ = await stream_rate(echo_stub, request, args.seconds, batch, window)
    helper, helper_share = await helper_rate(addr, args.seconds, args.stream_callers)
    print(
        f"AdmitStream ({batch} items/message, {window} messages in flight): "
        f"{rate:,.0f} decisions/s ({share:.0%} borrowed) vs floor (bare bidi echo) "
        f"{echo:,.0f}/s = {rate / echo:.0%} of it (target: >= 10,000/s); broker CPU "
        f"{stream_cpu_us * 1e6:.0f} us per decision"
    )
    versus = (
        ""
        if admit_ops is None
        else f", {helper / admit_ops:.1f}x unary Admit at {args.concurrency} callers"
    )
    print(
        f"AdmitStream via client AdmissionStream, {args.stream_callers} concurrent callers: "
        f"{helper:,.0f} decisions/s ({helper_share:.0%} borrowed){versus}"
    )


async def main(args: argparse.Namespace) -> None:
    namespace = f"bench-{uuid.uuid4().hex[:10]}"
    proc, addr = await start_broker(args.redis_url, namespace, args.hold_ttl_ms)
    floor_proc, floor_addr = await start_floor_server(args.redis_url, f"{namespace}:floor", 1)
    r = aioredis.Redis.from_url(args.redis_url)
    channel = grpc.aio.insecure_channel(addr)
    floor_channel = grpc.aio.insecure_channel(floor_addr)
    feeds: list[Any] = []
    readers: list[asyncio.Task[None]] = []
    counts = {"notices": 0}
    floor_counts = {"notices": 0}
    try:
        feeds = await feed(channel)
        floor_agent = lease_pb2_grpc.LeaseServiceStub(floor_channel).Connect()
        await floor_agent.write(lease_pb2.ConnectRequest(hello=lease_pb2.Hello(node_id="floor")))
        await floor_agent.read()  # Welcome: the floor's relay is subscribed
        feeds.append(floor_agent)
        readers = [
            asyncio.create_task(relayed(feeds[0], counts)),
            asyncio.create_task(relayed(floor_agent, floor_counts)),
        ]
        admission = admission_pb2_grpc.AdmissionServiceStub(channel)
        request = admission_pb2.AdmitRequest(uncached_prompt_tokens=512, expected_output_tokens=64)
        first = await admission.Admit(request, timeout=5)
        if first.decision != admission_pb2.DECISION_BORROW:
            raise SystemExit(f"admission did not borrow: {first.message}")
        admit_ops = None
        if args.only_stream:
            print(f"broker pid {proc.pid}", flush=True)  # for a profiler of the stream phase
        else:
            admit_ops = await unary_phases(
                args,
                (proc, floor_proc),
                r,
                namespace,
                (channel, floor_channel),
                request,
                (counts, floor_counts),
            )
        if not args.only_unary:
            await stream_phases(args, proc.pid, channel, floor_channel, request, addr, admit_ops)
    finally:
        for call in feeds:
            call.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await channel.close()
        await floor_channel.close()
        for process in (proc, floor_proc):
            process.terminate()
            await process.wait()
        keys = [k async for k in r.scan_iter(match=f"{namespace}*", count=1000)]
        if keys:
            await r.delete(*keys)
        await r.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--stream-batch", type=int, default=64)
    parser.add_argument("--stream-window", type=int, default=8)
    parser.add_argument("--stream-callers", type=int, default=256)
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--only-unary",
        action="store_true",
        help="stop after the unary phases (Admit and its floors): no AdmitStream phases",
    )
    only.add_argument(
        "--only-stream",
        action="store_true",
        help="run only the AdmitStream phases (prints the broker's pid first, for a profiler)",
    )
    parser.add_argument("--floor-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--floor-key", default="bench-floor", help=argparse.SUPPRESS)
    parser.add_argument(
        "--hold-ttl-ms",
        type=int,
        default=100,
        help="HELD reservations expire after this; open reservations ~ rate x TTL",
    )
    parsed = parser.parse_args()
    if parsed.floor_server is not None:
        asyncio.run(floor_server(parsed.redis_url, parsed.floor_key, parsed.floor_server))
    else:
        asyncio.run(main(parsed))
