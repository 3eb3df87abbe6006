"""The calibration fit recovers known roofline constants from synthetic timings.

Synthetic kernel timings come from the capacity model's own formula with known constants, times
multiplicative Gaussian noise. Stated tolerances: noise-free, every constant within 0.5% (the
penalty within 0.005, the fine grid step); with 2% noise, FLOP/s and bandwidth within 5%, the
overlap penalty within 0.05 absolute and the overhead within 20%.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.calibration import TimingSample, fit_node_profile, roofline_time_s
from crossflow_ctl.domain.capacity import (
    MODEL_PRESETS,
    NODE_PRESETS,
    NodeProfile,
    kernel_time_s,
    roofline,
)
from crossflow_ctl.domain.errors import InvalidArgument


def design() -> list[tuple[float, float, str]]:
    """A calibration-like sweep: decode attention, prefill GEMMs, and mixes of both (F, B)."""
    decode = []
    for batch in (1, 8, 64):
        for ctx in (512, 8192, 65536):
            decode.append((4.0 * 64 * 128 * batch * ctx, 2.0 * 8 * 128 * batch * ctx * 2, "decode"))
    prefill = []
    for m in (256, 2048, 8192):
        h = 8192
        prefill.append((2.0 * m * h * h, 2.0 * (2 * m * h + h * h), "prefill"))
    mixed = [(f1 + f2, b1 + b2, "mixed") for f1, b1, _ in decode[::2] for f2, b2, _ in prefill]
    return decode + prefill + mixed


def synthetic(true: NodeProfile, noise: float, seed: int) -> list[TimingSample]:
    rng = random.Random(seed)
    return [
        TimingSample(
            flops=f,
            bytes_moved=b,
            seconds=roofline_time_s(true, f, b) * (1.0 + rng.gauss(0.0, noise)),
            kind=kind,
        )
        for f, b, kind in design()
    ]


TRUE = NodeProfile(
    name="true", flops_per_s=6.2e14, hbm_bytes_per_s=4.1e12, step_overhead_s=9e-6,
    overlap_penalty=0.37,
)  # fmt: skip


def test_noise_free_timings_are_recovered_exactly() -> None:
    result = fit_node_profile(synthetic(TRUE, 0.0, 0), name="node-a")
    got = result.profile
    assert got.name == "node-a"
    assert got.flops_per_s == pytest.approx(TRUE.flops_per_s, rel=5e-3)
    assert got.hbm_bytes_per_s == pytest.approx(TRUE.hbm_bytes_per_s, rel=5e-3)
    assert got.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=5e-3)
    assert got.overlap_penalty == pytest.approx(TRUE.overlap_penalty, abs=5e-3)
    assert result.fit.samples == len(design())
    assert result.fit.max_rel_error < 0.01


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_noisy_timings_are_recovered_within_tolerance(seed: int) -> None:
    result = fit_node_profile(synthetic(TRUE, 0.02, seed), name="n")
    got = result.profile
    assert got.flops_per_s == pytest.approx(TRUE.flops_per_s, rel=0.05)
    assert got.hbm_bytes_per_s == pytest.approx(TRUE.hbm_bytes_per_s, rel=0.05)
    assert got.overlap_penalty == pytest.approx(TRUE.overlap_penalty, abs=0.05)
    assert got.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=0.2)
    assert 0.0 < result.fit.max_rel_error < 0.15
    assert result.fit.rmse_s > 0.0


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    flops=st.floats(1e12, 2e15),
    bandwidth=st.floats(5e10, 8e12),
    overhead=st.floats(0.0, 1e-4),
    penalty=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.8, 1.0]),
)
def test_any_physical_node_is_recovered_or_refused(flops, bandwidth, overhead, penalty) -> None:
    """A sweep that straddles the node's ridge recovers its constants. One that does not may be
    refused (the constants are not identifiable); whatever is returned predicts every timing."""
    true = NodeProfile(name="h", flops_per_s=flops, hbm_bytes_per_s=bandwidth,
                       step_overhead_s=overhead, overlap_penalty=penalty)  # fmt: skip
    samples = synthetic(true, 0.0, 0)
    ridge = flops / bandwidth
    above = sum(1 for s in samples if s.flops / s.bytes_moved > ridge * 1.05)
    below = sum(1 for s in samples if s.flops / s.bytes_moved < ridge / 1.05)
    straddles = min(above, below) >= 2
    try:
        got = fit_node_profile(samples, name="h")
    except InvalidArgument as exc:
        assert not straddles, f"refused a sweep that straddles the ridge: {exc}"
        assert exc.field == "samples" and "straddle" in exc.message
        return
    for s in samples:  # the fitted profile predicts every timing
        predicted = roofline_time_s(got.profile, s.flops, s.bytes_moved)
        assert predicted == pytest.approx(s.seconds, rel=0.02)
    if straddles:
        assert got.profile.flops_per_s == pytest.approx(flops, rel=0.02)
        assert got.profile.hbm_bytes_per_s == pytest.approx(bandwidth, rel=0.02)
        assert got.profile.overlap_penalty == pytest.approx(penalty, abs=0.01)


def test_the_ridge_case_hypothesis_once_found_is_recovered() -> None:
    """Ridge at 8.4 FLOP/B, next to the decode samples' 8.0: on the edge, still exact."""
    true = NodeProfile(name="h", flops_per_s=1e12, hbm_bytes_per_s=119047619048.0,
                       step_overhead_s=0.0, overlap_penalty=0.0)  # fmt: skip
    got = fit_node_profile(synthetic(true, 0.0, 0), name="h").profile
    assert got.flops_per_s == pytest.approx(true.flops_per_s, rel=1e-6)
    assert got.hbm_bytes_per_s == pytest.approx(true.hbm_bytes_per_s, rel=1e-6)


def test_a_sweep_on_one_side_of_the_ridge_is_refused() -> None:
    decode_only = [s for s in synthetic(TRUE, 0.0, 0) if s.kind == "decode"]
    with pytest.raises(InvalidArgument, match="straddle") as err:
        fit_node_profile(decode_only, name="n")
    assert err.value.field == "samples"


def test_the_fit_uses_the_capacity_models_kernel_formula() -> None:
    """roofline_time_s is kernel_time_s plus the per-call overhead, and the capacity model's GPU
    time is kernel_time_s summed over its kernel groups: fitted constants mean the same."""
    model = MODEL_PRESETS["gpt-oss-120b"]
    node = NODE_PRESETS["h200"]
    r = roofline(model, node)
    shapes = ((1, 100, 0, 0), (64, 200_000, 512, 4096), (0, 0, 8192, 0))
    for batch, context, chunk, prefix in shapes:
        groups = r.groups(batch, context, chunk, prefix)
        for f, b in groups:
            raw = roofline_time_s(node, f, b)
            assert raw == pytest.approx(kernel_time_s(node, f, b) + node.step_overhead_s)
        gpu = sum(kernel_time_s(node, f, b) for f, b in groups)
        assert r.cost(batch, context, chunk, prefix).gpu_s == pytest.approx(gpu, rel=1e-12)


def test_too_few_timings_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgument) as err:
        fit_node_profile(synthetic(TRUE, 0.0, 0)[:3], name="n")
    assert err.value.field == "samples"


def test_a_timing_must_be_positive_and_finite() -> None:
    from pydantic import ValidationError

    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValidationError):
            TimingSample(flops=1.0, bytes_moved=1.0, seconds=bad)
