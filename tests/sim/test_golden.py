"""Short runs of every committed trace sample, under every policy at 1x, 4x and 16x, give the
decisions and figures ``scripts/sim_golden.py`` recorded from the code before the simulator's
speed work (tests/data/sim_golden.json): a faster hot loop must not move a single result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_short_runs_give_the_golden_decisions_and_figures() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/sim_golden.py", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
