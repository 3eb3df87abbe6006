"""Sweeps: every (trace, load, split, policy) run, over worker processes, and their comparison.

Each run is independent (its own cluster, store and broker), so runs go to a process pool of
``jobs`` workers; results come back as picklable :class:`RunRecord` objects in a fixed order, so
a sweep's report does not depend on which worker finished first.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from crossflow_ctl.sim.cluster import simulate
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import RunRecord, Summary
from crossflow_ctl.sim.traces import Trace

STATIC_SPLITS = ((1, 5), (2, 4), (3, 3), (4, 2), (5, 1))
BORROW_SPLITS = ((2, 4), (4, 2))


@dataclass(frozen=True, slots=True)
class RunSpec:
    trace: Trace
    load: float
    config: SimConfig

    @property
    def key(self) -> tuple[str, float, str]:
        return (self.trace.name, self.load, self.config.label)


def plan_runs(
    traces: Sequence[Trace],
    loads: Sequence[float],
    base: SimConfig,
    static_splits: Sequence[tuple[int, int]] = STATIC_SPLITS,
    borrow_splits: Sequence[tuple[int, int]] = BORROW_SPLITS,
    policies: Sequence[PolicyKind] = (PolicyKind.STATIC, PolicyKind.THRESHOLD, PolicyKind.LEASES),
) -> list[RunSpec]:
    """Static policy on ``static_splits``; the borrowing policies on ``borrow_splits``."""
    runs: list[RunSpec] = []
    for trace in traces:
        for load in loads:
            scaled = trace.scaled(load)
            for policy in policies:
                splits = static_splits if policy is PolicyKind.STATIC else borrow_splits
                for p, d in splits:
                    cfg = base.model_copy(
                        update={"prefill_nodes": p, "decode_nodes": d, "policy": policy}
                    )
                    runs.append(RunSpec(scaled, load, cfg))
    return runs


def run_one(spec: RunSpec) -> RunRecord:
    """One run in this process (also the worker entry point)."""
    rec = asyncio.run(simulate(spec.trace, spec.config))
    rec.scale = spec.load
    return rec


def run_sweep(
    runs: Sequence[RunSpec],
    jobs: int = 1,
    on_done: Callable[[RunRecord], None] | None = None,
) -> list[RunRecord]:
    """Every run, results in the order of ``runs``."""
    if jobs <= 1 or len(runs) <= 1:
        out = []
        for spec in runs:
            rec = run_one(spec)
            if on_done is not None:
                on_done(rec)
            out.append(rec)
        return out
    results: list[RunRecord | None] = [None] * len(runs)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, spec): i for i, spec in enumerate(runs)}
        for fut in as_completed(futures):
            rec = fut.result()
            results[futures[fut]] = rec
            if on_done is not None:
                on_done(rec)
    return [r for r in results if r is not None]


# -- comparison ---------------------------------------------------------------------------------


class Comparison:
    """Leases (and the heuristic) against the best static split, per trace and load."""

    def __init__(self, summaries: Sequence[Summary]) -> None:
        self.summaries = list(summaries)

    def groups(self) -> list[tuple[str, float]]:
        seen: dict[tuple[str, float], None] = {}
        for s in self.summaries:
            seen[(s.trace, s.scale)] = None
        return list(seen)

    def best_static(self, trace: str, load: float) -> Summary | None:
        """Highest output throughput; within 1 % of it, the lowest mean TTFT."""
        static = [
            s
            for s in self.summaries
            if s.trace == trace and s.scale == load and s.label.endswith("/static")
        ]
        if not static:
            return None
        top = max(s.output_tps for s in static)
        near = [s for s in static if s.output_tps >= 0.99 * top]
        return min(near, key=lambda s: (s.ttft_mean_ms, s.label))

    def find(self, trace: str, load: float, label: str) -> Summary | None:
        for s in self.summaries:
            if s.trace == trace and s.scale == load and s.label == label:
                return s
        return None


def rel(a: float, b: float) -> float:
    """(a - b) / b, NaN when undefined."""
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return math.nan
    return (a - b) / b


async def run_sweep_on_redis(
    runs: Sequence[RunSpec], url: str, on_done: Callable[[RunRecord], None] | None = None
) -> list[RunRecord]:
    """Every run in turn on the Redis store at ``url`` (one namespace each, deleted after)."""
    from redis.asyncio import Redis

    from crossflow_ctl.store.redis_store import RedisStore

    records = []
    client = Redis.from_url(url)
    try:
        for spec in runs:
            namespace = f"crossflow-sim-{uuid.uuid4().hex[:12]}"
            store = RedisStore(client, namespace)
            try:
                rec = await simulate(spec.trace, spec.config, store)
            finally:
                await store.close()
                keys = [k async for k in client.scan_iter(match=f"{namespace}*", count=1000)]
                if keys:
                    await client.delete(*keys)
            rec.scale = spec.load
            records.append(rec)
            if on_done is not None:
                on_done(rec)
    finally:
        await client.aclose()
    return records


# -- checks -------------------------------------------------------------------------------------

NEVER_WORSE_TOLERANCE = 0.005
"""How much worse than static on the same split a leases cell may read before the check fails:
0.5 % of the static figure. Closed-loop session traces deliver the same tokens on every split,
and the drain-inclusive rate then differs by a few tokens/s of tens of thousands with the last
finish (53,084 against 53,085 in one agentic cell); a real loss is far past this."""


def sweep_failures(
    summaries: Sequence[Summary],
    itl_slo_ms: float,
    tolerance: float = NEVER_WORSE_TOLERANCE,
) -> list[str]:
    """What a sweep must never show, one line each (empty: every check held), for every
    borrowing run (leases, and the heuristic only for over-commits, which it cannot have):

    * a leases run whose ITL p99 is past the agents' ITL SLO: leases exist so that borrowing
      never costs decode its SLO;
    * a granted debit that over-committed a node;
    * a leases run worse than the static policy on its own split (issue 33: never worse than
      doing nothing) on mean TTFT, or on drain-inclusive input or output tokens/s, by more than
      ``tolerance`` of the static figure."""
    failures: list[str] = []
    by_key = {(s.trace, s.scale, s.label): s for s in summaries}
    for s in summaries:
        cell = f"{s.trace} {s.scale:g}x {s.label}"
        if s.overcommits:
            failures.append(f"{cell}: {s.overcommits} over-commits (must be 0)")
        if not s.label.endswith("/leases"):
            continue
        if s.itl_p99_ms > itl_slo_ms:
            failures.append(f"{cell}: ITL p99 {s.itl_p99_ms:.1f} ms past the {itl_slo_ms:g} ms SLO")
        split = s.label.rsplit("/", 1)[0]
        static = by_key.get((s.trace, s.scale, f"{split}/static"))
        if static is None:
            continue
        if s.ttft_mean_ms > static.ttft_mean_ms * (1.0 + tolerance):
            failures.append(
                f"{cell}: mean TTFT {s.ttft_mean_ms:,.0f} ms worse than {split}/static's"
                f" {static.ttft_mean_ms:,.0f} ms"
            )
        for name, mine, theirs in (
            ("input", s.input_tps, static.input_tps),
            ("output", s.output_tps, static.output_tps),
        ):
            if mine < theirs * (1.0 - tolerance):
                failures.append(
                    f"{cell}: drain-inclusive {name} {mine:,.0f} tok/s worse than {split}/static's"
                    f" {theirs:,.0f} tok/s ({rel(mine, theirs) * 100:+.1f} %)"
                )
    return failures
