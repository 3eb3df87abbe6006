"""The sweep's checks (issue 33): leases' ITL p99 within the SLO, no over-commit, and never worse
than static on the same split in mean TTFT or drain-inclusive tokens/s."""

from __future__ import annotations

from crossflow_ctl.sim.report import checks_section
from crossflow_ctl.sim.sweep import sweep_failures


class Cell:
    """The Summary fields the checks read."""

    def __init__(
        self, label: str, ttft: float, tps: float, itl_p99: float = 40.0, oc: int = 0
    ) -> None:
        self.trace, self.scale, self.label = "t", 4.0, label
        self.ttft_mean_ms, self.input_tps, self.output_tps = ttft, tps, tps / 100
        self.itl_p99_ms, self.overcommits = itl_p99, oc


def test_a_clean_sweep_passes_every_check() -> None:
    static = Cell("2P4D/static", 1_000.0, 50_000.0)
    clean = [static, Cell("2P4D/leases", 700.0, 50_000.0 * 0.999)]  # within the tolerance
    assert sweep_failures(clean, 50.0) == []  # type: ignore[arg-type]
    assert "Every check held" in "\n".join(checks_section([]))


def test_every_failure_is_named() -> None:
    bad = [
        Cell("2P4D/static", 1_000.0, 50_000.0),
        Cell("2P4D/leases", 1_100.0, 45_000.0, itl_p99=50.6),
        Cell("4P2D/leases", 100.0, 1.0, oc=2),  # no 4P2D/static in the sweep: only over-commits
        Cell("3P3D/threshold", 1.0, 1.0, itl_p99=120.0),  # the heuristic keeps no SLO
    ]
    failures = sweep_failures(bad, 50.0)  # type: ignore[arg-type]
    assert len(failures) == 5, failures
    text = "\n".join(failures)
    assert "2P4D/leases: ITL p99 50.6 ms past the 50 ms SLO" in text
    assert "mean TTFT 1,100 ms worse than 2P4D/static's 1,000 ms" in text
    assert "drain-inclusive input 45,000 tok/s" in text and "-10.0 %" in text
    assert "drain-inclusive output" in text
    assert "4P2D/leases: 2 over-commits" in text
    assert "**5 FAILED**" in "\n".join(checks_section(failures))
