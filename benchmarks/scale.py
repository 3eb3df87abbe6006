"""Fleet scale: one broker process on Redis serving N real agent streams (issue #11, #32).

    python benchmarks/scale.py [--nodes 8,512,4096] [--redis-url redis://127.0.0.1:6379/0]
                               [--seconds 3] [--cluster] [--trace DIR] [--no-pin]

Without ``--redis-url`` the run starts its own redis-server (so its CPU per lease is this run's
alone). The broker and the no-op floor run on CPU 0 (``taskset``), the fleet on the others.
The streams speak as agents do now (Hello.refusal_acks: acks for refusals only, a cumulative ack
on each heartbeat answer, a heartbeat per 2 leases at the largest fleet), and so does the no-op
floor. After the table: broker CPU per lease over that floor, Redis CPU per
lease, the lease messages a real Agent sends per second before and after the deadband
(synthetic engine, time stepped by hand), and the cores a fleet of ``--fleet-nodes`` steady
nodes needs at those rates.

For each N, a fresh ``crossflow-broker serve`` process (its own key namespace, deleted after)
and a fleet process that opens N real LeaseService.Connect streams to it (many streams per
process, on a few HTTP/2 connections), each with a Hello and a first lease. Then, with the
fleet connected (every relay waiting for notices, N lenders in the index):

* floors, measured here in the same run: ``redis``, a PING round trip to the same Redis, and
  ``grpc``, grpc.health.v1 Health/Check on the same broker (the bare grpc.aio unary call);
* ``admit``: sequential AdmissionService.Admit calls that borrow (no candidates given, so the
  broker samples lenders among the N), p50/p99, and the broker's CPU per Admit over the
  phase (its background view renewals included) less what it uses idle (measured while
  ``redis`` runs, the streams connected and quiet);
* ``ingest``: every stream keeps leases in flight (a new version as soon as one is acked) for
  ``--seconds``; accepted leases per second at the broker;
* ``cpu b/f``: CPU seconds per second the broker and the fleet process used while ingesting
  (the machine's other load shows as a broker below 1.0 with the fleet not at 1.0 either);
* ``us/lease``: the broker's CPU per accepted lease, in microseconds: the ingest figure that
  the machine's other load moves least (leases/s is bound by the cores the fleet shares);
* ``floor/s``: the ingest floor, measured here in the same run: the same fleet against a
  no-op LeaseService in its own process (grpc.aio, acks every lease at once, no store), with
  acks per CPU second of that server: what grpc.aio alone costs per lease on this machine;
* ``conns``: the broker's connections to Redis (CLIENT LIST, by client name), which must
  not grow with N.

``--trace DIR`` also writes each measured Admit's start and latency to ``DIR/admit-N.txt``.

Prints one row per N, then admit p99 at the largest N over p99 at the smallest (target <= 1.5)
and ingest at the largest N (target >= 10,000 leases/s). Streams' leases carry a 60 s TTL and
huge credits so admission always finds room; holds expire after 200 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import socket
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
from crossflow_ctl.domain.deadband import DEFAULT_BITS

THIS_FILE = os.path.abspath(__file__)
STREAMS_PER_CHANNEL = 64
BATCH = 2
"""Leases per heartbeat at the largest fleets (more at small ones, 512 / N): about the ratio a
real agent sends (a heartbeat once writes go unanswered for a third of its stall timeout, at
most one per lease)."""
WARM_UP = 50
"""Calls made before each latency figure is measured (counted in the Admit phase's CPU)."""
BIG = common_pb2.Credits(
    compute_tokens=10**9,
    kv_tokens=10**9,
    kv_transfer_bytes=10**15,
    output_tokens=10**9,
    slots=100_000,
)

BENCH_RATE_TPS = 200_000_000.0
"""The benchmark lease's borrowed-prefill rate: high enough that the broker's cap of a lease's
compute to rate x borrow horizon (``domain.session.within_horizon``) leaves its 10^9 compute
tokens whole, so admission always finds room and every phase measures grants."""


# -- the fleet (a child process) -----------------------------------------------------------------
HEARTBEAT = lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat())


class Stream:
    """One agent stream as the agent speaks it now: Hello.refusal_acks, so the broker acks only
    refused leases and each heartbeat's answer acks every lease accepted before it. The stream
    keeps up to two batches in flight, each ``batch`` leases and a heartbeat (the heartbeat
    answer is the flow control a per-lease ack was)."""

    def __init__(self, stub: Any, node_id: str, batch: int) -> None:
        self.node_id = node_id
        self.version = 0
        self.acked_version = 0
        """The newest version a heartbeat answer acked (leases accepted so far, less refusals)."""
        self.accepted = 0
        """Leases acked one by one as ACCEPTED (a broker that ignores refusal_acks)."""
        self.refused = 0
        self.notices = 0
        self.retries = 0
        self.beats = 0
        self.ended = ""
        """How the stream ended (a status name), "" while open."""
        self._stub = stub
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._batch = batch
        self._window = asyncio.Semaphore(2)
        self._acked = asyncio.Event()
        self._request = lease_pb2.ConnectRequest(
            lease=common_pb2.Lease(
                node_id=node_id,
                epoch=1,
                ttl_ms=60_000,
                credits=BIG,
                queue_wait_ms=1.0,
                borrowed_prefill_rate_tps=BENCH_RATE_TPS,
            )
        )

    async def open(self) -> None:
        """Hello until welcomed and the first lease acked: like a real agent, retry with backoff
        when the broker refuses or ends the stream (a registration storm can find every Redis
        connection busy, or a starved machine run a store call past its timeout: UNAVAILABLE)."""
        hello = lease_pb2.Hello(
            node_id=self.node_id, role=common_pb2.NODE_ROLE_DECODE, epoch=1, refusal_acks=True
        )
        for attempt in range(30):
            if await self._connect(hello):
                return
            self.retries += 1
            self._call.cancel()
            await asyncio.sleep(min(2.0, 0.05 * 2**attempt))
        raise SystemExit(f"{self.node_id}: no first lease acked in 30 tries")

    async def _connect(self, hello: Any) -> bool:
        """One stream: Hello, then the first lease; whether it was acked on a stream still open."""
        self._call = self._stub.Connect()
        self.ended = ""
        self._acked.clear()
        # a fresh window: the end of a stream that was retried released the old one
        self._window = asyncio.Semaphore(2)
        try:
            await self._call.write(lease_pb2.ConnectRequest(hello=hello))
            first = await self._call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return False
        if first is grpc.aio.EOF:
            return False
        assert first.WhichOneof("body") == "welcome", first
        self._reader = asyncio.get_running_loop().create_task(self._read())
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._window.acquire()
            await self._call.write(self._lease())
            await self._call.write(HEARTBEAT)
        await self._acked.wait()
        return not self.ended and self.acked_version >= self.version

    def _lease(self) -> Any:
        """The stream's one request, with the next version (grpc serializes it in ``write``, so
        reusing it keeps the generator's cost per lease to a field set and a write)."""
        self.version += 1
        self._request.lease.version = self.version
        return self._request

    async def _read(self) -> None:
        try:
            await self._read_all()
        except grpc.aio.AioRpcError as exc:
            self.ended = exc.code().name
        finally:
            self.ended = self.ended or "OK"
            self._window.release()  # a pump waiting on this stream stops
            self._acked.set()  # and so does an open waiting for its first ack

    async def _read_all(self) -> None:
        while True:
            msg = await self._call.read()
            if msg is grpc.aio.EOF:
                return
            body = msg.WhichOneof("body")
            if body == "heartbeat":
                self.acked_version = max(self.acked_version, msg.heartbeat.acked_version)
                self.beats += 1
                self._window.release()
                self._acked.set()
            elif body == "lease_ack":
                if msg.lease_ack.result == lease_pb2.LEASE_RESULT_ACCEPTED:
                    self.accepted += 1
                else:
                    self.refused += 1
            elif body == "notice":
                self.notices += 1

    async def pump(self, stop_at: float) -> None:
        while time.perf_counter() < stop_at and not self.ended:
            await self._window.acquire()
            if self.ended:
                return
            try:
                for _ in range(self._batch):
                    await self._call.write(self._lease())
                await self._call.write(HEARTBEAT)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return  # the broker ended the stream (counted as ended by the reader)


async def fleet(addr: str, nodes: int, prefix: str) -> None:
    """N streams to ``addr``; commands on stdin: ``ingest SECONDS``, ``quit``."""
    batch = max(BATCH, 512 // nodes)
    channels = [
        grpc.aio.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range((nodes + STREAMS_PER_CHANNEL - 1) // STREAMS_PER_CHANNEL)
    ]
    stubs = [lease_pb2_grpc.LeaseServiceStub(c) for c in channels]
    streams = [Stream(stubs[i % len(stubs)], f"{prefix}-{i:05d}", batch) for i in range(nodes)]
    t0 = time.perf_counter()
    for start in range(0, nodes, 256):  # open in waves: registration is a store write each
        await asyncio.gather(*(s.open() for s in streams[start : start + 256]))
    retries = sum(s.retries for s in streams)
    print(f"ready {time.perf_counter() - t0:.2f} {retries}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        if line[0] == "ingest":
            before = sum(s.acked_version + s.accepted - s.refused for s in streams)
            refused = sum(s.refused for s in streams)
            beats = sum(s.beats for s in streams)
            t0 = time.perf_counter()
            await asyncio.gather(*(s.pump(t0 + float(line[1])) for s in streams))
            elapsed = time.perf_counter() - t0
            accepted = sum(s.acked_version + s.accepted - s.refused for s in streams) - before
            refused = sum(s.refused for s in streams) - refused
            beats = sum(s.beats for s in streams) - beats
            ended = sum(1 for s in streams if s.ended)
            print(f"ingest {accepted} {refused} {elapsed:.3f} {ended} {beats}", flush=True)
        elif line[0] == "notices":
            print(f"notices {sum(s.notices for s in streams)}", flush=True)
        else:
            break
    for c in channels:
        await c.close()


class NoOpLeases(lease_pb2_grpc.LeaseServiceServicer):
    """The ingest floor: welcomes every stream, stores nothing, and speaks the broker's
    protocol: with Hello.refusal_acks it acks no accepted lease (it refuses none) and answers
    each heartbeat with the newest lease it took; without, it acks every lease at once."""

    async def Connect(self, requests: Any, context: Any) -> Any:
        refusal_acks, epoch, version = False, 0, 0
        async for req in requests:
            body = req.WhichOneof("body")
            if body == "lease":
                epoch, version = req.lease.epoch, req.lease.version
                if not refusal_acks:
                    ack = lease_pb2.LeaseAck(
                        epoch=epoch, version=version, result=lease_pb2.LEASE_RESULT_ACCEPTED
                    )
                    yield lease_pb2.ConnectResponse(lease_ack=ack)
            elif body == "heartbeat":
                beat = lease_pb2.Heartbeat(acked_epoch=epoch, acked_version=version)
                yield lease_pb2.ConnectResponse(heartbeat=beat)
            elif body == "hello":
                refusal_acks = req.hello.refusal_acks
                yield lease_pb2.ConnectResponse(welcome=lease_pb2.Welcome(broker_id="no-op"))


async def no_op_server() -> None:
    server = grpc.aio.server()
    lease_pb2_grpc.add_LeaseServiceServicer_to_server(NoOpLeases(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


# -- the driver ------------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def child(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *args,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def expect(proc: asyncio.subprocess.Process, word: str, timeout_s: float) -> list[str]:
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=timeout_s)).decode()
    if not line.startswith(word):
        raise SystemExit(f"expected {word!r}, got {line!r}")
    return line.split()[1:]


async def start_broker(args: argparse.Namespace, namespace: str) -> tuple[Any, str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "CROSSFLOW_POLICY__BORROW_SHARE": "1.0",
        "CROSSFLOW_POLICY__HOLD_TTL_MS": "200",
        "CROSSFLOW_POLICY__MAX_LEASE_TTL_MS": "60000",
        "CROSSFLOW_POLICY__ADMIT_TIMEOUT_MS": "2000",
        "CROSSFLOW_ADMIN_TIMEOUT_MS": "10000",
        "CROSSFLOW_LOG_LEVEL": "warning",
    }
    cmd = [*pinned(args, broker=True), sys.executable, "-m", "crossflow_ctl.broker", "serve"]
    cmd += ["--listen", "127.0.0.1:0"]
    cmd += ["--redis-url", args.redis_url, "--redis-namespace", namespace]
    cmd += ["--workers", "1"]  # one process: the CPU per lease measured is one worker's
    if args.cluster:
        cmd.append("--redis-cluster")
    proc = await child(*cmd, env=env)
    return proc, (await expect(proc, "listening on", 60))[-1]


def pinned(args: argparse.Namespace, broker: bool = False) -> list[str]:
    """``taskset`` for a child: the broker (and the no-op floor) on CPU 0, the fleet on the
    others, so the fleet does not take the broker's core (Redis is not pinned); nothing with
    ``--no-pin`` or one CPU."""
    cpus = os.cpu_count() or 1
    if args.no_pin or cpus < 2 or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", "0" if broker else f"1-{cpus - 1}"]


async def redis_cpu_s(args: argparse.Namespace, r: Any) -> float:
    """CPU seconds the Redis server has used: its process's, when this run started it, else
    what INFO says (a shared server's other clients count too)."""
    if args.redis_pid:
        return cpu_s(args.redis_pid)
    info = await r.info("cpu")
    if isinstance(info, dict) and "used_cpu_sys" not in info:  # a Cluster: one per node
        return sum(float(v["used_cpu_sys"]) + float(v["used_cpu_user"]) for v in info.values())
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def start_redis(args: argparse.Namespace) -> asyncio.subprocess.Process:
    """A private redis-server on a free port (its CPU is this run's alone)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        *pinned(args),
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        stdout=asyncio.subprocess.DEVNULL,
    )
    args.redis_url, args.redis_pid = f"redis://127.0.0.1:{port}/0", proc.pid
    probe = aioredis.Redis.from_url(args.redis_url)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError, aioredis.ConnectionError):
                if await probe.ping():
                    return proc
            await asyncio.sleep(0.05)
    finally:
        await probe.aclose()
    raise SystemExit("the private redis-server did not answer")


async def steady_node(bits: int, rps: float, periods: int) -> float:
    """Leases a real Agent sends per second over ``periods`` periods of a synthetic engine
    with ``rps`` background requests (0: an idle, steady node), time stepped by hand, the
    deadband at ``bits`` (0: off, every period's lease goes)."""
    from crossflow_agent.agent import Agent
    from crossflow_agent.settings import AgentSettings
    from crossflow_agent.sources.synthetic import EngineScript, SyntheticEngine, SyntheticSource
    from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
    from crossflow_ctl.domain.clock import ManualClock

    t = [1_000.0]
    settings = AgentSettings(
        node_id="steady",
        deadband_bits=bits,
        synthetic=EngineScript(background_rps=rps),
        lease={"itl_slo_ms": 100.0},  # the synthetic engine's ITL p99 reads up to 60 ms
    )
    model, node = MODEL_PRESETS[settings.model], NODE_PRESETS[settings.node_preset]
    engine = SyntheticEngine(model, node, settings.synthetic, monotonic=lambda: t[0])
    clock = ManualClock()
    agent = Agent(
        settings, SyntheticSource(engine), model, node, clock=clock, monotonic=lambda: t[0]
    )
    agent.stream.state.sessions = 1
    agent.stream.send = lambda request: True  # type: ignore[method-assign]
    for _ in range(periods):
        await agent.tick()
        t[0] += settings.period_ms / 1000
        clock.advance(settings.period_ms)
    return agent.sent / (periods * settings.period_ms / 1000)


def write_trace(path: str, starts: list[float], durations: list[float]) -> None:
    """One line per call: its start (``time.perf_counter`` seconds: CLOCK_MONOTONIC on Linux,
    the clock a probe added to the broker would read too) and its latency in ms, to line slow
    calls up with what the broker did meanwhile."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.writelines(f"{t:.6f} {d * 1e3:.3f}\n" for t, d in zip(starts, durations, strict=True))


async def latencies(
    call: Callable[[], Awaitable[Any]], seconds: float, trace: str | None = None
) -> dict[str, float]:
    for _ in range(WARM_UP):
        await call()
    out: list[float] = []
    starts: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
        starts.append(t0)
    if trace is not None:
        write_trace(trace, starts, out)
    q = statistics.quantiles(out, n=100)
    return {"p50": q[49] * 1e3, "p99": q[98] * 1e3, "n": len(out)}


async def prefill_load(channel: grpc.aio.Channel) -> Any:
    """One prefill server with a long queue, so Demand holds for every Admit."""
    call = lease_pb2_grpc.LeaseServiceStub(channel).Connect()
    hello = lease_pb2.Hello(node_id="bench-prefill", role=common_pb2.NODE_ROLE_PREFILL)
    await call.write(lease_pb2.ConnectRequest(hello=hello))
    await call.read()
    load = common_pb2.PoolLoad(
        node_id="bench-prefill",
        outstanding_uncached_tokens=500_000,
        processing_rate_tps=20_000.0,
        ttl_ms=600_000,
    )
    await call.write(lease_pb2.ConnectRequest(pool_load=load))
    await call.write(lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat()))
    await call.read()
    return call


async def ingest_floor(args: argparse.Namespace, nodes: int) -> tuple[float, float]:
    """Acks per second, and per server CPU second, of the no-op LeaseService with ``nodes``
    fleet streams pumping as in the broker's run."""
    server = await child(*pinned(args, broker=True), sys.executable, THIS_FILE, "--no-op-server")
    fleet_proc = None
    try:
        addr = (await expect(server, "listening on", 60))[-1]
        fleet_proc = await child(
            *pinned(args),
            sys.executable,
            THIS_FILE,
            "--fleet",
            addr,
            "--nodes",
            str(nodes),
            "--prefix",
            "f",
        )
        await expect(fleet_proc, "ready", 900)
        assert fleet_proc.stdin is not None
        fleet_proc.stdin.write(f"ingest {args.seconds}\n".encode())
        before = cpu_s(server.pid)
        accepted, _, elapsed, _, _ = await expect(fleet_proc, "ingest", 120 + args.seconds)
        used = cpu_s(server.pid) - before
        return int(accepted) / float(elapsed), int(accepted) / used
    finally:
        for proc in (fleet_proc, server):
            if proc is not None and proc.returncode is None:
                proc.terminate()
                await proc.wait()


async def one_size(args: argparse.Namespace, nodes: int, r: Any) -> dict[str, float]:
    namespace = f"bench-scale-{uuid.uuid4().hex[:8]}"
    broker, addr = await start_broker(args, namespace)
    fleet_proc = None
    try:
        fleet_proc = await child(
            *pinned(args),
            sys.executable,
            THIS_FILE,
            "--fleet",
            addr,
            "--nodes",
            str(nodes),
            "--prefix",
            "d",
        )
        opened = await expect(fleet_proc, "ready", 900)
        opened_s, open_retries = float(opened[0]), int(opened[1])
        channel = grpc.aio.insecure_channel(addr)
        prefill = await prefill_load(channel)
        health = health_pb2_grpc.HealthStub(channel)
        admission = admission_pb2_grpc.AdmissionServiceStub(channel)
        req = admission_pb2.AdmitRequest(uncached_prompt_tokens=2_000, expected_output_tokens=100)
        admits = {"borrowed": 0}

        async def admit() -> None:
            answer = await admission.Admit(req)
            admits["borrowed"] += answer.decision == admission_pb2.DECISION_BORROW

        idle = cpu_s(broker.pid), time.perf_counter()
        redis_floor = await latencies(r.ping, args.seconds)  # the broker idles meanwhile
        idle_cpu = (cpu_s(broker.pid) - idle[0]) / (time.perf_counter() - idle[1])
        grpc_floor = await latencies(
            lambda: health.Check(health_pb2.HealthCheckRequest()), args.seconds
        )
        before = cpu_s(broker.pid), time.perf_counter()
        trace = f"{args.trace}/admit-{nodes}.txt" if args.trace else None
        admit_lat = await latencies(admit, args.seconds, trace)
        admit_s = time.perf_counter() - before[1]
        admit_cpu = cpu_s(broker.pid) - before[0] - idle_cpu * admit_s
        listing = await r.client_list()
        conns = sum(1 for c in listing if c.get("name") == f"crossflow:{namespace}")
        assert fleet_proc.stdin is not None
        fleet_proc.stdin.write(f"ingest {args.seconds}\n".encode())
        cpu_before = cpu_s(broker.pid), cpu_s(fleet_proc.pid), await redis_cpu_s(args, r)
        accepted, refused, elapsed, ended, beats = await expect(
            fleet_proc, "ingest", 120 + args.seconds
        )
        broker_cpu = (cpu_s(broker.pid) - cpu_before[0]) / float(elapsed)
        fleet_cpu = (cpu_s(fleet_proc.pid) - cpu_before[1]) / float(elapsed)
        redis_cpu = (await redis_cpu_s(args, r) - cpu_before[2]) / float(elapsed)
        fleet_proc.stdin.write(b"notices\n")
        (notices,) = await expect(fleet_proc, "notices", 60)
        prefill.cancel()
        await channel.close()
        floor_per_s, floor_per_cpu_s = await ingest_floor(args, nodes)
        return {
            "nodes": nodes,
            "open_s": opened_s,
            "open_retries": open_retries,
            "redis_p50": redis_floor["p50"],
            "redis_p99": redis_floor["p99"],
            "grpc_p50": grpc_floor["p50"],
            "grpc_p99": grpc_floor["p99"],
            "admit_p50": admit_lat["p50"],
            "admit_p99": admit_lat["p99"],
            "admit_n": admit_lat["n"],
            "idle_cpu": idle_cpu,
            "admit_cpu_ms": admit_cpu * 1e3 / (admit_lat["n"] + WARM_UP),
            "borrowed_share": admits["borrowed"] / max(1, admit_lat["n"] + WARM_UP),
            "ingest_per_s": int(accepted) / float(elapsed),
            "refused": int(refused),
            "ended": int(ended),
            "notices": int(notices),
            "conns": conns,
            "broker_cpu": broker_cpu,
            "broker_us_per_lease": broker_cpu * 1e6 / max(1.0, int(accepted) / float(elapsed)),
            "redis_us_per_lease": redis_cpu * 1e6 / max(1.0, int(accepted) / float(elapsed)),
            "beats_per_lease": int(beats) / max(1, int(accepted)),
            "fleet_cpu": fleet_cpu,
            "floor_per_s": floor_per_s,
            "floor_per_cpu_s": floor_per_cpu_s,
        }
    finally:
        for proc in (fleet_proc, broker):
            if proc is not None and proc.returncode is None:
                proc.terminate()
                await proc.wait()
        keys = [k async for k in r.scan_iter(match=f"{namespace}*", count=1000)]
        for i in range(0, len(keys), 500):
            for key in keys[i : i + 500]:
                await r.delete(key)  # one by one: keys live in many slots on a Cluster


async def main(args: argparse.Namespace) -> None:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sizes = [int(n) for n in args.nodes.split(",")]
    redis_proc = None
    if args.redis_url is None:
        redis_proc = await start_redis(args)
    try:
        await measure(args, sizes)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            await redis_proc.wait()


async def measure(args: argparse.Namespace, sizes: list[int]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * max(sizes) // STREAMS_PER_CHANNEL + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, 4096)), hard))
    if args.cluster:
        r: Any = aioredis.RedisCluster.from_url(args.redis_url)
    else:
        r = aioredis.Redis.from_url(args.redis_url)
    print(
        f"scale: one broker process on {'Redis Cluster' if args.cluster else 'Redis'} "
        f"{args.redis_url}, {args.seconds:g} s per figure, {os.cpu_count()} CPUs"
    )
    head = (
        f"{'nodes':>6} {'open s':>7} {'redis p50/p99 ms':>17} {'grpc p50/p99 ms':>16} "
        f"{'admit p50/p99 ms':>17} {'borrowed':>8} {'ingest/s':>9} {'cpu b/f':>9} "
        f"{'us/lease':>8} {'floor us':>8} {'redis us':>8} {'floor/s':>8} {'notices':>8} "
        f"{'conns':>5}"
    )
    print(head)
    rows = []
    try:
        for n in sizes:
            row = await one_size(args, n, r)
            rows.append(row)
            print(
                f"{n:>6} {row['open_s']:>7.1f} "
                f"{row['redis_p50']:>8.2f}/{row['redis_p99']:<8.2f} "
                f"{row['grpc_p50']:>7.2f}/{row['grpc_p99']:<8.2f} "
                f"{row['admit_p50']:>8.2f}/{row['admit_p99']:<8.2f} "
                f"{row['borrowed_share']:>8.0%} {row['ingest_per_s']:>9.0f} "
                f"{row['broker_cpu']:>4.2f}/{row['fleet_cpu']:<4.2f} "
                f"{row['broker_us_per_lease']:>8.1f} {1e6 / row['floor_per_cpu_s']:>8.1f} "
                f"{row['redis_us_per_lease']:>8.1f} {row['floor_per_s']:>8.0f} "
                f"{row['notices']:>8} {row['conns']:>5}",
                flush=True,
            )
    finally:
        await r.aclose()
    first, last = rows[0], rows[-1]
    print(
        f"admit p99 at {last['nodes']} nodes / at {first['nodes']} nodes: "
        f"{last['admit_p99'] / first['admit_p99']:.2f}x (target <= 1.5x); "
        f"p50 {last['admit_p50'] / first['admit_p50']:.2f}x"
    )
    print(
        "broker CPU per Admit, over its CPU when idle (background renewals included): "
        + ", ".join(f"{r['admit_cpu_ms']:.3f} ms at {r['nodes']}" for r in rows)
        + "; idle: "
        + ", ".join(f"{r['idle_cpu']:.3f} CPU s/s at {r['nodes']}" for r in rows)
    )
    print(
        f"admit p50 over its floors at {last['nodes']} nodes: "
        f"{last['admit_p50'] / last['grpc_p50']:.1f}x grpc, "
        f"{last['admit_p50'] / last['redis_p50']:.1f}x redis"
    )
    print(
        f"lease ingest at {last['nodes']} nodes: {last['ingest_per_s']:.0f} leases/s "
        f"(target >= 10,000), {last['ingest_per_s'] / last['broker_cpu']:.0f} per broker CPU "
        f"second; floor (no-op LeaseService, same fleet): {last['floor_per_s']:.0f} acks/s, "
        f"{last['floor_per_cpu_s']:.0f} per server CPU second"
    )
    print(
        "broker CPU per accepted lease: "
        + ", ".join(f"{r['broker_us_per_lease']:.1f} us at {r['nodes']}" for r in rows)
        + "; floor (no-op LeaseService) per ack: "
        + ", ".join(f"{1e6 / r['floor_per_cpu_s']:.1f} us at {r['nodes']}" for r in rows)
    )
    print(
        f"stale or refused: {sum(r['refused'] for r in rows)}; streams the broker "
        f"ended (store unavailable): {', '.join(str(r['ended']) for r in rows)}; "
        f"broker Redis connections: {', '.join(str(r['conns']) for r in rows)}; "
        f"Hellos retried while opening: {', '.join(str(r['open_retries']) for r in rows)}"
    )
    print(
        "broker CPU per lease over the refusal-only no-op floor (same fleet, same run): "
        + ", ".join(
            f"{r['broker_us_per_lease'] * r['floor_per_cpu_s'] / 1e6:.2f}x at {r['nodes']}"
            for r in rows
        )
        + " (target <= 1.3x); Redis CPU per lease: "
        + ", ".join(f"{r['redis_us_per_lease']:.1f} us at {r['nodes']}" for r in rows)
        + f" ({'its own process' if args.redis_pid else 'INFO: the whole shared server'}); "
        + f"heartbeats per lease: {last['beats_per_lease']:.2f}"
    )
    rates = {}
    for rps in (0.0, 2.0, 10.0):
        before = await steady_node(0, rps, args.steady_periods)
        after = await steady_node(DEFAULT_BITS, rps, args.steady_periods)
        rates[rps] = (before, after)
    print(
        "lease messages per node per second, before (every period) -> after (deadband "
        f"{DEFAULT_BITS} bits), real Agent on a synthetic engine, {args.steady_periods} "
        "periods: "
        + "; ".join(
            f"{'steady (idle)' if rps == 0 else f'{rps:g} req/s'} {b:.2f} -> {a:.2f} "
            f"({b / a:.2f}x down)"
            for rps, (b, a) in rates.items()
        )
        + " (target >= 3x for a steady node)"
    )
    steady = rates[0.0][1]
    beats = min(steady, last["beats_per_lease"] * steady)
    per_node = steady + beats
    n = args.fleet_nodes
    broker_cores = n * steady * last["broker_us_per_lease"] / 1e6
    redis_cores = n * steady * last["redis_us_per_lease"] / 1e6
    print(
        f"a fleet of {n:,} steady nodes at the default period: {n * steady:,.0f} leases/s "
        f"(+ {n * beats:,.0f} heartbeats/s, {per_node:.2f} messages per node per second, "
        f"heartbeats costed inside us/lease at {last['beats_per_lease']:.2f} per lease) need "
        f"{broker_cores:.2f} broker cores (target <= 2) and {redis_cores:.2f} Redis cores "
        f"(target <= 0.5), at the CPU per lease measured at {last['nodes']} streams; before "
        f"the deadband ({rates[0.0][0]:.2f} leases per node per second): "
        f"{n * rates[0.0][0] * last['broker_us_per_lease'] / 1e6:.2f} broker cores"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="8,512,4096", help="comma-separated stream counts")
    parser.add_argument(
        "--redis-url", help="a Redis to use (default: a private redis-server, its CPU measured)"
    )
    parser.add_argument("--no-pin", action="store_true", help="no taskset for the children")
    parser.add_argument(
        "--steady-periods", type=int, default=300, help="agent periods per steady-node figure"
    )
    parser.add_argument("--fleet-nodes", type=int, default=5_000, help="the fleet to size")
    parser.add_argument("--cluster", action="store_true", help="--redis-url is a Cluster node")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument(
        "--trace", help="a folder: write each Admit's start (perf_counter s) and ms per size"
    )
    parser.add_argument("--fleet", help=argparse.SUPPRESS)
    parser.add_argument("--no-op-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="d", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    cli.redis_pid = 0
    if cli.no_op_server:
        asyncio.run(no_op_server())
    elif cli.fleet:
        asyncio.run(fleet(cli.fleet, int(cli.nodes), cli.prefix))
    else:
        asyncio.run(main(cli))
