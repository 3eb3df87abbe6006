"""``--load auto`` (issue 33 item 3): offered input tokens/s, and the search for the load at which
the best static split falls 10 % short of them."""

from __future__ import annotations

import math

import pytest

from crossflow_ctl.sim import saturation
from crossflow_ctl.sim.config import SimConfig
from crossflow_ctl.sim.saturation import Probe, offered_input_tps, release_times_s
from crossflow_ctl.sim.traces import Trace, TraceRequest


def test_offered_input_counts_releases_with_no_service_time() -> None:
    reqs = (
        TraceRequest(100, 1, arrival_s=0.0),
        TraceRequest(300, 1, after_finish=0, delay_s=10.0),  # closed loop: 10 s after release 0
        TraceRequest(600, 1, arrival_s=4.0),
        TraceRequest(50, 1, after_release=2, delay_s=1.0),
    )
    trace = Trace("t", reqs)
    assert release_times_s(trace) == [0.0, 10.0, 4.0, 5.0]
    assert offered_input_tps(trace) == pytest.approx(1050 / 10.0)
    assert offered_input_tps(trace.scaled(2)) == pytest.approx(1050 / 5.0)  # twice the load
    # the warm-up drops what is released before it
    assert offered_input_tps(trace.with_warmup(4.5)) == pytest.approx(350 / 5.0)
    assert math.isnan(offered_input_tps(Trace("one", reqs[:1])))


def test_the_search_returns_the_lowest_saturating_load_within_the_tolerance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster that delivers at most 1,000 tokens/s of an offered 100 x load: it falls 10 %
    short above 11.1x, so the search ends in (11.1, 11.1 x 1.1]."""
    seen: list[float] = []

    def fake(trace, load, base, splits, jobs=1, run=None):  # type: ignore[no-untyped-def]
        seen.append(load)
        return Probe(load, 100.0 * load, "4P2D/static", min(100.0 * load, 1_000.0))

    monkeypatch.setattr(saturation, "probe", fake)
    found, probes = saturation.saturating_load(Trace("t", ()), SimConfig(), [(2, 4)])
    assert 1000 / 90 < found <= 1000 / 90 * 1.1
    assert [p.load for p in probes] == seen and seen[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert probes[-1].saturated or any(p.load == found and p.saturated for p in probes)
    lines = saturation.saturation_lines("t", found, probes)
    assert f"--load auto chose {found:.3g}x" in lines[-2]
    # saturated from the first probe: it looks lower
    monkeypatch.setattr(
        saturation, "probe", lambda t, load, *a, **k: Probe(load, 100.0 * load, "x", 5.0)
    )
    low, _ = saturation.saturating_load(Trace("t", ()), SimConfig(), [(2, 4)])
    assert low < 0.1 * 1.1
