"""``crossflow-agent calibrate``: a real CPU sweep in a subprocess, and a re-fit of known timings
whose profile round-trips through its file and changes the lease the agent would publish."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossflow_agent.cli import cli
from crossflow_agent.profile import load_profile
from crossflow_ctl.domain.calibration import TimingSample, roofline_time_s
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, NodeProfile
from crossflow_ctl.domain.lease_credits import LeaseSettings, compute_capacity
from crossflow_ctl.domain.telemetry import EngineSnapshot


def test_cpu_sweep_in_a_real_process_times_every_shape(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the sweep needs the .[kernels] extra (torch)")
    pytest.importorskip("triton", reason="the sweep needs the .[kernels] extra (triton)")
    from crossflow_kernels.costs import gemm_cost
    from crossflow_kernels.sweep import PLANS
    from crossflow_kernels.workloads import gemm_inputs

    profile_file, timings_file = tmp_path / "node.json", tmp_path / "timings.json"
    proc = subprocess.run(
        [sys.executable, "-m", "crossflow_agent", "calibrate", "--device", "cpu",
         "--sweep", "quick", "--dtype", "fp16", "--out", str(profile_file),
         "--save-timings", str(timings_file)],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    timings = json.loads(timings_file.read_text())
    plan = PLANS[("cpu", "quick")]
    kinds = [t["kind"] for t in timings["timings"]]
    n_decode = len(plan.batches) * len(plan.contexts)
    n_mixed = (len(plan.batches) - 1) * len(plan.contexts) * len(plan.chunks)
    assert kinds.count("decode") == n_decode
    assert kinds.count("prefill") == len(plan.chunks)
    assert kinds.count("mixed") == n_mixed
    assert timings["calibration"]["backend"] == "torch-reference"
    assert all(t["seconds"] > 0 for t in timings["timings"])
    # FLOPs and bytes are the analytic costs of the shapes, not measured
    prefill = [t for t in timings["timings"] if t["kind"] == "prefill"]
    for chunk, t in zip(plan.chunks, prefill, strict=True):
        _, _, shape = gemm_inputs(chunk, plan.hidden or 0, plan.hidden or 0, dtype=_fp16())
        assert t["flops"] == gemm_cost(shape).flops
        assert t["bytes_moved"] == gemm_cost(shape).bytes_moved
    # the kernels' timings file is what --from-timings reads: a re-fit gives the same profile
    refit_file = tmp_path / "refit.json"
    refit = CliRunner().invoke(
        cli, ["calibrate", "--from-timings", str(timings_file), "--out", str(refit_file)]
    )
    assert refit.exit_code == proc.returncode, refit.output
    # a shared CPU is noisy: the fit may refuse (it says why), or it wrote a loadable profile
    if proc.returncode != 0:
        assert "fit refused" in proc.stderr and "straddle" in proc.stderr, proc.stderr
        assert not profile_file.exists()
        return
    assert "fit error: rmse=" in proc.stdout
    profile = load_profile(profile_file)
    doc = json.loads(profile_file.read_text())
    assert doc["version"] == 1 and doc["device"].startswith("cpu")
    assert doc["fit"]["samples"] == len(kinds)
    assert doc["fit"]["rmse_s"] >= 0 and doc["fit"]["max_rel_error"] >= 0
    assert profile.flops_per_s > 0 and profile.hbm_bytes_per_s > 0
    assert load_profile(refit_file) == profile


def _fp16():
    import torch

    return torch.float16


SLOW_NODE = NodeProfile(
    name="slow", flops_per_s=2.0e14, hbm_bytes_per_s=1.5e12, step_overhead_s=6e-6,
    overlap_penalty=0.4,
)  # fmt: skip


def _synthetic_timings(true: NodeProfile) -> list[TimingSample]:
    rng = random.Random(11)
    shapes = []
    for batch in (1, 16, 128):
        for ctx in (1024, 16384):
            shapes.append((4.0 * 32 * 128 * batch * ctx, 2.0 * 8 * 128 * batch * ctx * 2, "decode"))
    for m in (512, 4096):
        shapes.append((2.0 * m * 4096 * 4096, 2.0 * (2 * m * 4096 + 4096 * 4096), "prefill"))
    shapes += [
        (f1 + f2, b1 + b2, "mixed") for f1, b1, _ in shapes[:6:2] for f2, b2, _ in shapes[6:]
    ]
    return [
        TimingSample(flops=f, bytes_moved=b, kind=k,
                     seconds=roofline_time_s(true, f, b) * (1 + rng.gauss(0, 0.01)))
        for f, b, k in shapes
    ]  # fmt: skip


def _write_timings(path: Path, samples: list[TimingSample], device: str) -> None:
    """The timings document of crossflow_kernels.sweep, written by hand."""
    rows = [{"label": f"t{i}", **s.model_dump()} for i, s in enumerate(samples)]
    doc = {"version": 1, "device": device, "calibration": {"backend": "synthetic"}, "timings": rows}
    path.write_text(json.dumps(doc))


def test_refit_round_trips_through_the_file_and_changes_the_lease(tmp_path: Path) -> None:
    timings_file, profile_file = tmp_path / "t.json", tmp_path / "p.json"
    measured = _synthetic_timings(SLOW_NODE)
    _write_timings(timings_file, measured, "synthetic-gpu")
    result = CliRunner().invoke(
        cli,
        ["calibrate", "--from-timings", str(timings_file), "--out", str(profile_file),
         "--name", "node-7", "--step-overhead-s", "0.004"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "fit error" in result.output

    loaded = load_profile(profile_file)
    doc = json.loads(profile_file.read_text())
    assert loaded.name == "node-7"
    assert loaded.flops_per_s == pytest.approx(SLOW_NODE.flops_per_s, rel=0.05)
    assert loaded.hbm_bytes_per_s == pytest.approx(SLOW_NODE.hbm_bytes_per_s, rel=0.05)
    assert loaded.overlap_penalty == pytest.approx(SLOW_NODE.overlap_penalty, abs=0.05)
    assert loaded.step_overhead_s == 0.004  # the engine's step overhead, as asked
    h200 = NODE_PRESETS["h200"]  # engine-side figures the kernels cannot see, from --engine-like
    assert (loaded.host_step_s, loaded.gemm_tile_rows) == (h200.host_step_s, h200.gemm_tile_rows)
    assert doc["calibration"]["kernel_overhead_s"] == pytest.approx(6e-6, rel=0.3)
    assert doc["device"] == "synthetic-gpu" and doc["fit"]["samples"] == len(measured)
    assert set(doc) >= {"version", "profile", "device", "created_unix_ms", "fit"}

    # the same node state gives a different lease under the calibrated profile
    model, settings = MODEL_PRESETS["llama-3.1-8b"], LeaseSettings()
    snapshot = EngineSnapshot(
        taken_at_ms=1, running_requests=32, decode_context_tokens=32 * 2000,
        kv_used_tokens=64_000, kv_total_tokens=400_000,
    )  # fmt: skip
    preset = compute_capacity(snapshot, model, NODE_PRESETS["h200"], settings)
    calibrated = compute_capacity(snapshot, model, loaded, settings)
    assert calibrated.base_step_s > preset.base_step_s  # a slower node than the preset
    assert 0 < calibrated.credits.compute_tokens < preset.credits.compute_tokens


def test_refit_of_a_one_sided_sweep_fails_with_the_reason(tmp_path: Path) -> None:
    decode_only = [s for s in _synthetic_timings(SLOW_NODE) if s.kind == "decode"]
    timings_file = tmp_path / "t.json"
    _write_timings(timings_file, decode_only, "x")
    out = tmp_path / "p.json"
    result = CliRunner().invoke(
        cli, ["calibrate", "--from-timings", str(timings_file), "--out", str(out)]
    )
    assert result.exit_code == 1
    assert "straddle" in result.output
    assert not out.exists()


def test_a_malformed_timings_file_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"version": 1, "timings": [{"kind": "decode", "flops": -1}]}))
    result = CliRunner().invoke(cli, ["calibrate", "--from-timings", str(bad), "--out", "x"])
    assert result.exit_code == 2
    assert "--from-timings" in result.output


def test_auto_without_a_gpu_says_it_falls_back_to_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--device auto on a machine without a GPU printed only "calibrating on cpu" and wrote a
    CPU profile, with nothing saying that it fell back, what cpu means (PyTorch references on
    this CPU) or that the profile is no GPU's. It says so on stderr, also with --json (stdout
    stays the document), and --device cuda still refuses."""
    torch = pytest.importorskip("torch", reason="the sweep needs the .[kernels] extra (torch)")
    from crossflow_agent import calibrate as calibrate_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen: list[str] = []
    samples = _synthetic_timings(SLOW_NODE)

    def fake_measure(*, device: str, **_: object) -> tuple[list[object], str, dict[str, object]]:
        seen.append(device)
        measured = [calibrate_mod.Measured(s.kind, f"t{i}", s) for i, s in enumerate(samples)]
        return measured, "cpu-test", {"backend": "torch-reference"}

    monkeypatch.setattr(calibrate_mod, "measure_node", fake_measure)
    out = tmp_path / "p.json"
    result = CliRunner().invoke(cli, ["calibrate", "--device", "auto", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert seen == ["cpu"]
    assert json.loads(result.stdout)["device"] == "cpu-test"
    said = " ".join(result.stderr.split())
    assert "no CUDA device is visible" in said and "falls back to cpu" in said, said
    assert "PyTorch reference kernels" in said and "not a GPU" in said, said

    refused = CliRunner().invoke(cli, ["calibrate", "--device", "cuda", "--out", str(out)])
    assert refused.exit_code == 2 and "no CUDA device is visible" in refused.output
