"""Capacity planning (DESIGN.md §1): how much of a P/D fleet prefill needs, with and without leases.

Pure arithmetic. With R = uncached input tokens / output tokens and
rho = decode per-token throughput / prefill per-token throughput of one server, the share of the
fleet prefill needs is

    f(R) = rho*R / (1 + rho*R)

Static sizing covers each pool's own peak: prefill at f(R_p95), decode at 1 - f(R_p5), so
``static purchase = f(p95) + 1 - f(p5)``. With leases prefill is sized at its median and borrows
the rest from decode at its peaks, decode keeps its own peak: ``leased = f(p50) + 1 - f(p5)``.
At any instant the work needs 100 % of one fleet-share, so the *idle points* are
``purchase - 100 %`` and the *stranded capacity* is ``idle / purchase``.

Percent figures are returned as fractions (0.5 = 50 %); the CLI formats them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated

from pydantic import Field

from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, StepShape, step_time_s
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import Frozen

Ratio = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


def prefill_share(rho: float, ratio: float) -> float:
    """f = rho R / (1 + rho R): the share of the fleet prefill needs at ratio R."""
    if not (math.isfinite(rho) and rho > 0):
        raise InvalidArgument("rho must be a positive finite number", field="rho")
    if not (math.isfinite(ratio) and ratio >= 0):
        raise InvalidArgument("R must be a non-negative finite number", field="r")
    x = rho * ratio
    return x / (1.0 + x)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of ``values``, as numpy's default does."""
    if not values:
        raise InvalidArgument("no values to take a percentile of", field="values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class SizingPlan(Frozen):
    """The planner's answer for one rho and one R distribution (fractions, not percent)."""

    rho: Ratio
    r_p5: Ratio
    r_p50: Ratio
    r_p95: Ratio
    f_p5: float
    f_p50: float
    f_p95: float
    static_purchase: float
    """f(p95) + 1 - f(p5): each pool bought for its own peak."""
    leased_purchase: float
    """f(p50) + 1 - f(p5): prefill at its median, decode at its own peak."""
    static_idle_points: float
    leased_idle_points: float
    static_stranded: float
    """Idle share of what static sizing buys."""
    leased_stranded: float
    borrow_need_points: float
    """What prefill lacks at its p95 with leases: f(p95) - f(p50)."""
    decode_free_points: float
    """What decode has free when prefill peaks (R at p95): f(p95) - f(p5)."""

    @property
    def leases_cover_peak(self) -> bool:
        """Whether decode's free room at the prefill peak covers what prefill must borrow."""
        return self.decode_free_points + 1e-12 >= self.borrow_need_points


def plan_sizing(rho: float, r_p5: float, r_p50: float, r_p95: float) -> SizingPlan:
    """The purchase, idle points and stranded capacity, static and with leases."""
    if not r_p5 <= r_p50 <= r_p95:
        raise InvalidArgument("need R p5 <= p50 <= p95", field="r_p50")
    f5, f50, f95 = (prefill_share(rho, r) for r in (r_p5, r_p50, r_p95))
    static = f95 + 1.0 - f5
    leased = f50 + 1.0 - f5
    return SizingPlan(
        rho=rho,
        r_p5=r_p5,
        r_p50=r_p50,
        r_p95=r_p95,
        f_p5=f5,
        f_p50=f50,
        f_p95=f95,
        static_purchase=static,
        leased_purchase=leased,
        static_idle_points=static - 1.0,
        leased_idle_points=leased - 1.0,
        static_stranded=(static - 1.0) / static,
        leased_stranded=(leased - 1.0) / leased,
        borrow_need_points=f95 - f50,
        decode_free_points=f95 - f5,
    )


def plan_from_ratios(rho: float, ratios: Sequence[float]) -> SizingPlan:
    """Plan from R measured per window (e.g. per minute of a trace)."""
    finite = [r for r in ratios if math.isfinite(r) and r >= 0]
    if not finite:
        raise InvalidArgument("no window has output tokens, R is undefined", field="ratios")
    return plan_sizing(rho, percentile(finite, 5), percentile(finite, 50), percentile(finite, 95))


class SplitAdvice(Frozen):
    fleet_nodes: int
    static_prefill_nodes: int
    """Static: prefill's share of the two peaks, f(p95) / static purchase."""
    leased_prefill_nodes: int
    """Leases: prefill at its median share f(p50); peaks borrow from decode."""

    def label(self, prefill_nodes: int) -> str:
        return f"{prefill_nodes}P{self.fleet_nodes - prefill_nodes}D"


def recommend_split(plan: SizingPlan, fleet_nodes: int) -> SplitAdvice:
    """Prefill node counts for a fleet of ``fleet_nodes`` (at least one server per pool)."""
    if fleet_nodes < 2:
        raise InvalidArgument("a P/D fleet needs at least 2 nodes", field="fleet_nodes")

    def clamp(x: float) -> int:
        return max(1, min(fleet_nodes - 1, round(x)))

    return SplitAdvice(
        fleet_nodes=fleet_nodes,
        static_prefill_nodes=clamp(fleet_nodes * plan.f_p95 / plan.static_purchase),
        leased_prefill_nodes=clamp(fleet_nodes * plan.f_p50),
    )


# -- rho from the capacity model --------------------------------------------------------------


class RhoEstimate(Frozen):
    rho: float
    decode_tps: float
    """Output tokens/s of one decode server at the reference batch and context."""
    prefill_tps: float
    """Uncached prompt tokens/s of one prefill server at the reference chunk."""
    decode_batch: int
    context_tokens: int
    prefill_chunk_tokens: int


def rho_from_model(
    model: ModelSpec,
    node: NodeProfile,
    *,
    decode_batch: int = 64,
    context_tokens: int = 8192,
    prefill_chunk_tokens: int = 8192,
    cached_prefix_tokens: int = 0,
) -> RhoEstimate:
    """rho = decode throughput / prefill throughput of one server, from the roofline model."""
    decode_s = step_time_s(
        model,
        node,
        StepShape(batch=decode_batch, context_tokens=decode_batch * context_tokens),
    )
    prefill_s = step_time_s(
        model,
        node,
        StepShape(prefill_tokens=prefill_chunk_tokens, prefix_tokens=cached_prefix_tokens),
    )
    decode_tps = decode_batch / decode_s
    prefill_tps = prefill_chunk_tokens / prefill_s
    return RhoEstimate(
        rho=decode_tps / prefill_tps,
        decode_tps=decode_tps,
        prefill_tps=prefill_tps,
        decode_batch=decode_batch,
        context_tokens=context_tokens,
        prefill_chunk_tokens=prefill_chunk_tokens,
    )
