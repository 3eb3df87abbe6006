"""``crossflowctl sim`` (trace-driven simulation report) and ``crossflowctl plan`` (sizing)."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import click

from crossflow_ctl.client.holding import QueueConfig
from crossflow_ctl.domain.capacity import (
    MODEL_PRESETS,
    NODE_PRESETS,
    decode_kv_capacity_tokens,
    server_profile,
)
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.models import MAX_HORIZON_MS
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.sizing import (
    SizingPlan,
    plan_from_ratios,
    plan_sizing,
    recommend_split,
    rho_from_model,
)
from crossflow_ctl.sim.config import PolicyKind, SimConfig, parse_split
from crossflow_ctl.sim.metrics import RunRecord, summarize
from crossflow_ctl.sim.prefix_cache import CacheScope
from crossflow_ctl.sim.ratios import trace_ratios
from crossflow_ctl.sim.report import write_report
from crossflow_ctl.sim.saturation import saturating_load, saturation_lines
from crossflow_ctl.sim.sweep import (
    RunSpec,
    plan_runs,
    run_sweep,
    run_sweep_on_redis,
    sweep_failures,
)
from crossflow_ctl.sim.synthetic import AgenticSpec, generate_agentic
from crossflow_ctl.sim.traces import Trace, load_trace

FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def _floats(text: str, field: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument(
            f"{text!r} is not a comma-separated list of numbers", field=field
        ) from None
    if not values or any(v <= 0 for v in values):
        raise InvalidArgument("give positive numbers", field=field)
    return values


def _splits(text: str, flag: str) -> list[tuple[int, int]]:
    try:
        return [parse_split(x) for x in text.split(",") if x.strip()]
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message, field=flag) from None


def _policies(text: str) -> list[PolicyKind]:
    try:
        return [PolicyKind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument(
            f"policies are {[p.value for p in PolicyKind]}", field="--policies"
        ) from None


def _quiet_logs() -> None:
    """The broker domain class logs every grant at info; a simulation wants warnings only."""
    from crossflow_ctl.observability.logs import setup_logging

    setup_logging(json=False, level="warning")


@click.command("sim")
@click.option("--trace", "traces", multiple=True, type=FILE, help="Trace file (repeatable).")
@click.option("--synthetic", is_flag=True, help="Add the synthetic agentic generator.")
@click.option(
    "--synthetic-duration-s",
    type=click.FloatRange(min=1.0),
    default=3600.0,
    show_default=True,
    help="Trace seconds the synthetic generator covers.",
)
@click.option(
    "--load",
    "loads",
    default="1,4,16",
    show_default=True,
    help="Time compressions to run, comma-separated (4: four times the arrival rate); auto: "
    "per trace, the load at which the best static split falls 10% short of the offered input "
    "tokens/s, and 2x and 4x it.",
)
@click.option(
    "--splits",
    default="1P5D,2P4D,3P3D,4P2D,5P1D",
    show_default=True,
    help="Splits for the static policy.",
)
@click.option(
    "--borrow-splits",
    default="2P4D,4P2D",
    show_default=True,
    help="Splits for the threshold and leases policies.",
)
@click.option(
    "--policies",
    default="static,threshold,leases",
    show_default=True,
    help="Policies to run, comma-separated.",
)
@click.option(
    "--warmup-s",
    type=click.FloatRange(min=0.0),
    default=300.0,
    show_default=True,
    help="Trace seconds not measured (0 for a short --limit run).",
)
@click.option(
    "--limit", type=click.IntRange(min=1), help="Only the first N requests of each trace."
)
@click.option(
    "--model", type=click.Choice(sorted(MODEL_PRESETS)), default="gpt-oss-120b", show_default=True
)
@click.option(
    "--hardware", type=click.Choice(sorted(NODE_PRESETS)), default="h200", show_default=True
)
@click.option(
    "--gpus-per-server",
    type=click.IntRange(1, 72),
    default=1,
    show_default=True,
    help="GPUs of --hardware in each prefill and decode server, one model replica across them "
    "(glm-5.2's 744 GB of weights need 4 GB300s).",
)
@click.option(
    "--kv-capacity-tokens",
    default="auto",
    show_default=True,
    help="KV cache of each decode server, in tokens; auto: sized from the hardware's HBM and "
    "the model (weights, a 10% reserve, sliding-window layers; docs/capacity.md).",
)
@click.option(
    "--itl-slo-ms",
    type=click.FloatRange(0.0, 10_000.0, min_open=True),
    default=50.0,
    show_default=True,
    help="Agents' ITL SLO.",
)
@click.option(
    "--horizon-ms",
    type=click.IntRange(1, MAX_HORIZON_MS),
    default=PolicySettings().borrow_horizon_ms,
    show_default=True,
    help="Borrow horizon (the broker's and the agents').",
)
@click.option(
    "--borrow-share",
    type=click.FloatRange(0.0, 1.0),
    default=0.5,
    show_default=True,
    help="Cluster-wide borrow limit on compute, output and slots.",
)
@click.option(
    "--borrow-kv-share",
    type=click.FloatRange(0.0, 1.0),
    default=PolicySettings().borrow_kv_share,
    show_default=True,
    help="Cluster-wide borrow limit on the KV credits (kv, kv_transfer).",
)
@click.option(
    "--late-binding/--no-late-binding",
    default=True,
    show_default=True,
    help="Leases: the router holds prompts that found no room and re-offers them.",
)
@click.option(
    "--max-hold-ms",
    type=click.IntRange(0, 600_000),
    default=SimConfig().queue.max_hold_ms,
    show_default=True,
    help="Late binding: longest a prompt is held before it goes to prefill (a safety net: a "
    "held prompt goes to prefill as soon as prefill has room).",
)
@click.option(
    "--fresh-first-ms",
    type=click.IntRange(0, 600_000),
    default=QueueConfig().fresh_first_ms,
    show_default=True,
    help="Late binding: once the oldest held prompt has waited this long, room goes first to "
    "prompts held less than this (adaptive LIFO; 0: always queue order).",
)
@click.option(
    "--fresh-order",
    type=click.Choice(["smallest", "newest"]),
    default=QueueConfig().fresh_order,
    show_default=True,
    help="Late binding: order of the fresh prompts when the queue is behind.",
)
@click.option(
    "--prefill-room-ms",
    type=click.FloatRange(0.0, 600_000.0),
    default=2000.0,
    show_default=True,
    help="Late binding: a held prompt goes to prefill once the pool's wait is at most this.",
)
@click.option(
    "--cache-scope",
    type=click.Choice([c.value for c in CacheScope]),
    default="cluster",
    show_default=True,
    help="Prefix cache shared by the cluster, or one per node.",
)
@click.option(
    "--session-rate",
    type=click.FloatRange(0.0, min_open=True),
    help="Top-level sessions per second (session traces).",
)
@click.option("--seed", default=0, show_default=True, help="Seed of generators and sampling.")
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=min(2, os.cpu_count() or 1),
    show_default=True,
    help="Runs simulated in parallel (processes).",
)
@click.option(
    "--redis", "redis_url", metavar="URL", help="Run on a RedisStore at this URL (one job)."
)
@click.option(
    "--check/--no-check",
    default=True,
    show_default=True,
    help="Exit 1 when a leases run breaks the ITL SLO, over-commits, or is worse than static "
    "on its own split in mean TTFT or drain-inclusive tokens/s (the report is written first).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder (default ./reports/sim-<UTC time>).",
)
def sim(
    traces: Sequence[Path],
    synthetic: bool,
    synthetic_duration_s: float,
    loads: str,
    splits: str,
    borrow_splits: str,
    policies: str,
    warmup_s: float,
    limit: int | None,
    model: str,
    hardware: str,
    gpus_per_server: int,
    kv_capacity_tokens: str,
    itl_slo_ms: float,
    horizon_ms: int,
    borrow_share: float,
    borrow_kv_share: float,
    late_binding: bool,
    max_hold_ms: int,
    fresh_first_ms: int,
    fresh_order: Literal["smallest", "newest"],
    prefill_room_ms: float,
    cache_scope: str,
    session_rate: float | None,
    seed: int,
    jobs: int,
    redis_url: str | None,
    check: bool,
    out: Path | None,
) -> None:
    """Replay traces through a simulated P/D cluster; write a markdown report with plots."""
    if not traces and not synthetic:
        raise click.UsageError("give --trace FILE and/or --synthetic")
    _quiet_logs()
    # the flags first: a typo is refused before a large trace is read
    auto = loads.strip().lower() == "auto"
    scales = [] if auto else _floats(loads, "--load")
    split_list, borrow_list = _splits(splits, "--splits"), _splits(borrow_splits, "--borrow-splits")
    policy_list = _policies(policies)
    kv_tokens = _kv_tokens(kv_capacity_tokens, model, hardware, gpus_per_server)
    loaded: list[Trace] = []
    for path in traces:
        try:
            trace = load_trace(path, limit=limit, seed=seed)
            if session_rate is not None and trace.closed_loop:
                from crossflow_ctl.sim.traces import load_sessions

                trace = load_sessions(path, session_rate_per_s=session_rate, seed=seed, limit=limit)
        except InvalidArgument as exc:  # it named the trace's own field ("json: ...")
            raise InvalidArgument(exc.message, field="--trace") from None
        loaded.append(trace.with_warmup(warmup_s))
    if synthetic:
        spec = AgenticSpec(duration_s=synthetic_duration_s)
        trace = generate_agentic(spec, seed=seed)
        if limit is not None:
            trace = trace.head(limit)
        loaded.append(trace.with_warmup(warmup_s))
    policy = PolicySettings(
        borrow_share=borrow_share,
        borrow_kv_share=borrow_kv_share,
        borrow_horizon_ms=horizon_ms,
        commit_ttl_ms=max(30_000, 2 * horizon_ms),
    )
    base = SimConfig(
        model=model,
        hardware=hardware,
        gpus_per_server=gpus_per_server,
        kv_capacity_tokens=kv_tokens,
        cache_scope=CacheScope(cache_scope),
        seed=seed,
        lease=LeaseSettings(itl_slo_ms=itl_slo_ms, horizon_ms=horizon_ms),
        broker_policy=policy,
        late_binding=late_binding,
        queue=QueueConfig(
            max_hold_ms=max_hold_ms,
            max_held=SimConfig().queue.max_held,
            fresh_first_ms=fresh_first_ms or None,
            fresh_order=fresh_order,
        ),
        prefill_room_ms=prefill_room_ms,
    )
    notes: list[str] = []
    if auto:
        runs = _auto_runs(loaded, base, split_list, borrow_list, policy_list, jobs, notes)
    else:
        runs = plan_runs(loaded, scales, base, split_list, borrow_list, policy_list)
    out_dir = out or Path("reports") / datetime.now(UTC).strftime("sim-%Y%m%d-%H%M%S")
    started = time.perf_counter()
    total = sum(len(r.trace.requests) for r in runs)
    click.echo(f"{len(runs)} runs, {total:,} simulated requests, {jobs} job(s)", err=True)
    with click.progressbar(length=total, label="simulating", file=sys.stderr) as bar:

        def done(rec: RunRecord) -> None:
            bar.update(next(len(r.trace.requests) for r in runs if r.trace.name == rec.trace))

        if redis_url:
            records = asyncio.run(run_sweep_on_redis(runs, redis_url, done))
        else:
            records = run_sweep(runs, jobs=jobs, on_done=done)
    wall = time.perf_counter() - started
    _check_measured(records, warmup_s)
    command = "crossflowctl " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    path = write_report(out_dir, records, base, command=command, show_wall=True, notes=notes)
    for s in (summarize(r) for r in records):
        click.echo(
            f"{s.trace} {s.scale:g}x {s.label}: TTFT mean {s.ttft_mean_ms:.0f} ms, "
            f"out {s.output_tps:.0f} tok/s (steady {s.steady_output_tps:.0f}), "
            f"borrowed {s.borrowed_share * 100:.1f} %, "
            f"over-commit {s.overcommits}"
        )
    click.echo(f"report: {path} ({len(runs)} runs in {wall:.1f} s)")
    failures = sweep_failures([summarize(r) for r in records], itl_slo_ms)
    if failures and check:
        raise click.ClickException(
            f"{len(failures)} sweep check(s) failed (see the report's Checks):\n"
            + "\n".join(failures)
        )


def _auto_runs(
    traces: Sequence[Trace],
    base: SimConfig,
    splits: Sequence[tuple[int, int]],
    borrow_splits: Sequence[tuple[int, int]],
    policies: Sequence[PolicyKind],
    jobs: int,
    notes: list[str],
) -> list[RunSpec]:
    """``--load auto``: per trace, its saturating load and 2x and 4x it (how each was found is
    added to ``notes`` and echoed)."""
    runs: list[RunSpec] = []
    for trace in traces:
        found, probes = saturating_load(trace, base, splits, jobs=jobs)
        lines = saturation_lines(trace.name, found, probes)
        notes += lines
        click.echo(lines[-2], err=True)
        loads = [found, 2 * found, 4 * found]
        runs += plan_runs([trace], loads, base, splits, borrow_splits, policies)
    return runs


def _kv_tokens(text: str, model: str, hardware: str, gpus: int) -> int:
    """``--kv-capacity-tokens``: a count, or ``auto`` (sized from the hardware and the model)."""
    if text.strip().lower() == "auto":
        node = server_profile(NODE_PRESETS[hardware], gpus)
        tokens = decode_kv_capacity_tokens(MODEL_PRESETS[model], node, SimConfig().max_batch)
        if tokens <= 0:
            raise InvalidArgument(
                f"{model}'s weights leave no KV room on a server of {gpus} {hardware}: give a"
                " count or more --gpus-per-server",
                field="--kv-capacity-tokens",
            )
        return tokens
    try:
        tokens = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise InvalidArgument("give a token count or auto", field="--kv-capacity-tokens") from None
    if not 1 <= tokens <= 1_000_000_000:
        raise InvalidArgument("give 1 to 1,000,000,000 tokens", field="--kv-capacity-tokens")
    return tokens


def _check_measured(records: Sequence[RunRecord], warmup_s: float) -> None:
    """Refuse a sweep in which a run measured nothing: every request of its trace arrived within
    the warm-up, so the report would compare empty runs (``--limit`` with the default
    ``--warmup-s``)."""
    empty = sorted({r.trace for r in records if r.measured == 0})
    if empty:
        raise InvalidArgument(
            f"no request of {', '.join(empty)} arrives after the warm-up ({warmup_s:g} trace "
            "seconds), so nothing was measured: lower --warmup-s (0 measures every request) "
            "or raise --limit",
            field="--warmup-s",
        )


# -- plan ------------------------------------------------------------------------------------


def _p(x: float) -> str:
    return f"{x * 100:.1f}"


def format_plan(plan: SizingPlan, fleet: int) -> list[str]:
    advice = recommend_split(plan, fleet)
    covered = "covered" if plan.leases_cover_peak else "NOT covered: leases cannot carry the peak"
    return [
        f"rho                         = {plan.rho:.4g}",
        f"R p5 / p50 / p95            = {plan.r_p5:.1f} / {plan.r_p50:.1f} / {plan.r_p95:.1f}",
        f"f = rho R / (1 + rho R)     = {_p(plan.f_p5)} / {_p(plan.f_p50)} / {_p(plan.f_p95)} %",
        f"static purchase             = {_p(plan.static_purchase)} %"
        f"  (prefill at f(p95) {_p(plan.f_p95)} % + decode at 1 - f(p5) {_p(1 - plan.f_p5)} %)",
        f"leased purchase             = {_p(plan.leased_purchase)} %"
        f"  (prefill at f(p50) {_p(plan.f_p50)} % + decode at 1 - f(p5) {_p(1 - plan.f_p5)} %)",
        f"idle points                 = {_p(plan.static_idle_points)} -> "
        f"{_p(plan.leased_idle_points)} points",
        f"stranded capacity           = {_p(plan.static_stranded)} -> "
        f"{_p(plan.leased_stranded)} % of what is bought",
        f"at the prefill peak         : prefill short {_p(plan.borrow_need_points)} points, "
        f"decode free {_p(plan.decode_free_points)} points ({covered})",
        f"recommended split ({fleet} nodes): static "
        f"{advice.label(advice.static_prefill_nodes)}, with leases "
        f"{advice.label(advice.leased_prefill_nodes)}",
    ]


PLAN_FLAGS = {"rho": "--rho", "r": "--r-p5/--r-p50/--r-p95", "r_p50": "--r-p5/--r-p50/--r-p95"}
"""Sizing's field names -> the plan flags behind them (``ratios``: the trace's windows)."""


def _sized(make: Callable[[], SizingPlan]) -> SizingPlan:
    """``make()``; a refusal names the flag behind it ("rho: rho must be ..." said no flag)."""
    try:
        return make()
    except InvalidArgument as exc:
        flag = PLAN_FLAGS.get(exc.field or "", "--trace")
        raise click.UsageError(f"{flag}: {exc.message}") from None


@click.command("plan")
@click.option("--rho", type=float, help="Decode / prefill per-token throughput (default: model).")
@click.option(
    "--r-p5", type=float, help="R (uncached prompt / output tokens) at its 5th percentile."
)
@click.option("--r-p50", type=float, help="R at its median.")
@click.option("--r-p95", type=float, help="R at its 95th percentile.")
@click.option("--trace", type=FILE, help="Take R per window (or per session) from a trace.")
@click.option(
    "--window-s",
    type=click.FloatRange(min=0.001),
    default=60.0,
    show_default=True,
    help="With --trace: seconds of trace per R sample.",
)
@click.option(
    "--fleet",
    type=click.IntRange(min=2),
    default=6,
    show_default=True,
    help="Servers, for the split advice.",
)
@click.option(
    "--model", type=click.Choice(sorted(MODEL_PRESETS)), default="gpt-oss-120b", show_default=True
)
@click.option(
    "--hardware", type=click.Choice(sorted(NODE_PRESETS)), default="h200", show_default=True
)
def plan(
    rho: float | None,
    r_p5: float | None,
    r_p50: float | None,
    r_p95: float | None,
    trace: Path | None,
    window_s: float,
    fleet: int,
    model: str,
    hardware: str,
) -> None:
    """Size prefill and decode pools, static and with leases (f = rho R / (1 + rho R))."""
    given = [
        f for f, v in (("--r-p5", r_p5), ("--r-p50", r_p50), ("--r-p95", r_p95)) if v is not None
    ]
    if trace is not None and given:
        raise click.UsageError(f"--trace takes R from the trace: drop {', '.join(given)}")
    if rho is None:
        est = rho_from_model(MODEL_PRESETS[model], NODE_PRESETS[hardware])
        rho = est.rho
        click.echo(
            f"rho from the model ({model} on {hardware}): decode {est.decode_tps:,.0f} tok/s at "
            f"batch {est.decode_batch} x {est.context_tokens} context / prefill "
            f"{est.prefill_tps:,.0f} tok/s"
        )
    if trace is not None:
        ratios = trace_ratios(load_trace(trace), window_s)
        click.echo(f"R from {trace.name}: {len(ratios)} windows")
        sizing = _sized(lambda: plan_from_ratios(rho, ratios))
    else:
        if r_p5 is None or r_p50 is None or r_p95 is None:
            raise click.UsageError("give --r-p5, --r-p50 and --r-p95, or --trace FILE")
        sizing = _sized(lambda: plan_sizing(rho, r_p5, r_p50, r_p95))
    for line in format_plan(sizing, fleet):
        click.echo(line)
