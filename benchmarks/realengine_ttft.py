"""TTFT with leases against static P/D, on real vLLM engines, driven by a real load tool.

Issue 27. The vLLM CPU harness (docs/real-engines.md): 1 prefill + 2 decode engines, NixlConnector
``kv_both`` as ``crossflow demo --engine vllm`` starts them, one ``crossflow-agent`` per engine
and a broker. The same request set goes through ``crossflow-gateway`` twice per round: asking the
broker (leases: a prompt may be borrowed by a decode engine) and static (``--no-broker``: every
prompt takes vLLM's two hops). The rounds alternate the order (static first, then leases first)
so a drift of the shared machine's load does not favour one side.

The load tool is guidellm (``bash scripts/install_guidellm.sh``: its own venv, pinned), run as
``guidellm run`` (its 0.8 CLI) against the gateway with synthetic prompts of ``--prompt-tokens``
tokens (the tiny Llama's own tokenizer, from its local folder: nothing is downloaded), a fixed
seed (the same prompts for both sides), at a constant ``--rate`` for ``--requests`` requests.
TTFT mean and p99 are guidellm's own, from its JSON report. ``--client openai`` sends the same
kind of load with the openai SDK instead (streamed; TTFT to the first content chunk).

Printed: per side and round, requests answered / errored / incomplete, TTFT mean and p99, and
the borrowed share (the gateway's ``crossflow_gateway_requests_total``), then the reservations
the broker still holds open after the leases runs (HELD or COMMITTED) and the gateway's
``crossflow_gateway_reservations_open``: both should be 0. ``os.getloadavg()`` beside each run:
the machine is shared, and on 2 cores a neighbour's build moves TTFT more than a lease does.

    bash scripts/install_guidellm.sh
    python benchmarks/realengine_ttft.py --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from crossflow_ctl.client import AdminClient
from crossflow_ctl.demo import vllm_engines
from crossflow_ctl.demo.cluster import Cluster, ClusterSpec
from crossflow_ctl.demo.processes import Children
from crossflow_ctl.demo.scrape import parse, total
from crossflow_ctl.domain.models import ReservationState

REPO = Path(__file__).resolve().parents[1]
GUIDELLM = REPO / ".venv-guidellm" / "bin" / "guidellm"
REQUESTS = "crossflow_gateway_requests_total"


@dataclass
class Result:
    side: str
    round: int
    ok: int
    errored: int
    incomplete: int
    ttft_mean_ms: float
    ttft_p99_ms: float
    borrowed: int
    answered: int
    load1: float
    wall_s: float


def counter(text: str, name: str, **labels: str) -> float:
    """``name``'s samples in a /metrics text whose labels include ``labels``, summed."""
    return total(parse(text), name, **labels)


async def metrics(url: str) -> str:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as resp,
    ):
        return await resp.text()


def _stat(metric: dict[str, Any]) -> tuple[float, float]:
    """guidellm's (mean, p99) of a distribution summary of its successful requests."""
    summary = metric.get("successful", metric)
    percentiles = summary.get("percentiles", {})
    return float(summary["mean"]), float(percentiles.get("p99", float("nan")))


async def guidellm(
    url: str, args: argparse.Namespace, out: Path, log: Path
) -> tuple[int, int, int, float, float]:
    backend = (
        f"kind=openai_http,target={url},model={vllm_engines.SERVED_MODEL},"
        "request_format=/v1/completions"
    )
    data = (
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    )
    argv = [
        str(GUIDELLM), "run", "--backend", backend,
        "--profile", f"kind=constant,rate={args.rate:g}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--data", data,
        "--tokenizer", f"kind=huggingface_auto,model={vllm_engines.MODEL_CACHE}",
        "--seed", f"kind=static,value={args.seed}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=sink, stderr=asyncio.subprocess.STDOUT, env=env
        )
        code = await proc.wait()
    return _report(code, out, log)


def _report(code: int, out: Path, log: Path) -> tuple[int, int, int, float, float]:
    """guidellm's JSON report: requests successful, errored, incomplete; TTFT mean and p99."""
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"guidellm exited {code}:\n{tail}")
    report = json.loads(out.read_text())
    bench = report["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    mean, p99 = _stat(bench["metrics"]["time_to_first_token_ms"])
    # guidellm can end with a request still in flight (its max_requests constraint stops on
    # what it created): that one is in none of its totals, so count it as incomplete here.
    unfinished = int(bench["scheduler_state"].get("processing_requests", 0))
    ok, errored = int(totals["successful"]), int(totals["errored"])
    return ok, errored, int(totals["incomplete"]) + unfinished, mean, p99


async def openai_load(url: str, args: argparse.Namespace) -> tuple[int, int, int, float, float]:
    """The same kind of load with the openai SDK: seeded prompts, constant rate, streamed."""
    from openai import AsyncOpenAI

    rng = random.Random(args.seed)
    words = ["the", "list", "of", "items", "returns", "a", "new", "value", "when", "each"]
    prompts = [
        " ".join(rng.choice(words) for _ in range(int(args.prompt_tokens / 1.3)))
        for _ in range(args.requests)
    ]
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
    ttfts: list[float] = []
    failed = 0

    async def one(text: str) -> None:
        nonlocal failed
        start = time.perf_counter()
        try:
            stream = await client.completions.create(
                model=vllm_engines.SERVED_MODEL, prompt=text, max_tokens=args.output_tokens,
                stream=True,
            )  # fmt: skip
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - start
            if first is None:
                failed += 1
            else:
                ttfts.append(first * 1000)
        except Exception:  # counted as errored, as a load tool does
            failed += 1

    tasks = []
    for text in prompts:
        tasks.append(asyncio.create_task(one(text)))
        await asyncio.sleep(1.0 / args.rate)
    await asyncio.gather(*tasks)
    await client.close()
    ttfts.sort()
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan")
    return len(ttfts), failed, 0, statistics.fmean(ttfts) if ttfts else float("nan"), p99


async def one_run(
    cluster: Cluster, side: str, round_: int, args: argparse.Namespace, out_dir: Path
) -> Result:
    url = await cluster.start_gateway(broker=side == "leases")
    started = time.monotonic()
    try:
        if args.client == "guidellm":
            got = await guidellm(
                url, args, out_dir / f"{side}-{round_}.json", out_dir / f"guidellm-{side}.log"
            )
        else:
            got = await openai_load(url, args)
        text = await metrics(url)
    finally:
        await cluster.stop_gateway()
    ok, errored, incomplete, mean, p99 = got
    return Result(
        side, round_, ok, errored, incomplete, mean, p99,
        int(counter(text, REQUESTS, path="borrowed", code="200")),
        int(counter(text, REQUESTS, code="200")),
        os.getloadavg()[0], time.monotonic() - started,
    )  # fmt: skip


async def open_reservations(broker: str) -> int:
    async with AdminClient(broker) as admin:
        listed = await admin.list_reservations(None)
    return sum(r.state in (ReservationState.HELD, ReservationState.COMMITTED) for r in listed)


async def run(args: argparse.Namespace) -> int:
    if args.client == "guidellm" and not GUIDELLM.exists():
        print(f"no {GUIDELLM}: run `bash scripts/install_guidellm.sh` (or --client openai)")
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="crossflow-ttft-"))
    children = Children(log_dir)
    spec = ClusterSpec(
        prefill=1, decode=2, model=args.model, node=args.node, period_ms=1000, redis_url=None,
        namespace="ttft", port=0, max_hold_ms=0, engine="vllm", itl_slo_ms=args.slo_ms,
    )  # fmt: skip
    cluster = Cluster(spec, children)
    print(f"logs: {log_dir}; load average at start {os.getloadavg()}", flush=True)
    results: list[Result] = []
    leaked: list[int] = []
    try:
        t0 = time.monotonic()
        await cluster.start_engines()
        await cluster.start_broker()
        await cluster.start_agents()
        print(f"engines, broker and agents up in {time.monotonic() - t0:.0f} s", flush=True)
        await asyncio.sleep(args.settle_s)
        for round_ in range(1, args.rounds + 1):
            order = ("static", "leases") if round_ % 2 else ("leases", "static")
            for side in order:
                result = await one_run(cluster, side, round_, args, log_dir)
                results.append(result)
                if side == "leases":
                    leaked.append(await open_reservations(cluster.broker))
                print(_line(result), flush=True)
    finally:
        await children.stop()
    print(f"\n{_header()}")
    for r in results:
        print(_line(r))
    for side in ("static", "leases"):
        sel = [r for r in results if r.side == side]
        print(
            f"{side:<7} all rounds: TTFT mean "
            f"{statistics.fmean(r.ttft_mean_ms for r in sel):.0f} ms, p99 (worst round) "
            f"{max(r.ttft_p99_ms for r in sel):.0f} ms, answered "
            f"{sum(r.ok for r in sel)}, errored {sum(r.errored for r in sel)}, incomplete "
            f"{sum(r.incomplete for r in sel)}"
        )
    static = statistics.fmean(r.ttft_mean_ms for r in results if r.side == "static")
    leases = statistics.fmean(r.ttft_mean_ms for r in results if r.side == "leases")
    print(f"TTFT mean, leases / static: {leases / static:.2f}x (static P/D is the floor)")
    print(f"reservations open at the broker after each leases run: {leaked}")
    print(f"load average at the end {os.getloadavg()}")
    return 0


def _header() -> str:
    return (
        f"{'side':<7} {'round':>5} {'ok':>5} {'err':>4} {'inc':>4} {'TTFTmean':>9} "
        f"{'TTFTp99':>8} {'borrowed':>9} {'load1':>6} {'wall_s':>7}"
    )


def _line(r: Result) -> str:
    return (
        f"{r.side:<7} {r.round:>5} {r.ok:>5} {r.errored:>4} {r.incomplete:>4} "
        f"{r.ttft_mean_ms:>9.0f} {r.ttft_p99_ms:>8.0f} {r.borrowed:>4}/{r.answered:<4} "
        f"{r.load1:>6.1f} {r.wall_s:>7.0f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--client", choices=("guidellm", "openai"), default="guidellm")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=1.0, help="requests a second (constant)")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--model", default="llama-3.1-8b", help="the agents' prior (calibrated online)")
    p.add_argument("--node", default="h100")
    p.add_argument("--slo-ms", type=float, default=250.0, help="the decode agents' ITL SLO")
    p.add_argument("--settle-s", type=float, default=20.0)
    args = p.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
