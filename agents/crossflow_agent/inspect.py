"""``crossflow-agent inspect``: one look at what the agent sees and would publish.

With ``calibration_windows`` > 0 it watches that many windows of the engine's telemetry first,
fits the step-time constants to them (:mod:`crossflow_agent.telemetry_fit`), shows them beside
the prior's with both errors, and prices the lease with the fit when the fit is accepted (what
the running agent converges to)."""

from __future__ import annotations

import asyncio
from typing import Any

from crossflow_agent.runner import build_source, resolve_model
from crossflow_agent.settings import AgentSettings
from crossflow_agent.sources.base import ScrapeError
from crossflow_agent.telemetry_fit import fit_report, render_fit, watch
from crossflow_ctl.domain.capacity import StepShape, prefill_rate_tps, roofline, step_time_s
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.leasing import ItlGuard, decide, pool_load
from crossflow_ctl.domain.models import NodeRole
from crossflow_ctl.domain.step_fit import FitStatus, fit_step_constants
from crossflow_ctl.domain.telemetry import EngineSnapshot

PREDICTION_CHUNKS = (0, 512, 2048, 8192)


async def inspect_once(
    settings: AgentSettings, *, window_s: float, calibration_windows: int = 0
) -> dict[str, Any]:
    """Scrape (twice, ``window_s`` apart, when > 0; ``calibration_windows + 1`` times with
    calibration), then apply the lease rules once."""
    model, prior = resolve_model(settings)
    node = prior
    source = build_source(settings, model, node)
    clock = SystemClock()
    snapshot: EngineSnapshot | None = None
    failure = ""
    calibration: dict[str, Any] | None = None
    try:
        if calibration_windows > 0 and window_s > 0:
            seen = await watch(
                source,
                windows=calibration_windows,
                window_s=window_s,
                settings=settings.calibration,
            )
            snapshot, failure = seen.snapshot, seen.failure
            fit = fit_step_constants(model, prior, seen.windows, settings.calibration.fit)
            calibration = fit_report(model, prior, fit, seen.windows)
            if not seen.counted:
                calibration["detail"] = f"the {source.name} source reads no step counters"
            if fit.status is FitStatus.FITTED:
                node = fit.profile
        else:
            if window_s > 0:
                await source.scrape()
                await asyncio.sleep(window_s)
            snapshot = await source.scrape()
    except ScrapeError as exc:
        failure = f"{exc.kind}: {exc}"
    finally:
        await source.aclose()
    now_ms = clock.now_ms()
    report: dict[str, Any] = {
        "settings": {
            "node_id": settings.node_id,
            "role": settings.role.value,
            "source": settings.source.value,
            "metrics_url": settings.metrics_url,
            "lease": settings.lease.model_dump(mode="json"),
        },
        "model": model.model_dump(),
        "node": node.model_dump(),
        "prior": prior.model_dump(),
        "calibration": calibration,
        "snapshot": None if snapshot is None else snapshot.model_dump(),
        "failure": failure,
    }
    if snapshot is not None:
        report["predictions"] = [
            {
                "batch": snapshot.running_requests,
                "context_tokens": snapshot.decode_context_tokens,
                "prefill_tokens": p,
                "step_ms": 1000
                * step_time_s(
                    model,
                    node,
                    StepShape(
                        batch=snapshot.running_requests,
                        context_tokens=snapshot.decode_context_tokens,
                        prefill_tokens=p,
                    ),
                ),
            }
            for p in PREDICTION_CHUNKS
        ]
    if settings.role is NodeRole.PREFILL:
        load = pool_load(
            snapshot,
            now_ms=now_ms,
            node_id=settings.node_id,
            pool=settings.pool,
            ttl_ms=settings.ttl_ms,
            settings=settings.lease,
            modelled_rate_tps=prefill_rate_tps(model, node, settings.lease.prefill_chunk_tokens),
            roof=roofline(model, node),
        )
        report["pool_load"] = None if load is None else load.model_dump()
        return report
    decision = decide(
        snapshot,
        now_ms=now_ms,
        model=model,
        node=node,
        settings=settings.lease,
        guard=ItlGuard(),
        failure=failure,
    )
    lease = decision.to_lease(
        node_id=settings.node_id, epoch=now_ms, version=1, ttl_ms=settings.ttl_ms, last_notice_seq=0
    )
    report["lease"] = lease.model_dump(mode="json")
    if decision.capacity is not None:
        report["arithmetic"] = decision.capacity.explain(settings.lease)
        report["capacity"] = decision.capacity.as_dict()
    return report


def render_text(report: dict[str, Any]) -> str:
    lines = [
        f"node {report['settings']['node_id']} ({report['settings']['role']}),"
        f" source {report['settings']['source']}"
    ]
    snap = report.get("snapshot")
    if snap is None:
        lines.append(f"scrape failed: {report['failure']}")
    else:
        lines.append("snapshot:")
        lines += [f"  {k} = {v}" for k, v in snap.items()]
    cal = report.get("calibration")
    if cal is None:
        lines.append(
            "step-time constants: the prior's (--calibration-windows N fits them to the engine's"
            " telemetry first)"
        )
    else:
        lines += render_fit(cal)
        lines.append(
            "  leases below are priced with the "
            + ("fitted constants" if cal["status"] == "fitted" else "prior (fit refused)")
        )
    if snap is not None:
        lines.append(
            f"step-time predictions ({report['model']['name']} on {report['node']['name']}):"
        )
        lines += [
            f"  t(B={p['batch']}, C={p['context_tokens']}, P={p['prefill_tokens']})"
            f" = {p['step_ms']:.2f} ms"
            for p in report.get("predictions", [])
        ]
    if "pool_load" in report:
        lines.append(f"pool load: {report['pool_load']}")
        return "\n".join(lines)
    if report.get("arithmetic"):
        lines.append("arithmetic:")
        lines += [f"  {a}" for a in report["arithmetic"]]
    lease = report["lease"]
    reason = lease["zero_reason"]
    lines.append("lease:" + (f" ZERO ({reason}: {lease['zero_detail']})" if reason else ""))
    lines += [f"  {k} = {v}" for k, v in lease["credits"].items()]
    lines.append(
        f"  queue_wait_ms = {lease['queue_wait_ms']:.1f},"
        f" borrowed_prefill_rate_tps = {lease['borrowed_prefill_rate_tps']:.0f},"
        f" itl_ms = {lease['itl_ms']:.1f} (slo {lease['itl_slo_ms']:g})"
    )
    return "\n".join(lines)
