"""The CI switch: with CROSSFLOW_FAIL_ON_SKIP=1 a skip fails the run (unless marked may_skip)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

CASES = """
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("helm is not installed")

@pytest.mark.may_skip
def test_allowed():
    pytest.skip("only where the optional package is absent")
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "conftest.py").write_text(
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'may_skip: allowed skip')\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != "CROSSFLOW_FAIL_ON_SKIP"}
    environ.update(PYTHONPATH=str(REPO_ROOT), **env)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.skip_guard",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_cases.py"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environ,
        timeout=120,
    )


def test_skips_pass_by_default(tmp_path: Path) -> None:
    res = _run(tmp_path)
    assert res.returncode == 0, res.stdout
    assert "1 passed, 2 skipped" in res.stdout


def test_skips_fail_under_the_switch(tmp_path: Path) -> None:
    res = _run(tmp_path, CROSSFLOW_FAIL_ON_SKIP="1")
    assert res.returncode == 1, res.stdout
    assert "1 failed, 1 passed, 1 skipped" in res.stdout
    assert "forbids skips; this test skipped: helm is not installed" in res.stdout
