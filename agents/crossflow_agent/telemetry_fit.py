"""Fit the step-time constants from a few windows of an engine's telemetry, and say how.

Shared by ``crossflow-agent inspect --calibration-windows N`` (shows the fitted constants beside
the prior's and prices the lease with them) and ``crossflow-agent calibrate --from-telemetry``
(writes them as a profile file). The agent itself calibrates continuously
(:class:`~crossflow_ctl.domain.online_calibration.OnlineCalibrator`); these take one fit of the
windows they watched, without the per-period bound.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from crossflow_agent.sources.base import ScrapeError, StepCounting, TelemetrySource
from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile
from crossflow_ctl.domain.online_calibration import CalibrationSettings
from crossflow_ctl.domain.step_fit import CONSTANTS, StepFit, predicted_step_s
from crossflow_ctl.domain.step_windows import StepTotals, StepWindow, step_window
from crossflow_ctl.domain.telemetry import EngineSnapshot


@dataclass
class Watched:
    """What :func:`watch` saw: the windows (idle ones included), the last snapshot, and why a
    scrape failed ("" if none did)."""

    windows: list[StepWindow]
    snapshot: EngineSnapshot | None
    failure: str = ""
    counted: bool = True
    """Whether the source reads step counters at all."""


async def watch(
    source: TelemetrySource,
    *,
    windows: int,
    window_s: float,
    settings: CalibrationSettings,
    on_window: Any = None,
) -> Watched:
    """Scrape ``windows + 1`` times ``window_s`` apart; each pair of step counters is a window.
    ``on_window(i, window)`` is called as each one closes (None: idle or broken)."""
    seen: list[StepWindow] = []
    snapshot: EngineSnapshot | None = None
    before: StepTotals | None = None
    counted = isinstance(source, StepCounting)
    try:
        for i in range(windows + 1):
            if i:
                await asyncio.sleep(window_s)
            snapshot = await source.scrape()
            now = source.step_totals() if isinstance(source, StepCounting) else None
            if before is not None and now is not None:
                win = step_window(before, now, chunk_tokens=settings.chunk_tokens)
                if win is not None and busy(win, settings):
                    seen.append(win)
                if on_window is not None:
                    on_window(i, win)
            before = now if now is not None else before
    except ScrapeError as exc:
        return Watched(seen, None, f"{exc.kind}: {exc}", counted)
    return Watched(seen, snapshot, "", counted)


def busy(window: StepWindow, settings: CalibrationSettings) -> bool:
    """Whether a window is an observation (the calibrator's idle rule)."""
    return (
        window.steps >= max(settings.min_steps, 1e-9)
        and window.itl_count >= settings.min_tokens
        and window.itl_s > 0
    )


def fit_report(
    model: ModelSpec, prior: NodeProfile, fit: StepFit, windows: list[StepWindow]
) -> dict[str, Any]:
    """The fit as JSON-ready values: each constant's prior and fitted value, the errors, the
    evidence, and each window's measured and predicted mean step."""
    return {
        "status": fit.status.value,
        "detail": fit.detail,
        "windows": fit.windows,
        "error": fit.error,
        "prior_error": fit.prior_error,
        "moved": list(fit.moved),
        "constants": {
            name: {
                "prior": getattr(prior, name),
                "fitted": getattr(fit.profile, name),
                "evidence": fit.evidence.get(name, 0.0),
            }
            for name in CONSTANTS
        },
        "kv_total_tokens": windows[-1].kv_total_tokens if windows else None,
        "observations": [
            {
                "batch": w.batch,
                "context_tokens": w.context_tokens,
                "prefill_tokens_per_step": w.chunk,
                "steps": w.steps,
                "measured_step_ms": w.itl_s * 1000,
                "prior_step_ms": predicted_step_s(model, prior, w) * 1000,
                "fitted_step_ms": predicted_step_s(model, fit.profile, w) * 1000,
                "engine_flops_per_step": w.engine_flops_per_step,
            }
            for w in windows
        ],
    }


def render_fit(report: dict[str, Any]) -> list[str]:
    """The fit report as text lines."""
    status = report["status"] + (f" ({report['detail']})" if report["detail"] else "")
    lines = [
        f"step-time fit from {report['windows']} busy windows: {status}",
        f"  error (relative RMS of the mean step): prior {report['prior_error']:.1%},"
        f" fitted {report['error']:.1%}",
        f"  {'constant':<20} {'prior':>12} {'fitted':>12} {'evidence':>9}",
    ]
    for name, c in report["constants"].items():
        mark = "" if name in report["moved"] else "  (held at the prior)"
        lines.append(
            f"  {name:<20} {c['prior']:>12.4g} {c['fitted']:>12.4g} {c['evidence']:>9.2f}{mark}"
        )
    if report.get("kv_total_tokens") is not None:
        lines.append(f"  kv_total_tokens (read from the engine) = {report['kv_total_tokens']:.0f}")
    obs = report["observations"]
    if obs:
        lines.append("  windows: B, C, prefill/step -> measured / prior / fitted step ms")
        for o in obs:
            shape = (
                f"B={o['batch']:.1f} C={o['context_tokens']:.0f}"
                f" P={o['prefill_tokens_per_step']:.0f}"
            )
            times = (
                f"{o['measured_step_ms']:.2f} / {o['prior_step_ms']:.2f}"
                f" / {o['fitted_step_ms']:.2f}"
            )
            lines.append(f"    {shape} -> {times}")
    return lines


def telemetry_source(kind: str, metrics_url: str, timeout_s: float = 1.0) -> TelemetrySource:
    """A vLLM or SGLang ``/metrics`` source for a one-off fit."""
    from crossflow_agent.sources.http import PrometheusSource
    from crossflow_agent.sources.sglang import SGLangReader
    from crossflow_agent.sources.vllm import VLLMReader

    reader = VLLMReader() if kind == "vllm" else SGLangReader()
    return PrometheusSource(metrics_url, reader, timeout_s=timeout_s)
