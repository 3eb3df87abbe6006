"""The online calibration's guards: bounded change per period, idle windows, fall-back to the
prior (refused fits, windows aged out), and convergence counted in periods, never in time."""

from __future__ import annotations

import math
import random

import pytest

from crossflow_ctl.domain.online_calibration import (
    CalibrationSettings,
    OnlineCalibrator,
    Using,
    toward,
)
from crossflow_ctl.domain.step_fit import CONSTANTS, FitStatus, predicted_step_s
from crossflow_ctl.domain.step_windows import StepTotals, StepWindow
from tests.domain.test_step_fit import BUCKETS, MODEL, PRIOR, TRUTH, varied_windows


def moved_at_most(before: object, after: object, factor: float) -> bool:
    for name in CONSTANTS:
        a, b = float(getattr(before, name)), float(getattr(after, name))
        if a == b:
            continue
        if a <= 0 or b <= 0:
            if max(a, b) > 1e-6 * factor:
                return False
            continue
        if not 1 / factor - 1e-12 <= b / a <= factor + 1e-12:
            return False
    return True


def test_constants_move_toward_the_fit_at_most_a_factor_a_period() -> None:
    cal = OnlineCalibrator(MODEL, PRIOR, CalibrationSettings(max_step_ratio=1.5))
    windows = varied_windows(TRUTH, 0)
    converged_at = None
    for period, win in enumerate(windows, start=1):
        before = cal.profile
        assert cal.add(win, at_s=5.0 * period)
        cal.update(5.0 * period)
        assert moved_at_most(before, cal.profile, 1.5)
        if converged_at is None and cal.state().using is Using.FITTED:
            converged_at = period
    assert converged_at is not None
    # 3 windows before the first fit, then ln(2.8)/ln(1.5) = 2.5 periods for the farthest constant
    assert converged_at <= 10
    state = cal.state()
    assert state.fit is not None and state.fit.status is FitStatus.FITTED
    assert state.periods == len(windows)
    for name in ("flops_per_s", "hbm_bytes_per_s"):
        assert getattr(cal.profile, name) / getattr(TRUTH, name) == pytest.approx(1.0, abs=0.12)


def test_an_idle_engine_stays_on_its_prior() -> None:
    cal = OnlineCalibrator(MODEL, PRIOR)
    idle = StepWindow(
        window_s=5, steps=2, decode_tokens=2, prefill_tokens=0, context_tokens=0,
        prefix_tokens=0, itl_s=0.01, itl_count=2,
    )  # fmt: skip
    for period in range(1, 20):
        assert not cal.add(idle, at_s=5.0 * period)
        assert not cal.add(None, at_s=5.0 * period)  # a broken window (counter reset)
        cal.update(5.0 * period)
        assert cal.profile is PRIOR
    state = cal.state()
    assert state.using is Using.PRIOR
    assert state.idle_windows == 38 and state.windows == 0
    assert state.fit is not None and state.fit.status is FitStatus.TOO_FEW_WINDOWS


def converged(settings: CalibrationSettings | None = None) -> OnlineCalibrator:
    cal = OnlineCalibrator(MODEL, PRIOR, settings)
    for period, win in enumerate(varied_windows(TRUTH, 1), start=1):
        cal.add(win, at_s=5.0 * period)
        cal.update(5.0 * period)
    assert cal.state().using is Using.FITTED
    return cal


def test_windows_age_out_and_the_prior_comes_back() -> None:
    cal = converged(CalibrationSettings(max_age_s=600.0))
    first, last = cal.windows[0][0], cal.windows[-1][0]
    cal.update(first + 599.0)  # idle since, but every window is recent enough
    assert cal.state().using is Using.FITTED
    cal.update(last + 601.0)  # every window older than max_age_s
    state = cal.state()
    assert state.windows == 0
    assert state.using is Using.PRIOR and cal.profile is PRIOR


def test_a_poor_fit_falls_back_to_the_prior_at_once() -> None:
    cal = converged(CalibrationSettings(max_windows=30))
    rng = random.Random(3)
    t = cal.windows[-1][0]
    for win in varied_windows(TRUTH, 2):  # the engine turns erratic
        t += 5.0
        cal.add(win.model_copy(update={"itl_s": rng.uniform(0.001, 1.0)}), at_s=t)
        cal.update(t)
        if cal.last_fit is not None and cal.last_fit.status is FitStatus.POOR_FIT:
            break
    assert cal.last_fit is not None and cal.last_fit.status is FitStatus.POOR_FIT
    assert cal.profile is PRIOR


def test_without_new_windows_the_last_fit_stands_and_the_move_goes_on() -> None:
    cal = OnlineCalibrator(MODEL, PRIOR, CalibrationSettings(max_step_ratio=1.1))
    windows = varied_windows(TRUTH, 4)
    for period, win in enumerate(windows, start=1):
        cal.add(win, at_s=float(period))
    cal.update(float(len(windows)))
    fit = cal.last_fit
    assert fit is not None and cal.state().using is Using.MOVING
    for k in range(1, 40):
        cal.update(len(windows) + float(k))
        assert cal.last_fit is fit  # not refitted: nothing changed
    assert cal.state().using is Using.FITTED


def test_toward_bounds_each_constant_and_handles_zero() -> None:
    a = PRIOR.model_copy(update={"host_step_s": 0.0, "flops_per_s": 1e14})
    b = PRIOR.model_copy(update={"name": "b", "host_step_s": 0.01, "flops_per_s": 1e15})
    c = toward(a, b, 2.0)
    assert c.flops_per_s == pytest.approx(2e14)
    assert c.host_step_s == pytest.approx(2e-6)  # up from 0 via the floor
    assert c.name == "b"
    assert toward(b, b, 2.0) is b
    down = toward(b.model_copy(update={"host_step_s": 1.5e-6}), a, 2.0)
    assert down.host_step_s == 0.0  # below the floor it lands on the target


# -- the totals stream, as the agent feeds it ---------------------------------------------------


def as_seen(windows: list[StepWindow]) -> list[StepWindow]:
    """``windows`` with each one's step time the truth's at the shape the calibrator will see:
    its context is the mean of the two scrapes at its ends (the previous window's context and its
    own), and no prompt count tells a prefix."""
    out, before = [], windows[0].context_tokens
    for w in windows:
        seen = w.model_copy(update={"context_tokens": (before + w.context_tokens) / 2,
                                    "prefix_tokens": 0.0})  # fmt: skip
        ratio = w.itl_s / predicted_step_s(MODEL, TRUTH, w)  # keep the window's noise
        out.append(w.model_copy(update={"itl_s": predicted_step_s(MODEL, TRUTH, seen) * ratio}))
        before = w.context_tokens
    return out


def totals_stream(windows: list[StepWindow], window_s: float, scrapes_per_window: int = 4):
    """Cumulative counters an engine running ``windows`` one after the other would export,
    scraped ``scrapes_per_window`` times a window (vLLM-like: with the step-size histogram)."""
    cum = {"steps": 0.0, "decode_tokens": 0.0, "itl_sum_s": 0.0, "itl_count": 0.0,
           "prefill_tokens": 0.0, "step_tokens_sum": 0.0}  # fmt: skip
    buckets = [0.0] * len(BUCKETS)
    t = 0.0
    yield StepTotals(
        at_s=t,
        context_tokens=windows[0].context_tokens,
        step_token_buckets=tuple((float(b), 0.0) for b in BUCKETS),
        **cum,
    )
    for w in windows:
        for _ in range(scrapes_per_window):
            part = 1.0 / scrapes_per_window
            steps = w.steps * part
            cum["steps"] += steps
            cum["decode_tokens"] += w.decode_tokens * part
            cum["itl_sum_s"] += w.decode_tokens * part * w.itl_s
            cum["itl_count"] += w.decode_tokens * part
            cum["prefill_tokens"] += w.prefill_tokens * part
            for share, chunk in w.steps_mix():
                tokens = w.batch + chunk
                cum["step_tokens_sum"] += steps * share * tokens
                i = next(k for k, b in enumerate(BUCKETS) if tokens <= b)
                buckets[i] += steps * share
            t += window_s * part
            cumulative = tuple((float(b), sum(buckets[: k + 1])) for k, b in enumerate(BUCKETS))
            yield StepTotals(
                at_s=t,
                running_requests=w.batch,
                context_tokens=w.context_tokens,
                kv_total_tokens=1e6,
                step_token_buckets=cumulative,
                **cum,
            )


def test_observe_closes_a_window_every_window_s_of_scrapes() -> None:
    windows = as_seen(varied_windows(TRUTH, 6, n=12))
    cal = OnlineCalibrator(MODEL, PRIOR, CalibrationSettings(window_s=5.0))
    periods = sum(1 for totals in totals_stream(windows, 5.0) if cal.observe(totals))
    assert periods == 12
    state = cal.state()
    assert state.periods == 12 and state.windows == 12
    assert state.fit is not None and state.fit.status is FitStatus.FITTED
    assert math.isclose(cal.profile.flops_per_s / TRUTH.flops_per_s, 1.0, abs_tol=0.12)
    assert cal.observe(None) is False
