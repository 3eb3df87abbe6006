"""The agent's online calibration: the step-time constants follow the engine, under guards.

Pure state, fed by the caller (the agent every period, the simulator's agents every tick): each
scrape's :class:`~crossflow_ctl.domain.step_fit.StepTotals` go to :meth:`OnlineCalibrator.observe`;
every ``window_s`` of them close a window (:func:`~crossflow_ctl.domain.step_fit.step_window`)
and run one **calibration period**:

1. the window joins the retained ones, unless it is idle (fewer than ``min_steps`` steps or
   ``min_tokens`` ITL samples: an idle engine says nothing of its speed) or broken (a counter
   went back); windows older than ``max_age_s`` and beyond the last ``max_windows`` leave;
2. the constants are fitted to the retained windows, warm-started from the current ones
   (:func:`~crossflow_ctl.domain.step_fit.fit_step_constants`, with its evidence and quality
   guards); when nothing changed (no window came or left) the last fit stands;
3. **bounded change**: each constant moves toward the fit by at most a factor
   ``max_step_ratio`` per period, so one odd window cannot swing a lease;
4. **fall-back**: when the fit is refused (too few busy windows, none with evidence, or its
   error over ``max_error``) the constants return to the prior at once: the prior is what the
   operator chose, and a poor fit is no better a guess. An engine idle for ``max_age_s`` has
   no windows left, so it is back on its prior too.

:attr:`OnlineCalibrator.profile` is the profile the lease is computed with; the broker and the
simulator's broker see only the lease, as without calibration.
"""

from __future__ import annotations

import math
from collections import deque
from enum import StrEnum
from typing import Annotated

from pydantic import Field, field_validator

from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile
from crossflow_ctl.domain.models import Frozen
from crossflow_ctl.domain.step_fit import (
    CONSTANTS,
    FitSettings,
    FitStatus,
    NonNegative,
    StepFit,
    constants_of,
    fit_step_constants,
)
from crossflow_ctl.domain.step_windows import (
    DEFAULT_CHUNK_TOKENS,
    StepTotals,
    StepWindow,
    step_window,
)

TINY = 1e-6
"""A time constant at 0 moves up from here, and one moving down below it becomes 0."""


class CalibrationSettings(Frozen):
    """Online calibration of the step-time constants (the agent's ``calibration`` settings)."""

    enabled: bool = True
    """Fit the constants to the engine's telemetry; false: the prior (preset or profile file)
    prices every lease."""
    window_s: Annotated[float, Field(gt=0.0, le=3600.0, allow_inf_nan=False)] = 5.0
    """Length of one window, and of one calibration period."""
    max_windows: Annotated[int, Field(ge=1, le=10_000)] = 60
    max_age_s: Annotated[float, Field(gt=0.0, le=7 * 86_400.0, allow_inf_nan=False)] = 1800.0
    """Windows older than this leave the fit (an engine idle that long is back on its prior)."""
    min_steps: Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)] = 8.0
    min_tokens: Annotated[float, Field(ge=1.0, le=1e9, allow_inf_nan=False)] = 16.0
    """A window with fewer engine steps or ITL samples is idle: not an observation."""
    chunk_tokens: Annotated[int, Field(gt=0, le=1_048_576)] = DEFAULT_CHUNK_TOKENS
    """The prefill chunk a step with prefill is taken to carry when the engine exports no
    tokens-per-step histogram (SGLang: set its ``chunked_prefill_size``)."""
    max_step_ratio: Annotated[float, Field(gt=1.0, le=1000.0, allow_inf_nan=False)] = 2.0
    """The most one constant changes in one period (a factor, up or down)."""
    fit: FitSettings = FitSettings()


class Using(StrEnum):
    PRIOR = "prior"
    MOVING = "moving"
    """On the way from where it was to the fit (bounded change)."""
    FITTED = "fitted"


class CalibrationState(Frozen):
    """Where the calibration stands (for ``inspect``, the agent's metrics and tests)."""

    using: Using
    prior: NodeProfile
    active: NodeProfile
    """The profile leases are computed with now."""
    fit: StepFit | None
    """The last fit (None before the first period)."""
    periods: Annotated[int, Field(ge=0)]
    windows: Annotated[int, Field(ge=0)]
    """Busy windows retained."""
    idle_windows: Annotated[int, Field(ge=0)]
    """Windows dropped as idle or broken so far."""


MAX_DETAIL = 512


Constants = Annotated[dict[str, float], Field(max_length=len(CONSTANTS))]


class StepModelReport(Frozen):
    """What an agent tells the broker of its calibration (``StepModel`` on the wire), for
    ``crossflowctl describe node``: fitted against prior constants and the fit's error. The
    broker stores the latest per node; admission never reads it."""

    using: Using
    fit_status: FitStatus | None = None
    """None before the first period."""
    fit_error: NonNegative = 0.0
    prior_error: NonNegative = 0.0
    windows: Annotated[int, Field(ge=0, lt=2**31)] = 0
    periods: Annotated[int, Field(ge=0, lt=2**63)] = 0
    prior_name: Annotated[str, Field(max_length=256)] = ""
    prior: Constants = Field(default_factory=dict)
    fitted: Constants = Field(default_factory=dict)
    active: Constants = Field(default_factory=dict)
    detail: Annotated[str, Field(max_length=MAX_DETAIL)] = ""
    at_unix_ms: Annotated[int, Field(ge=0, lt=2**63)] = 0

    @field_validator("prior", "fitted", "active")
    @classmethod
    def _known_constants(cls, values: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(values) - set(CONSTANTS))
        if unknown:
            raise ValueError(f"unknown constant(s) {', '.join(unknown)}")
        for name, value in values.items():
            if not math.isfinite(value) or value < 0.0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        return values

    @classmethod
    def of(cls, state: CalibrationState, at_unix_ms: int) -> StepModelReport:
        fit = state.fit
        return cls(
            using=state.using,
            fit_status=None if fit is None else fit.status,
            fit_error=0.0 if fit is None else fit.error,
            prior_error=0.0 if fit is None else fit.prior_error,
            windows=state.windows,
            periods=state.periods,
            prior_name=state.prior.name[:256],
            prior=constants_of(state.prior),
            fitted=constants_of(fit.profile) if fit is not None else {},
            active=constants_of(state.active),
            detail=("" if fit is None else fit.detail)[:MAX_DETAIL],
            at_unix_ms=at_unix_ms,
        )


def toward(active: NodeProfile, target: NodeProfile, ratio: float) -> NodeProfile:
    """``active`` with each fitted constant moved toward ``target``'s by at most ``ratio``
    (a factor); the target's other fields and name. ``active`` itself when nothing moves."""
    update: dict[str, float | str] = {}
    for name in CONSTANTS:
        a, t = float(getattr(active, name)), float(getattr(target, name))
        if a == t:
            continue
        if t > a:
            new = min(t, max(a, TINY) * ratio)
        else:
            new = max(t, a / ratio)
            if new < TINY:
                new = t
        update[name] = new
    if not update and active.name == target.name:
        return active
    others = {f: getattr(target, f) for f in type(target).model_fields if f not in CONSTANTS}
    return active.model_copy(update={**others, **update})


def same_constants(a: NodeProfile, b: NodeProfile) -> bool:
    return all(getattr(a, n) == getattr(b, n) for n in CONSTANTS)


class OnlineCalibrator:
    """One node's online calibration (see the module doc). Times are the caller's monotonic
    seconds (the totals' ``at_s``)."""

    def __init__(
        self, model: ModelSpec, prior: NodeProfile, settings: CalibrationSettings | None = None
    ) -> None:
        self.model = model
        self.prior = prior
        self.settings = settings or CalibrationSettings()
        self.active = prior
        self.windows: deque[tuple[float, StepWindow]] = deque(maxlen=self.settings.max_windows)
        self.periods = 0
        self.idle_windows = 0
        self.last_fit: StepFit | None = None
        self._boundary: StepTotals | None = None
        self._stale = True
        """Whether the retained windows changed since the last fit."""

    @property
    def profile(self) -> NodeProfile:
        """The profile to price leases with now."""
        return self.active

    def closes(self, totals: StepTotals | None) -> bool:
        """Whether :meth:`observe` of ``totals`` would close a window (and fit: the caller may
        run that call off its event loop)."""
        start = self._boundary
        return (
            totals is not None
            and start is not None
            and totals.at_s - start.at_s >= self.settings.window_s
        )

    def observe(self, totals: StepTotals | None) -> bool:
        """One scrape's totals (None: the scrape failed or told none). True when it closed a
        window and ran a calibration period."""
        if totals is None:
            return False
        start = self._boundary
        if start is None or totals.at_s < start.at_s:
            self._boundary = totals
            return False
        if totals.at_s - start.at_s < self.settings.window_s:
            return False
        self._boundary = totals
        self.add(step_window(start, totals, chunk_tokens=self.settings.chunk_tokens), totals.at_s)
        self.update(totals.at_s)
        return True

    def add(self, window: StepWindow | None, at_s: float) -> bool:
        """Retain ``window`` (ended at ``at_s``) unless it is idle or broken."""
        s = self.settings
        if (
            window is None
            or window.steps < max(s.min_steps, 1e-9)
            or window.itl_count < s.min_tokens
            or window.itl_s <= 0.0
        ):
            self.idle_windows += 1
            return False
        self.windows.append((at_s, window))
        self._stale = True
        return True

    def update(self, now_s: float) -> StepFit:
        """One calibration period: age the windows out, fit when they changed, move the
        constants toward the fit (bounded) or back to the prior (refused)."""
        self.periods += 1
        cutoff = now_s - self.settings.max_age_s
        while self.windows and self.windows[0][0] < cutoff:
            self.windows.popleft()
            self._stale = True
        fit = self.last_fit
        if fit is None or self._stale:
            fit = fit_step_constants(
                self.model,
                self.prior,
                [w for _, w in self.windows],
                self.settings.fit,
                start=self.active,
            )
            self.last_fit, self._stale = fit, False
        if fit.status is FitStatus.FITTED:
            self.active = toward(self.active, fit.profile, self.settings.max_step_ratio)
        else:
            self.active = self.prior
        return fit

    def state(self) -> CalibrationState:
        fit = self.last_fit
        if self.active is self.prior or same_constants(self.active, self.prior):
            using = Using.PRIOR
        elif fit is not None and same_constants(self.active, fit.profile):
            using = Using.FITTED
        else:
            using = Using.MOVING
        return CalibrationState(
            using=using,
            prior=self.prior,
            active=self.active,
            fit=fit,
            periods=self.periods,
            windows=len(self.windows),
            idle_windows=self.idle_windows,
        )
