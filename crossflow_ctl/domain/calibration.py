"""Fit a node's roofline constants (a :class:`NodeProfile`) to measured kernel timings.

Each sample is one timed kernel call with its analytic FLOPs ``F`` and bytes ``B``. The model is
the capacity model's own per-kernel formula (:func:`crossflow_ctl.domain.capacity.kernel_time_s`,
which the step model sums over its dense, expert and attention kernel groups), plus a per-call
overhead:

    t = max(F*u, B*v) + p * min(F*u, B*v) + c       u = 1/flops_per_s, v = 1/hbm_bytes_per_s

with ``p`` the overlap penalty and ``c`` the fixed overhead. Once it is known which side of the
ridge each sample sits on, ``t`` is linear in ``(u, v, c)`` for a fixed ``p``: a compute-bound
sample gives ``t = F*u + p*B*v + c``, a memory-bound one ``t = p*F*u + B*v + c``. The fit
therefore scans ``p`` over [0, 1] (coarse, then fine) and, for each ``p``, every split of the
samples by arithmetic intensity ``F/B`` (the ridge ``v/u`` is a single threshold), solves a 3x3
weighted least-squares problem by normal equations, scores the candidate with the true max/min
formula and keeps the best. Residuals are relative (rows weighted by ``1/t``) so microsecond and
millisecond samples count alike. The sweep must put timings on both sides of the ridge, or the
constants are not identifiable and the fit refuses. Pure Python: no numpy, so the domain stays
dependency-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated

from pydantic import Field

from crossflow_ctl.domain.capacity import NodeProfile, kernel_time_s
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import Frozen

NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
MIN_SAMPLES = 4
MIN_PER_SIDE = 2
"""Timings needed on each side of the ridge: with all samples compute-bound (or all
memory-bound) the other rate only appears multiplied by the penalty, and the two cannot be told
apart; the fit refuses rather than return a guess."""


class TimingSample(Frozen):
    """One timed kernel call."""

    flops: NonNegative
    bytes_moved: NonNegative
    seconds: Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
    kind: str = ""
    """What was timed (``decode``, ``prefill``, ``mixed``), for reports only."""


class FitReport(Frozen):
    rmse_s: NonNegative
    max_rel_error: NonNegative
    samples: Annotated[int, Field(ge=0)]


class CalibrationFit(Frozen):
    profile: NodeProfile
    fit: FitReport


def roofline_time_s(node: NodeProfile, flops: float, bytes_moved: float) -> float:
    """One timed kernel call: :func:`~crossflow_ctl.domain.capacity.kernel_time_s` plus the
    per-call overhead (the fit's ``step_overhead_s``)."""
    return kernel_time_s(node, flops, bytes_moved) + node.step_overhead_s


def solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (near) singular."""
    n = len(rhs)
    a = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    scale = max((abs(x) for row in matrix for x in row), default=0.0)
    if scale == 0.0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


def _least_squares(rows: list[list[float]], target: list[float]) -> list[float] | None:
    """Minimise ||rows @ x - target|| via normal equations, columns scaled to unit size."""
    cols = len(rows[0])
    scales = [max(abs(r[j]) for r in rows) or 1.0 for j in range(cols)]
    scaled = [[r[j] / scales[j] for j in range(cols)] for r in rows]
    normal = [[sum(r[i] * r[j] for r in scaled) for j in range(cols)] for i in range(cols)]
    rhs = [sum(r[i] * t for r, t in zip(scaled, target, strict=True)) for i in range(cols)]
    x = solve_linear(normal, rhs)
    return None if x is None else [x[j] / scales[j] for j in range(cols)]


def _candidate(
    samples: Sequence[TimingSample], compute_bound: Sequence[bool], penalty: float
) -> tuple[float, float, float] | None:
    """(u, v, c) for one penalty and one regime split, c clamped at 0; None if unphysical."""
    rows: list[list[float]] = []
    target: list[float] = []
    for s, cb in zip(samples, compute_bound, strict=True):
        w = 1.0 / s.seconds
        f, b = (s.flops, penalty * s.bytes_moved) if cb else (penalty * s.flops, s.bytes_moved)
        rows.append([f * w, b * w, w])
        target.append(1.0)
    x = _least_squares(rows, target)
    if x is not None and x[2] < 0.0:
        two = _least_squares([r[:2] for r in rows], target)
        x = None if two is None else [two[0], two[1], 0.0]
    if x is None or x[0] <= 0.0 or x[1] <= 0.0:
        return None
    return x[0], x[1], x[2]


def _score(samples: Sequence[TimingSample], u: float, v: float, c: float, p: float) -> float:
    """Sum of squared relative errors of the true (max/min) formula."""
    total = 0.0
    for s in samples:
        t_c, t_m = s.flops * u, s.bytes_moved * v
        pred = max(t_c, t_m) + p * min(t_c, t_m) + c
        total += ((pred - s.seconds) / s.seconds) ** 2
    return total


def _best_for_penalty(
    samples: Sequence[TimingSample], penalty: float
) -> tuple[float, tuple[float, float, float]] | None:
    order = sorted(range(len(samples)), key=lambda i: _intensity(samples[i]))
    best: tuple[float, tuple[float, float, float]] | None = None
    for split in range(len(samples) + 1):
        compute_bound = [False] * len(samples)
        for i in order[split:]:
            compute_bound[i] = True
        cand = _candidate(samples, compute_bound, penalty)
        if cand is None:
            continue
        score = _score(samples, *cand, penalty)
        if best is None or score < best[0]:
            best = (score, cand)
    return best


def _intensity(s: TimingSample) -> float:
    return s.flops / s.bytes_moved if s.bytes_moved > 0 else math.inf


def fit_node_profile(
    samples: Sequence[TimingSample],
    *,
    name: str,
    network_bytes_per_s: float = 25e9,
) -> CalibrationFit:
    """Least-squares fit of flops_per_s, hbm_bytes_per_s, step_overhead_s and overlap_penalty."""
    if len(samples) < MIN_SAMPLES:
        raise InvalidArgument(f"need at least {MIN_SAMPLES} timings, got {len(samples)}",
                              field="samples")  # fmt: skip
    coarse = [i / 20 for i in range(21)]
    found = [(r, p) for p in coarse if (r := _best_for_penalty(samples, p)) is not None]
    if not found:
        raise InvalidArgument("no physical fit (timings do not grow with work)", field="samples")
    (_, _), p0 = min(found, key=lambda item: item[0][0])
    fine = [min(1.0, max(0.0, p0 + (i - 10) * 0.005)) for i in range(21)]
    found += [(r, p) for p in fine if (r := _best_for_penalty(samples, p)) is not None]
    (_, (u, v, c)), penalty = min(found, key=lambda item: item[0][0])
    compute_bound = sum(1 for s in samples if s.flops * u >= s.bytes_moved * v)
    if min(compute_bound, len(samples) - compute_bound) < MIN_PER_SIDE:
        raise InvalidArgument(
            f"timings do not straddle the roofline ridge ({compute_bound} compute-bound, "
            f"{len(samples) - compute_bound} memory-bound; need {MIN_PER_SIDE} of each): widen "
            "the sweep",
            field="samples",
        )
    profile = NodeProfile(
        name=name,
        flops_per_s=1.0 / u,
        hbm_bytes_per_s=1.0 / v,
        step_overhead_s=min(c, 1.0),
        overlap_penalty=penalty,
        network_bytes_per_s=network_bytes_per_s,
    )
    errors = [roofline_time_s(profile, s.flops, s.bytes_moved) - s.seconds for s in samples]
    report = FitReport(
        rmse_s=math.sqrt(sum(e * e for e in errors) / len(errors)),
        max_rel_error=max(abs(e) / s.seconds for e, s in zip(errors, samples, strict=True)),
        samples=len(samples),
    )
    return CalibrationFit(profile=profile, fit=report)
