"""The timing harness and benchmark: every kernel gets a row, outputs agree with the reference.

Times themselves are never asserted (interpreted Triton on a CPU is not a timing); this checks
the harness the GPU check relies on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="kernel tests need the .[kernels] extra (torch)")
pytest.importorskip("triton", reason="kernel tests need the .[kernels] extra (triton)")

from crossflow_kernels import bench  # noqa: E402
from crossflow_kernels.timing import time_call  # noqa: E402

pytestmark = pytest.mark.kernels


def test_bench_writes_a_row_per_kernel_that_agrees_with_the_reference(
    tmp_path: Path, kernel_device: str
) -> None:
    out = tmp_path / "bench.json"
    bench.main(["--small", "--repeats", "1", "--dtype", "fp16", "--out", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    kinds = [r["kernel"] for r in rows]
    assert kinds == ["decode_attention", "prefill_gemm", "mixed_step", "mixed_vs_halves"]
    for r in rows[:3]:
        assert r["max_abs_diff"] < 2e-2  # fp16 outputs of unit size: a few ulps at most
        assert r["triton_s"] > 0 and r["reference_s"] > 0
        assert r["bytes_per_s"] > 0 and r["flops_per_s"] > 0
    assert doc["peaks"]["hbm_bytes_per_s"] == 4.8e12
    assert doc["interpreted"] == (torch.cuda.is_available() is False)


def test_time_call_counts_its_repeats() -> None:
    calls = []
    timing = time_call(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeats=5)
    assert len(calls) == 7 and timing.repeats == 5
    assert 0 < timing.min_s <= timing.median_s
    with pytest.raises(ValueError, match="repeats"):
        time_call(lambda: None, torch.device("cpu"), repeats=0)
