"""Repository-wide checks: generated code matches the protos, buf lint, ruff, mypy --strict,
and the import-linter layer contracts. These run the real tools, exactly as a developer would."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str | None:
    local = ROOT / ".ci-tools" / "bin" / name
    return str(local) if local.exists() else shutil.which(name)


def _run(*cmd: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_generated_code_matches_protos() -> None:
    result = _run(sys.executable, "scripts/gen_protos.py", "--check")
    assert result.returncode == 0, result.stderr


def test_buf_lint() -> None:
    buf = _tool("buf")
    if buf is None:
        pytest.skip("buf not installed (bash scripts/install_tools.sh installs it)")
    result = _run(buf, "lint", "proto")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(600)
def test_ruff_clean() -> None:
    result = _run(sys.executable, "-m", "ruff", "check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(900)  # a whole-package mypy run: minutes on a loaded 2-core machine
def test_mypy_strict_on_the_packages() -> None:
    result = _run(
        sys.executable,
        "-m",
        "mypy",
        "-p",
        "crossflow_ctl",
        "-p",
        "crossflow_agent",
        "-p",
        "crossflow_kernels",
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


@pytest.mark.timeout(600)
def test_import_layers_kept() -> None:
    lint = _tool("lint-imports")
    assert lint is not None, "import-linter is a dev dependency"
    result = _run(lint, "--no-cache")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr
