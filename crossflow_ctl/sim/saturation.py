"""``--load auto``: the load at which the best static split falls short of the offered load.

"16x" is not the same thing on every trace: on one the pools are idle, on another they are
drowned. Comparing policies where the pools just saturate puts every trace on one footing
(issue 33): the saturating load is the lowest load (found to within ``1 + tolerance``) at which
the best static split's drain-inclusive input tokens/s fall ``shortfall`` (10 %) short of the
input tokens/s the trace offers there.

**Offered** input tokens/s are the measured requests' input tokens over the span of their release
times with no service time (:func:`offered_input_tps`): an open-loop trace's arrivals; a
closed-loop (session) trace's releases as if every request finished the moment it was released,
so the think times alone set the pace. A cluster that keeps up delivers close to that; one that
does not stretches the drain (open loop) or the sessions (closed loop), and the delivered rate
falls behind.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import RunRecord, summarize
from crossflow_ctl.sim.sweep import Comparison, RunSpec, run_sweep
from crossflow_ctl.sim.traces import Trace

SHORTFALL = 0.10
"""The best static split is saturated once it delivers less than 90 % of the offered input."""


def release_times_s(trace: Trace) -> list[float]:
    """Each request's release time with no service time: its arrival, or its parent's release
    plus its delay (a closed-loop follow-up's parent finishes the moment it is released)."""
    times: list[float] = []
    for r in trace.requests:
        parent = r.after_finish if r.after_finish is not None else r.after_release
        times.append(r.arrival_s if parent is None else times[parent] + r.delay_s)
    return times


def offered_input_tps(trace: Trace) -> float:
    """Input tokens/s the trace offers over its measured window (see the module doc); NaN when
    the window is empty."""
    times = release_times_s(trace)
    measured = [(t, r.input_tokens) for t, r in zip(times, trace.requests, strict=True)]
    measured = [(t, n) for t, n in measured if t >= trace.warmup_s]
    if len(measured) < 2:
        return math.nan
    start = min(t for t, _ in measured)
    span = max(t for t, _ in measured) - start
    return sum(n for _, n in measured) / span if span > 0 else math.nan


@dataclass(frozen=True, slots=True)
class Probe:
    load: float
    offered_tps: float
    best_static: str
    delivered_tps: float

    @property
    def ratio(self) -> float:
        return self.delivered_tps / self.offered_tps if self.offered_tps > 0 else math.nan

    @property
    def saturated(self) -> bool:
        return self.ratio < 1.0 - SHORTFALL


def probe(
    trace: Trace,
    load: float,
    base: SimConfig,
    splits: Sequence[tuple[int, int]],
    jobs: int = 1,
    run: Callable[[Sequence[RunSpec], int], list[RunRecord]] | None = None,
) -> Probe:
    """Every static split at ``load``: the best one's delivered input against the offered."""
    scaled = trace.scaled(load)
    specs = [
        RunSpec(
            scaled,
            load,
            base.model_copy(
                update={"prefill_nodes": p, "decode_nodes": d, "policy": PolicyKind.STATIC}
            ),
        )
        for p, d in splits
    ]
    records = (run or (lambda s, j: run_sweep(s, jobs=j)))(specs, jobs)
    best = Comparison([summarize(r) for r in records]).best_static(trace.name, load)
    assert best is not None  # at least one split ran
    return Probe(load, offered_input_tps(scaled), best.label, best.input_tps)


def saturating_load(
    trace: Trace,
    base: SimConfig,
    splits: Sequence[tuple[int, int]],
    *,
    start: float = 1.0,
    most: float = 4096.0,
    tolerance: float = 0.10,
    jobs: int = 1,
    run: Callable[[Sequence[RunSpec], int], list[RunRecord]] | None = None,
) -> tuple[float, list[Probe]]:
    """The lowest load (within ``1 + tolerance``, by doubling then bisecting in log space) at
    which the best static split is saturated, and every probe run; ``most`` when it never is."""
    probes: list[Probe] = []
    lo, hi = 0.0, start
    while True:
        p = probe(trace, hi, base, splits, jobs, run)
        probes.append(p)
        if p.saturated:
            break
        if hi >= most:
            return most, probes
        lo, hi = hi, min(most, hi * 2.0)
    if lo <= 0.0:  # saturated at the first load already: look lower
        while hi > 1.0 / 64:
            p = probe(trace, hi / 2.0, base, splits, jobs, run)
            probes.append(p)
            if not p.saturated:
                lo = hi / 2.0
                break
            hi /= 2.0
        else:
            return hi, probes
    while hi / lo > 1.0 + tolerance:
        mid = math.sqrt(lo * hi)
        p = probe(trace, mid, base, splits, jobs, run)
        probes.append(p)
        if p.saturated:
            hi = mid
        else:
            lo = mid
    return hi, probes


def saturation_lines(trace: str, load: float, probes: Sequence[Probe]) -> list[str]:
    """The report's account of how ``--load auto`` chose ``load`` for ``trace``: every probe,
    in the order run, then the choice (the last line)."""
    lines = [
        f"**Saturating load** of {trace}: each probe's best static split, its drain-inclusive"
        " input tokens/s against the offered:",
        "",
    ]
    for p in probes:
        lines.append(
            f"- {p.load:.3g}x: {p.best_static} {p.delivered_tps:,.0f} of {p.offered_tps:,.0f}"
            f" tok/s ({p.ratio * 100:.1f} %{', saturated' if p.saturated else ''})"
        )
    lines += [
        "",
        f"{trace}: --load auto chose {load:.3g}x (the best static split delivers under"
        f" {(1 - SHORTFALL) * 100:.0f} % of the offered input tokens/s), and 2x and 4x it.",
        "",
    ]
    return lines
