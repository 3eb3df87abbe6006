"""The planner: DESIGN.md §1's worked example, by the pure function and by the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.sizing import (
    percentile,
    plan_from_ratios,
    plan_sizing,
    prefill_share,
    recommend_split,
    rho_from_model,
)


def test_worked_example_of_the_design() -> None:
    plan = plan_sizing(0.1, 5, 10, 20)
    assert (plan.f_p5, plan.f_p50, plan.f_p95) == pytest.approx((1 / 3, 0.5, 2 / 3))
    assert plan.static_purchase == pytest.approx(4 / 3)
    assert plan.leased_purchase == pytest.approx(7 / 6)
    assert plan.static_idle_points == pytest.approx(1 / 3)
    assert plan.leased_idle_points == pytest.approx(1 / 6)
    assert plan.static_stranded == pytest.approx(0.25)
    assert plan.leased_stranded == pytest.approx(1 / 7)
    assert plan.borrow_need_points == pytest.approx(1 / 6)
    assert plan.decode_free_points == pytest.approx(1 / 3)
    assert plan.leases_cover_peak


def test_share_grows_with_r_and_rho() -> None:
    assert prefill_share(0.1, 0) == 0
    assert prefill_share(0.1, 10) < prefill_share(0.1, 20) < prefill_share(0.2, 20) < 1


@pytest.mark.parametrize(
    ("args", "field"),
    [((0.0, 1, 2, 3), "rho"), ((0.1, -1, 2, 3), "r"), ((0.1, 5, 4, 6), "r_p50")],
)
def test_bad_input_names_the_field(args: tuple[float, ...], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        plan_sizing(*args)
    assert err.value.field == field


def test_percentiles_and_ratios() -> None:
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([0, 10], 95) == pytest.approx(9.5)
    plan = plan_from_ratios(0.1, [10.0] * 20)
    assert plan.static_purchase == pytest.approx(1.0)
    with pytest.raises(InvalidArgument):
        plan_from_ratios(0.1, [])


def test_recommended_split() -> None:
    advice = recommend_split(plan_sizing(0.1, 5, 10, 20), 6)
    assert advice.leased_prefill_nodes == 3  # 6 x f(p50) = 3
    assert advice.static_prefill_nodes == 3  # 6 x 66.7 / 133.3 = 3
    skewed = recommend_split(plan_sizing(0.1, 1, 2, 4), 10)
    assert skewed.label(skewed.leased_prefill_nodes) == "2P8D"
    with pytest.raises(InvalidArgument):
        recommend_split(plan_sizing(0.1, 5, 10, 20), 1)


def test_rho_from_the_capacity_model() -> None:
    est = rho_from_model(MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"])
    assert 0 < est.rho < 1  # decode is slower per token than prefill
    assert est.rho == pytest.approx(est.decode_tps / est.prefill_tps)
    bigger = rho_from_model(MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"], decode_batch=128)
    assert bigger.decode_tps > est.decode_tps


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    code = "from crossflow_ctl.cli.ctl import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )


def test_plan_cli_prints_the_worked_example() -> None:
    out = _ctl("plan", "--rho", "0.1", "--r-p5", "5", "--r-p50", "10", "--r-p95", "20")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "33.3 / 50.0 / 66.7 %" in text
    assert "static purchase             = 133.3 %" in text
    assert "leased purchase             = 116.7 %" in text
    assert "idle points                 = 33.3 -> 16.7 points" in text


def test_plan_cli_refuses_missing_percentiles() -> None:
    out = _ctl("plan", "--rho", "0.1", "--r-p5", "5")
    assert out.returncode != 0
    assert "--r-p50" in out.stderr


def _mooncake_ratios(path: Path, window_s: float) -> list[float]:
    """R per window of a Mooncake file, reckoned here without the simulator's code: an unbounded
    prefix cache over ``hash_ids`` (prefix-chained, so a prompt's hit is its leading run of ids
    seen before, in 512-token blocks, leaving its last token uncached), in arrival order."""
    rows = sorted(
        (json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["timestamp"]
    )
    seen: set[int] = set()
    bins: dict[int, list[int]] = {}
    for row in rows:
        hit = 0
        for block in row["hash_ids"]:
            if block not in seen:
                break
            hit += 1
        seen.update(row["hash_ids"])
        cached = max(0, min(hit * 512, row["input_length"] - 1))
        acc = bins.setdefault(int(row["timestamp"] / 1000 // window_s), [0, 0])
        acc[0] += row["input_length"] - cached
        acc[1] += row["output_length"]
    return [u / o for u, o in bins.values() if o]


def test_plan_from_a_mooncake_trace_takes_r_per_window_through_the_prefix_cache(
    mooncake_sample: Path,
) -> None:
    """The sample's 201 s in 10-s windows: 21 values of R, their percentiles by numpy. (The full
    trace against its README's figures: tests/sim/test_full_traces.py.)"""
    ratios = _mooncake_ratios(mooncake_sample, 10.0)
    assert len(ratios) == 21
    p5, p50, p95 = np.percentile(ratios, [5, 50, 95])
    out = _ctl("plan", "--rho", "0.1", "--window-s", "10", "--trace", str(mooncake_sample))
    assert out.returncode == 0, out.stderr
    assert f"R from {mooncake_sample.name}: 21 windows" in out.stdout
    assert f"R p5 / p50 / p95            = {p5:.1f} / {p50:.1f} / {p95:.1f}" in out.stdout
