"""Steady-state throughput: the tokens worked through between the warm-up and the last release
(input of prompts prefilled in it, output decoded in it), per second."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from crossflow_ctl.sim.cluster import Simulation, simulate, work_inside
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import summarize
from crossflow_ctl.sim.report import write_report
from crossflow_ctl.sim.sweep import Comparison
from crossflow_ctl.sim.traces import Trace, TraceRequest

CFG = SimConfig(prefill_nodes=1, decode_nodes=1)


async def test_steady_window_counts_only_work_done_inside_it() -> None:
    """Warm-up 2 s, last release at 8 s: only the request prefilled and decoded in [2, 8]
    counts (the first was done before it, the last prefilled after it)."""
    reqs = (
        TraceRequest(2_000, 5, arrival_s=0.0, cached_tokens=0),
        TraceRequest(3_000, 7, arrival_s=3.0, cached_tokens=0),
        TraceRequest(4_000, 9, arrival_s=8.0, cached_tokens=0),
    )
    sim = Simulation(Trace(name="hand", requests=reqs, warmup_s=2.0), CFG)
    rec = await sim.run()
    finishes = [sim.reqs[i].finish_s for i in range(3)]
    assert finishes[0] < 2.0 < finishes[1] < 8.0 < finishes[2]
    assert rec.steady_s == pytest.approx(6.0)
    s = summarize(rec)
    assert s.steady_input_tps == pytest.approx(3_000 / 6.0)
    assert s.steady_output_tps == pytest.approx(7 / 6.0)
    # The drain-inclusive figure counts the measured requests (released after the warm-up).
    assert rec.input_tokens == 7_000


async def test_saturated_run_steady_rate_excludes_the_drain() -> None:
    """A burst far above what one prefill server can take: the backlog drains long after the
    last release; the steady figure is the rate while requests still arrived."""
    reqs = tuple(TraceRequest(16_000, 50, arrival_s=i * 0.05, cached_tokens=0) for i in range(200))
    sim = Simulation(Trace(name="burst", requests=reqs), CFG)
    rec = await sim.run()
    last_release = max(r.release_s for r in sim.reqs.values())
    assert max(r.finish_s for r in sim.reqs.values()) > 2 * last_release
    prefilled = [r for r in sim.reqs.values() if r.prefilled_s <= last_release]
    s = summarize(rec)
    assert s.steady_input_tps == pytest.approx(
        sum(r.input_tokens for r in prefilled) / last_release
    )
    assert 0 < len(prefilled) < len(reqs)


def test_the_window_counts_work_not_the_requests_that_finished_in_it() -> None:
    """Issue 33 item 2: a long prompt prefilled inside the window whose decode runs past it
    counts its input and the output decoded inside; counting finished requests dropped it, and
    favoured the policy that finishes small prompts first."""
    long_one = (30.0, 100_000, 200, 5.0, 10.0)  # prefilled at 5, decodes 10 -> 30
    small = (6.0, 1_000, 20, 2.0, 4.0)  # prefilled at 2, decodes 4 -> 6
    before = (1.0, 9_000, 9, 0.5, 0.6)  # all before the window
    assert work_inside([long_one, small, before], 1.5, 20.0) == (101_000, 20 + 100)
    one_token = (7.0, 500, 1, 7.0, 7.0)
    assert work_inside([one_token], 1.5, 20.0) == (500, 1)
    assert work_inside([one_token], 8.0, 20.0) == (0, 0)


async def test_no_release_after_the_warm_up_gives_no_steady_figure() -> None:
    reqs = (TraceRequest(2_000, 5, arrival_s=0.0, cached_tokens=0),)
    rec = await Simulation(Trace(name="one", requests=reqs, warmup_s=1.0), CFG).run()
    assert rec.steady_s == 0.0
    assert math.isnan(summarize(rec).steady_input_tps)


async def test_report_targets_table_shows_best_static_then_leases(tmp_path: Path) -> None:
    reqs = tuple(TraceRequest(12_000, 100, arrival_s=i * 0.05, cached_tokens=0) for i in range(40))
    trace = Trace(name="burst", requests=reqs)
    records = []
    for p, d, policy in (
        (2, 4, PolicyKind.STATIC),
        (3, 3, PolicyKind.STATIC),
        (2, 4, PolicyKind.LEASES),
    ):
        cfg = SimConfig(prefill_nodes=p, decode_nodes=d, policy=policy)
        records.append(await simulate(trace, cfg))
    summaries = [summarize(r) for r in records]
    best = Comparison(summaries).best_static("burst", 1.0)
    assert best is not None
    text = write_report(tmp_path, records, CFG, plots=False).read_text()
    section = text.split("## Targets", 1)[1].split("##", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| burst |")]
    assert rows[0].startswith(f"| burst | 1x | {best.label} (best static) |")
    leases = summaries[2]
    assert rows[1].startswith("| burst | 1x | 2P4D/leases |")
    assert f"| {leases.steady_input_tps:,.0f} / {leases.steady_output_tps:,.0f} |" in rows[1]
    assert len(rows) == 2  # no threshold or 4P2D runs in this sweep
