"""What the gateway costs a request, beside floors measured in the same run.

    python benchmarks/gateway.py [--requests 400] [--concurrency 16] [--prompt-words 64]

Starts, as separate processes on loopback: one prefill and one decode fake engine speaking
vLLM's P/D protocol (their step times scaled down so the engines answer at once), a broker
with the embedded store, and two gateways (one asking that broker, one static). Then sends
the same unstreamed requests (``max_tokens`` 1) to each target from this process:

* ``direct decode``: the decode engine, one hop (the floor of a borrowed request);
* ``direct 2-hop``: this client running vLLM's two hops itself (the floor of the normal path:
  what any P/D proxy must do);
* ``gateway static``: the gateway with no broker (tokenize + two hops);
* ``gateway + broker``: the gateway asking Admit for each request (tokenize + Admit + hops;
  no decode node leases here, so every answer is NORMAL after a real Admit round trip).

Prints latency p50/p99 and requests/s per target, and the gateway's overhead over its floor.
On a 2-core machine the client, the gateway and the engines share the cores: compare within
one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from crossflow_ctl.demo.processes import Children, executable

SLOWDOWN = 0.01
"""The engines' step-time multiplier: near-instant engines, so what is measured is HTTP and the
gateway, not a model."""


async def start(children: Children) -> dict[str, str]:
    engines = {}
    for role in ("prefill", "decode"):
        child = await children.spawn(
            f"{role}-1",
            [executable("crossflow-agent"), "fake-engine", "--port", "0", "--protocol", "vllm",
             "--pd-role", role],
            "fake engine serving ", 60,
        )  # fmt: skip
        engines[role] = child.address.removesuffix("/metrics")
    broker = await children.spawn(
        "broker",
        [executable("crossflow-broker"), "serve", "--embedded-store", "--listen", "127.0.0.1:0"],
        "listening on ", 60,
    )  # fmt: skip
    urls = {"direct decode": engines["decode"], "prefill": engines["prefill"]}
    for name, extra in (("gateway static", ["--no-broker"]),
                        ("gateway + broker", ["--broker", broker.address])):  # fmt: skip
        gw = await children.spawn(
            name.replace(" ", "-").replace("+", "with"),
            [executable("crossflow-gateway"), "serve", "--listen", "127.0.0.1:0",
             "--prefill", f"prefill-1={engines['prefill']}",
             "--decode", f"decode-1={engines['decode']}", *extra],
            "listening on ", 60,
        )  # fmt: skip
        urls[name] = f"http://{gw.address}"
    async with aiohttp.ClientSession() as s:
        for url in (engines["prefill"], engines["decode"]):
            async with s.post(f"{url}/control", json={"slowdown": SLOWDOWN}) as resp:
                resp.raise_for_status()
    return urls


async def one(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with s.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        await resp.read()
    return time.perf_counter() - t0


async def two_hops(
    s: aiohttp.ClientSession, prefill: str, decode: str, body: dict[str, Any]
) -> float:
    t0 = time.perf_counter()
    first = {**body, "max_tokens": 1, "stream": False,
             "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    async with s.post(f"{prefill}/v1/completions", json=first) as resp:
        resp.raise_for_status()
        params = (await resp.json())["kv_transfer_params"]
    async with s.post(
        f"{decode}/v1/completions", json={**body, "kv_transfer_params": params}
    ) as resp:
        resp.raise_for_status()
        await resp.read()
    return time.perf_counter() - t0


async def load(run: Any, requests: int, concurrency: int) -> tuple[list[float], float]:
    gate = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> float:
        async with gate:
            return float(await run(i))

    t0 = time.perf_counter()
    lat = await asyncio.gather(*(guarded(i) for i in range(requests)))
    return list(lat), time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as logs:
        children = Children(Path(logs))
        try:
            urls = await start(children)
            return await measure(urls, args)
        finally:
            await children.stop()


async def measure(urls: dict[str, str], args: argparse.Namespace) -> int:
    words = " ".join(f"w{i}" for i in range(args.prompt_words))

    def body(i: int) -> dict[str, Any]:
        return {"model": "fake-model", "prompt": f"r{i} {words}", "max_tokens": 1}

    targets: dict[str, Any] = {
        "direct decode": lambda s, i: one(s, urls["direct decode"], body(i)),
        "direct 2-hop": lambda s, i: two_hops(s, urls["prefill"], urls["direct decode"], body(i)),
        "gateway static": lambda s, i: one(s, urls["gateway static"], body(i)),
        "gateway + broker": lambda s, i: one(s, urls["gateway + broker"], body(i)),
    }
    results: dict[str, tuple[list[float], float]] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        for name, run in targets.items():  # warm-up, then the measured run
            await load(lambda i, run=run: run(s, i), min(50, args.requests), args.concurrency)
            results[name] = await load(
                lambda i, run=run: run(s, i), args.requests, args.concurrency
            )
    print(f"{args.requests} requests, concurrency {args.concurrency}, prompt {args.prompt_words} "
          f"words, max_tokens 1, engines at slowdown {SLOWDOWN}")  # fmt: skip
    print(f"{'target':<18} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for name, (lat, wall) in results.items():
        print(
            f"{name:<18} {pct(lat, 50) * 1e3:8.2f} {pct(lat, 99) * 1e3:8.2f} {len(lat) / wall:8.0f}"
        )
    for gw, floor in (("gateway static", "direct 2-hop"), ("gateway + broker", "direct 2-hop")):
        (g, gw_wall), (f, f_wall) = results[gw], results[floor]
        print(f"{gw} over {floor}: p50 {(pct(g, 50)-pct(f, 50))*1e3:+.2f} ms, "
              f"p99 {(pct(g, 99)-pct(f, 99))*1e3:+.2f} ms, "
              f"req/s {len(g)/gw_wall:.0f} vs {len(f)/f_wall:.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=64)
    sys.exit(asyncio.run(main(parser.parse_args())))
