"""The report's verdict line says where leases won and lost against the best static split."""

from __future__ import annotations

from crossflow_ctl.sim.report import _broken_at_gaps, verdict


class S:
    def __init__(self, trace: str, scale: float, label: str, input_tps: float) -> None:
        self.trace, self.scale, self.label, self.input_tps = trace, scale, label, input_tps
        self.output_tps = self.steady_input_tps = self.steady_output_tps = input_tps
        self.ttft_mean_ms = 1.0


def test_verdict_counts_wins_and_losses_with_the_best_and_worst() -> None:
    rows = [
        S("t", 4, "3P3D/static", 100.0), S("t", 4, "2P4D/static", 90.0),
        S("t", 4, "2P4D/leases", 120.0),
        S("t", 16, "3P3D/static", 100.0), S("t", 16, "2P4D/leases", 80.0),
    ]  # fmt: skip
    text = verdict(rows)[0]  # type: ignore[arg-type]
    assert "on 1 of 2" in text
    assert "+20.0 % at t 4x" in text
    assert "lost on 1 (worst -20.0 % at t 16x)" in text


def test_a_gap_in_the_windows_breaks_the_line() -> None:
    windows = [(0.0, 1.0, 0.1), (60.0, 2.0, 0.2), (120.0, 3.0, 0.3), (3600.0, 4.0, 0.4)]
    xs, rs, _ = _broken_at_gaps(windows, 1.0)
    assert len(xs) == 5
    assert xs[3] != xs[3]  # NaN: no line across the idle hour
    assert rs[-1] == 4.0
