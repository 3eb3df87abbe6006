"""Checks that need the full public traces, from $CROSSFLOW_TRACES_DIR (skipped without it).

CI has only the heads in tests/data/traces; run these where the full files are, after cutting new
samples or changing a trace reader: ``CROSSFLOW_TRACES_DIR=/path/to/traces pytest
tests/sim/test_full_traces.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from crossflow_ctl.sim.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.may_skip


def test_the_samples_are_heads_of_the_full_traces(full_traces_dir: Path) -> None:
    cut = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cut_trace_samples.py"), str(full_traces_dir),
         "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cut.returncode == 0, cut.stderr


def test_plan_from_the_mooncake_trace_matches_its_readme(full_traces_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from crossflow_ctl.cli.ctl import main; main()", "plan",
         "--rho", "0.1", "--trace", str(full_traces_dir / "mooncake_conversation_trace.jsonl")],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # The traces' README: R p5 / p50 / p95 = 16.5 / 21.9 / 31.0 (1-minute bins).
    assert "R p5 / p50 / p95            = 16.5 / 21.9 / 31.0" in out.stdout


def test_the_agent_sessions_file_loads_whole(full_traces_dir: Path) -> None:
    trace = load_trace(full_traces_dir / "agent_sessions_sample.jsonl")
    assert len(trace.requests) == 5571
    tops = {r.session for r in trace.requests if r.after_finish is None and r.after_release is None}
    assert len(tops) == 100
    assert trace.closed_loop
