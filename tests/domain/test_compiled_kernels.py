"""The numeric kernels compiled with mypyc (setup.py's ``KERNELS``) decide exactly as the pure
modules: a copy of the package with them compiled gives the simulator's golden runs
(``scripts/sim_golden.py --check``: every request's decisions on 27 short runs). Skipped where
mypyc or a C compiler is missing: the build is optional, pure Python otherwise."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kernels() -> list[str]:
    """setup.py's KERNELS, read from its source (running it would build)."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "KERNELS":
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py names no KERNELS")


def _compiler() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None


@pytest.mark.timeout(900)
def test_compiled_kernels_give_the_golden_decisions(tmp_path: Path) -> None:
    pytest.importorskip("mypyc")
    if not _compiler():
        pytest.skip("no C compiler: the kernels stay pure Python")
    shutil.copytree(ROOT / "crossflow_ctl", tmp_path / "crossflow_ctl")
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    (tmp_path / "tests" / "data").mkdir(parents=True)
    shutil.copytree(ROOT / "tests" / "data" / "traces", tmp_path / "tests" / "data" / "traces")
    shutil.copy(ROOT / "tests" / "data" / "sim_golden.json", tmp_path / "tests" / "data")
    kernels = _kernels()
    built = subprocess.run(
        [sys.executable, "-m", "mypyc", *kernels],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    probe = (
        "import importlib, sys; print(*(importlib.import_module(m).__file__ for m in sys.argv[1:]))"
    )
    modules = [k.removesuffix(".py").replace("/", ".") for k in kernels]
    loaded = subprocess.run(
        [sys.executable, "-c", probe, *modules],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()  # fmt: skip
    assert len(loaded) == len(kernels)
    assert all(Path(f).suffix == ".so" and Path(f).is_relative_to(tmp_path) for f in loaded), loaded
    golden = subprocess.run(
        [sys.executable, "scripts/sim_golden.py", "--check"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert golden.returncode == 0, golden.stdout + golden.stderr
