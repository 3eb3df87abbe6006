"""Fit a node's step-time constants to its engine's own telemetry (online calibration).

The observations are :class:`~crossflow_ctl.domain.step_windows.StepWindow` values (what an
engine's counters say its steps did between two scrapes): a decode batch B, a context C, a mix
of steps with and without a prefill chunk, and the measured mean step time y (the mean ITL).

**What is fitted.** The capacity model prices each kind of step of a window
(:meth:`Roofline.groups`, which takes fractional shapes) as ``max(gpu, host)`` with
``gpu = sum_g max(F_g u, M_g v) + p min(F_g u, M_g v)`` over its dense, expert and attention
groups and ``host = h + r n`` (n: requests in the step), weights them by their share of the
steps and adds ``c``. Five constants of the :class:`~crossflow_ctl.domain.capacity.NodeProfile`
are fitted; the overlap penalty p and the tile rows stay the prior's:

==========  ====================================================  =====================
constant    role                                                  NodeProfile field
==========  ====================================================  =====================
u           per-token cost, decode and prefill (GEMM FLOPs)       1 / flops_per_s
v           context term and weight reads (HBM bytes)             1 / hbm_bytes_per_s
c           fixed cost per step                                   step_overhead_s
h           host work per step (overlaps the GPU)                 host_step_s
r           host work per request in the step                     host_per_request_s
==========  ====================================================  =====================

The constants are effective ones: they make the served :class:`ModelSpec`'s FLOPs and bytes take
the time the engine takes, so a model spec that is not quite the served model is absorbed too
(for the shapes the windows covered).

**How.** Ridge-regularised least squares toward the prior, in log space: with
``theta_k = base_k * exp(s_k)`` (``base``: the prior, or a floor where the prior is 0), minimise

    sum_i w_i ((pred_i - y_i) / y_i)^2 + prior_weight * sum_k s_k^2

by Levenberg-Marquardt, started from the prior and from a warm start (the calibrator's current
constants), keeping the better. The prediction is piecewise linear in theta (linear within one
regime of each max), so each Gauss-Newton step is exact within its regime. Residuals are relative
(a 10 ms and a 1 s step count alike); in log space a prior 1000x off costs the ridge
``prior_weight * 47``, not a million, so a wrong preset can be left behind, while directions
the windows do not see stay at the prior. Several starts (the prior, the prior scaled to the
windows' median, each with the host work out of the way, and the warm start) because the max()
kinks make local minima. ``w_i`` grows with the window's engine steps up to 1.

**Guards** (this module's; the online loop adds bounded change per period, idle windows and the
fall-back, :mod:`crossflow_ctl.domain.online_calibration`):

* *evidence*: the prediction is homogeneous of degree 1 in theta, so a window's shares
  ``theta_k * dpred/dtheta_k / pred`` sum to 1. A constant moves only when, at the prior or at
  the fit, its shares add up to ``min_evidence`` windows' worth of step time; the others keep the
  prior's exact value (an engine that never prefills says nothing of ``u`` beyond decode's GEMMs);
* *quality*: the fit's relative RMS error over its windows, beside the prior's; a fit worse than
  ``max_error`` is refused, as is one from fewer than ``min_windows`` windows.

**Approximations** (stated, not hidden). Within a window the decode batch and context are taken
as constant (their means); where the engine exports no step-size histogram (SGLang) the mix is a
guess (steps with no prefill and steps with a ``chunk_tokens`` chunk). vLLM counts a prompt's
tokens when its first token comes, not chunk by chunk, so a long prompt's chunks show as one big
step and a few decode steps, and a window shorter than a prefill sees its prompts late; SGLang
counts no steps at all (``steps`` is then the output tokens over the mean running batch). The
attended prefix of a chunk is the mean cached prefix (chunks after a long prompt's first see
more). KV capacity is read (``vllm:cache_config_info``, ``sglang:max_total_num_tokens``), not
fitted: the windows carry it for the report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import Field

from crossflow_ctl.domain.calibration import solve_linear
from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, Roofline
from crossflow_ctl.domain.models import Frozen
from crossflow_ctl.domain.step_windows import StepWindow

NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]

CONSTANTS: tuple[str, ...] = (
    "flops_per_s",
    "hbm_bytes_per_s",
    "step_overhead_s",
    "host_step_s",
    "host_per_request_s",
)
"""The NodeProfile fields the fit moves, in the order of theta = (u, v, c, h, r)."""
_INVERSE = (True, True, False, False, False)
"""theta_k is 1 / field for the rates, the field itself for the times."""
_FLOOR = (1e-19, 1e-16, 1e-6, 1e-6, 1e-8)
"""Where a prior of 0 starts from (theta units)."""
_LOW = (1e-19, 1e-16, 0.0, 0.0, 0.0)
_HIGH = (1e-6, 1e-3, 1.0, 1.0, 0.1)
"""theta's bounds: 1 MFLOP/s .. 1e19 FLOP/s, 1 kB/s .. 1e16 B/s, and the NodeProfile's own
bounds of the times."""
_MAX_STEP = 2.0
"""Largest change of one s_k in one Levenberg-Marquardt step (a factor e^2)."""


class FitSettings(Frozen):
    """The fit's guards and its pull toward the prior."""

    prior_weight: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] = 0.002
    """The ridge: cost of moving one constant by a factor e, in squared relative errors of one
    window (0.002: one window 4.5% off costs as much as a constant moved e-fold, and a preset
    1000x off, ln(1000)^2 x 0.002 = 0.1 a constant, yields to a dozen windows that say so: at
    0.005 the 13 windows of a CPU engine fitted from the h200 preset settled for a GPU-bound
    answer 8% off with the HBM rate left at the preset's)."""
    min_windows: Annotated[int, Field(ge=1, le=10_000)] = 3
    min_evidence: Annotated[float, Field(ge=0.0, le=10_000.0, allow_inf_nan=False)] = 1.0
    """Windows' worth of step time a constant must explain before it moves (a window counts
    its weight: see ``full_weight_steps``)."""
    max_error: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 0.25
    """Largest relative RMS error of an accepted fit over its windows."""
    full_weight_steps: Annotated[float, Field(gt=0.0, le=1e9, allow_inf_nan=False)] = 32.0
    """A window's weight is its engine steps over this, at most 1: its mean step time is a mean
    over steps (a step's tokens share its time), so fewer steps, a noisier mean."""


class FitStatus(StrEnum):
    FITTED = "fitted"
    TOO_FEW_WINDOWS = "too_few_windows"
    NO_EVIDENCE = "no_evidence"
    """No constant has the evidence to move: the prior stands."""
    POOR_FIT = "poor_fit"


class StepFit(Frozen):
    """A fit's answer: the profile (the prior where refused), its error and the prior's."""

    status: FitStatus
    profile: NodeProfile
    """The fitted constants in the prior's profile (the prior itself unless FITTED)."""
    error: NonNegative
    """Relative RMS error of ``profile`` over the windows (0 with none)."""
    prior_error: NonNegative
    windows: Annotated[int, Field(ge=0)]
    moved: tuple[str, ...] = ()
    """The constants that had the evidence to move (NodeProfile field names)."""
    evidence: dict[str, float] = Field(default_factory=dict)
    """Windows' worth of step time each constant explains (the larger of prior and fit)."""
    detail: str = ""


def constants_of(profile: NodeProfile) -> dict[str, float]:
    """The fitted constants of ``profile`` by NodeProfile field name."""
    return {name: float(getattr(profile, name)) for name in CONSTANTS}


def _theta(profile: NodeProfile) -> list[float]:
    values = constants_of(profile)
    return [
        1.0 / values[n] if inv else values[n] for n, inv in zip(CONSTANTS, _INVERSE, strict=True)
    ]


def with_theta(prior: NodeProfile, theta: Sequence[float], name: str) -> NodeProfile:
    """``prior`` with the five constants of ``theta`` (clamped into their bounds)."""
    update: dict[str, float | str] = {"name": name}
    for k, (field, inv) in enumerate(zip(CONSTANTS, _INVERSE, strict=True)):
        t = min(_HIGH[k], max(_LOW[k], theta[k]))
        update[field] = 1.0 / t if inv else t
    return prior.model_copy(update=update)


@dataclass(frozen=True, slots=True)
class _Part:
    """One kind of step of a window: its share of the steps, FLOPs and bytes per kernel group,
    and the requests its host work counts."""

    share: float
    groups: tuple[tuple[float, float], ...]
    requests: float


@dataclass(frozen=True, slots=True)
class _Row:
    parts: tuple[_Part, ...]
    y: float
    w: float


def _rows(
    model: ModelSpec, prior: NodeProfile, windows: Sequence[StepWindow], full_weight: float
) -> list[_Row]:
    roof = Roofline.of(model, prior)
    rows = []
    for win in windows:
        if win.itl_s <= 0 or win.steps <= 0:
            continue
        batch, context = win.batch, win.context_tokens
        parts = tuple(
            _Part(
                share,
                roof.groups(batch, context, chunk, win.prefix_tokens if chunk else 0.0),
                batch + (1.0 if chunk > 0 else 0.0),
            )
            for share, chunk in win.steps_mix()
            if share > 0
        )
        weight = min(1.0, win.steps / full_weight)
        rows.append(_Row(parts, win.itl_s, weight))
    return rows


def _predict(row: _Row, theta: Sequence[float], penalty: float) -> tuple[float, list[float]]:
    """The row's predicted mean step time and its gradient in theta: each kind of step priced
    on the roofline, weighted by its share of the steps."""
    u, v, c, h, r = theta
    total, grad = c, [0.0, 0.0, 1.0, 0.0, 0.0]
    for part in row.parts:
        gpu = du = dv = 0.0
        for f, m in part.groups:
            tc, tm = f * u, m * v
            if tc >= tm:
                gpu += tc + penalty * tm
                du += f
                dv += penalty * m
            else:
                gpu += tm + penalty * tc
                du += penalty * f
                dv += m
        host = h + r * part.requests
        w = part.share
        if gpu >= host:
            total += w * gpu
            grad[0] += w * du
            grad[1] += w * dv
        else:
            total += w * host
            grad[3] += w
            grad[4] += w * part.requests
    return total, grad


def _shares(rows: Sequence[_Row], theta: Sequence[float], penalty: float) -> list[float]:
    """Windows' worth of step time each constant explains at ``theta``."""
    out = [0.0] * len(theta)
    for row in rows:
        pred, grad = _predict(row, theta, penalty)
        if pred <= 0:
            continue
        for k, g in enumerate(grad):
            out[k] += row.w * theta[k] * g / pred
    return out


def _error(rows: Sequence[_Row], theta: Sequence[float], penalty: float) -> float:
    total = sum(row.w for row in rows)
    if total <= 0:
        return 0.0
    sq = sum(row.w * ((_predict(row, theta, penalty)[0] - row.y) / row.y) ** 2 for row in rows)
    return math.sqrt(sq / total)


class _Problem:
    """The ridge objective over the free constants, in log space around ``base``."""

    def __init__(
        self,
        rows: Sequence[_Row],
        base: Sequence[float],
        free: Sequence[int],
        penalty: float,
        weight: float,
    ) -> None:
        self.rows, self.base, self.free = rows, base, free
        self.penalty, self.weight = penalty, weight
        self.lo = [math.log(_LOW[k] / base[k]) if _LOW[k] > 0 else -50.0 for k in range(5)]
        self.hi = [math.log(_HIGH[k] / base[k]) for k in range(5)]

    def theta(self, s: Sequence[float]) -> list[float]:
        return [b * math.exp(x) for b, x in zip(self.base, s, strict=True)]

    def cost(self, s: Sequence[float]) -> float:
        theta = self.theta(s)
        data = sum(
            row.w * ((_predict(row, theta, self.penalty)[0] - row.y) / row.y) ** 2
            for row in self.rows
        )
        return data + self.weight * sum(s[k] ** 2 for k in self.free)

    def clamp(self, s: list[float]) -> list[float]:
        return [min(self.hi[k], max(self.lo[k], x)) for k, x in enumerate(s)]

    def normal(self, s: Sequence[float]) -> tuple[list[list[float]], list[float]]:
        """Gauss-Newton's J'WJ + ridge and J'Wr + ridge gradient over the free constants."""
        free, n = self.free, len(self.free)
        theta = self.theta(s)
        jtj = [[0.0] * n for _ in range(n)]
        jtr = [0.0] * n
        for row in self.rows:
            pred, grad = _predict(row, theta, self.penalty)
            res = (pred - row.y) / row.y
            jac = [theta[k] * grad[k] / row.y for k in free]
            for a in range(n):
                jtr[a] += row.w * jac[a] * res
                for b in range(a, n):
                    jtj[a][b] += row.w * jac[a] * jac[b]
        for a in range(n):
            jtr[a] += self.weight * s[free[a]]
            jtj[a][a] += self.weight
            for b in range(a):
                jtj[a][b] = jtj[b][a]
        return jtj, jtr

    def solve(self, start: Sequence[float], iterations: int = 80) -> list[float]:
        """Levenberg-Marquardt from ``start`` (projected into the bounds)."""
        free = self.free
        s = self.clamp(list(start))
        cost = self.cost(s)
        mu = 1e-3
        n = len(free)
        for _ in range(iterations):
            jtj, jtr = self.normal(s)
            improved = False
            for _ in range(12):
                damped = [
                    [jtj[a][b] + (mu * jtj[a][a] if a == b else 0.0) for b in range(n)]
                    for a in range(n)
                ]
                step = solve_linear(damped, [-g for g in jtr])
                if step is None:
                    mu *= 10.0
                    continue
                trial = list(s)
                for a, k in enumerate(free):
                    trial[k] += max(-_MAX_STEP, min(_MAX_STEP, step[a]))
                trial = self.clamp(trial)
                trial_cost = self.cost(trial)
                if trial_cost < cost:
                    moved = max(abs(t - x) for t, x in zip(trial, s, strict=True))
                    s, cost, improved = trial, trial_cost, True
                    mu = max(1e-9, mu / 4.0)
                    if moved < 1e-7:
                        return s
                    break
                mu *= 8.0
            if not improved:
                break
        return s


GRID = tuple(math.log(10.0) * k for k in range(-3, 4))
"""Log-shifts of the two rates the coarse search tries (0.001x to 1000x the prior)."""


def _starts(
    problem: _Problem, rows: Sequence[_Row], prior_theta: Sequence[float], start: NodeProfile | None
) -> list[list[float]]:
    """Where Levenberg-Marquardt starts: the max() kinks make local minima, and the regime a
    start puts each window in decides which one it finds. The prior; the prior scaled as a whole
    to the windows' median ratio of measured to predicted step time; the warm start; and the two
    best points of a coarse grid over the two rates (factors of 10 either way, the times scaled
    as a whole, the host work at the scale or out of the way)."""
    n, base = len(CONSTANTS), problem.base
    ratios = sorted(
        row.y / p for row in rows if (p := _predict(row, prior_theta, problem.penalty)[0]) > 0
    )
    scale = math.log(ratios[len(ratios) // 2]) if ratios else 0.0
    host_off = math.log(_FLOOR[3] / base[3])
    out = [[0.0] * n, [scale] * n]
    if start is not None:
        warm = zip(_theta(start), _FLOOR, base, strict=True)
        out.append([math.log(max(t, f) / b) for t, f, b in warm])
    grid = [[u, v, scale, h, scale] for u in GRID for v in GRID for h in (scale, host_off)]
    out += sorted(grid, key=problem.cost)[:2]
    return out


def fit_step_constants(
    model: ModelSpec,
    prior: NodeProfile,
    windows: Sequence[StepWindow],
    settings: FitSettings | None = None,
    *,
    start: NodeProfile | None = None,
    name: str | None = None,
) -> StepFit:
    """Fit the five step-time constants of ``prior`` to ``windows`` (see the module doc).

    ``start``: a warm start (the calibrator's current constants), tried beside the prior.
    ``name``: the fitted profile's name (default ``"<prior>+telemetry"``)."""
    settings = settings or FitSettings()
    rows = _rows(model, prior, windows, settings.full_weight_steps)
    penalty = prior.overlap_penalty
    prior_theta = _theta(prior)
    prior_error = _error(rows, prior_theta, penalty)

    def refused(
        status: FitStatus, detail: str, evidence: dict[str, float] | None = None
    ) -> StepFit:
        return StepFit(
            status=status,
            profile=prior,
            error=prior_error,
            prior_error=prior_error,
            windows=len(rows),
            evidence=evidence or {},
            detail=detail,
        )

    if len(rows) < settings.min_windows:
        return refused(
            FitStatus.TOO_FEW_WINDOWS, f"{len(rows)} busy windows, need {settings.min_windows}"
        )
    base = [max(t, floor) for t, floor in zip(prior_theta, _FLOOR, strict=True)]
    everything = list(range(len(CONSTANTS)))
    problem = _Problem(rows, base, everything, penalty, settings.prior_weight)
    starts = _starts(problem, rows, prior_theta, start)
    s = min((problem.solve(x) for x in starts), key=problem.cost)
    at_prior = _shares(rows, prior_theta, penalty)
    at_fit = _shares(rows, problem.theta(s), penalty)
    evidence = {n: max(a, b) for n, a, b in zip(CONSTANTS, at_prior, at_fit, strict=True)}
    free = [k for k, n in enumerate(CONSTANTS) if evidence[n] >= settings.min_evidence]
    if not free:
        return refused(FitStatus.NO_EVIDENCE, "no constant explains enough step time", evidence)
    if len(free) < len(CONSTANTS):  # the rest keep the prior's exact values
        problem = _Problem(rows, base, free, penalty, settings.prior_weight)
        held = [x if k in free else 0.0 for k, x in enumerate(s)]
        again = [[x if k in free else 0.0 for k, x in enumerate(t)] for t in starts]
        s = min((problem.solve(x) for x in (held, *again)), key=problem.cost)
    theta = [problem.theta(s)[k] if k in free else prior_theta[k] for k in everything]
    fitted = with_theta(prior, theta, name or f"{prior.name}+telemetry")
    error = _error(rows, _theta(fitted), penalty)
    moved = tuple(CONSTANTS[k] for k in free)
    if error > settings.max_error:
        return StepFit(
            status=FitStatus.POOR_FIT,
            profile=prior,
            error=error,
            prior_error=prior_error,
            windows=len(rows),
            moved=moved,
            evidence=evidence,
            detail=f"fit error {error:.1%} over {settings.max_error:.0%}",
        )
    return StepFit(
        status=FitStatus.FITTED,
        profile=fitted,
        error=error,
        prior_error=prior_error,
        windows=len(rows),
        moved=moved,
        evidence=evidence,
    )


def predicted_step_s(model: ModelSpec, node: NodeProfile, window: StepWindow) -> float:
    """The window's mean step as ``node`` prices it (what the fit holds against ``itl_s``)."""
    rows = _rows(model, node, [window.model_copy(update={"itl_s": 1.0})], 1.0)
    if not rows:
        return 0.0
    return _predict(rows[0], _theta(node), node.overlap_penalty)[0]
