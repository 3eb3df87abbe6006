"""CPU time the agent spends per period (scrape + lease) at 10 Hz, against a local fake engine.

    python benchmarks/agent_cpu.py [--iterations 100] [--hz 10]

Starts ``crossflow-agent fake-engine`` as its own process (its CPU is not counted) with a steady
background load, then runs the agent's per-period work at the given rate and reports this
process's CPU time (``time.process_time``) per iteration:

* floor: the HTTP GET of /metrics alone (httpx, keep-alive), measured in the same run;
* period: GET + Prometheus parse + SGLang read + lease rules + proto serialisation, which is
  what one agent tick does (the stream write itself is a queue put plus gRPC's send).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import httpx

from crossflow_agent.agent import lease_request
from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.lease_credits import CapacityBreakdown, LeaseSettings
from crossflow_ctl.domain.leasing import ItlGuard, decide


async def start_engine() -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "crossflow_agent",
        "fake-engine",
        "--port",
        "0",
        "--background-rps",
        "20",
        "--background-output-tokens",
        "2000",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    prefix = "fake engine serving "
    if not line.startswith(prefix):
        proc.kill()
        raise SystemExit(f"fake engine did not start: {line!r}")
    return proc, line[len(prefix) :].strip()


async def paced(
    n: int, hz: float, work: Callable[[], Awaitable[None]]
) -> tuple[float, list[float]]:
    """Run ``work`` n times at ``hz``; (process CPU seconds per iteration, wall per call)."""
    period = 1.0 / hz
    walls: list[float] = []
    cpu0 = time.process_time()
    next_at = time.monotonic()
    for _ in range(n):
        t0 = time.perf_counter()
        await work()
        walls.append(time.perf_counter() - t0)
        next_at += period
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    return (time.process_time() - cpu0) / n, walls


async def main(iterations: int, hz: float) -> None:
    engine, url = await start_engine()
    model, node = MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"]
    settings = LeaseSettings()
    clock = SystemClock()
    try:
        async with httpx.AsyncClient(timeout=1.0, trust_env=False) as http:
            await http.get(url)  # warm the connection

            async def fetch_only() -> None:
                (await http.get(url)).raise_for_status()

            source = PrometheusSource(url, SGLangReader(), client=http)
            guard = ItlGuard()
            capacity: CapacityBreakdown | None = None  # seeds the next period, as the agent's
            sizes: list[int] = []
            zero = 0

            async def period() -> None:
                nonlocal guard, capacity, zero
                snapshot = await source.scrape()
                decision = decide(
                    snapshot,
                    now_ms=clock.now_ms(),
                    model=model,
                    node=node,
                    settings=settings,
                    guard=guard,
                    previous=capacity,
                )
                guard, capacity = decision.guard, decision.capacity
                lease = decision.to_lease(
                    node_id="bench", epoch=1, version=len(sizes) + 1, ttl_ms=600, last_notice_seq=0
                )
                zero += lease.zero_reason is not None
                sizes.append(len(lease_request(lease).SerializeToString()))

            await period()
            floor_cpu, floor_wall = await paced(iterations, hz, fetch_only)
            cpu, wall = await paced(iterations, hz, period)
            body = len((await http.get(url)).content)
    finally:
        engine.terminate()
        await engine.wait()
    ms = 1000.0
    print(
        f"agent CPU per period at {hz:g} Hz over {iterations} iterations"
        f" (metrics body {body} bytes, lease message {statistics.median(sizes):.0f} bytes,"
        f" {zero} zero leases)"
    )
    print(
        f"  floor  (GET /metrics only):            {floor_cpu * ms:7.3f} ms CPU/iter,"
        f" wall p50 {statistics.median(floor_wall) * ms:6.3f} ms"
    )
    print(
        f"  period (scrape + parse + lease + pb):  {cpu * ms:7.3f} ms CPU/iter,"
        f" wall p50 {statistics.median(wall) * ms:6.3f} ms"
    )
    print(
        f"  over the floor: {(cpu - floor_cpu) * ms:.3f} ms;"
        f" share of one core at {hz:g} Hz: {cpu * hz * 100:.2f}%"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--hz", type=float, default=10.0)
    args = parser.parse_args()
    asyncio.run(main(args.iterations, args.hz))
