"""``crossflow-agent calibrate --from-telemetry``: fit a profile to a running engine's ``/metrics``.

It watches the engine for a number of windows (:func:`crossflow_agent.telemetry_fit.watch`),
fits the step-time constants from the prior (:func:`~crossflow_ctl.domain.step_fit.
fit_step_constants`), prints the constants beside the prior's with both errors, and writes the
fitted profile as a version-1 profile file (``crossflow_agent.profile``) that ``crossflow-agent
run --profile`` reads (and the agent's online calibration then starts from). A refused fit
writes nothing and exits 1.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from crossflow_agent.profile import profile_document, save_profile
from crossflow_agent.telemetry_fit import fit_report, render_fit, telemetry_source, watch
from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile
from crossflow_ctl.domain.online_calibration import CalibrationSettings
from crossflow_ctl.domain.step_fit import FitStatus, fit_step_constants
from crossflow_ctl.domain.step_windows import StepWindow


def calibrate_from_telemetry(
    *,
    out_file: Path,
    metrics_url: str,
    source: str,
    window_s: float,
    windows: int,
    model: ModelSpec,
    prior: NodeProfile,
    name: str | None,
    as_json: bool,
    echo: Callable[[str], None],
    settings: CalibrationSettings | None = None,
) -> dict[str, Any]:
    """Watch, fit, print and write (see the module doc); returns the document written."""
    settings = settings or CalibrationSettings()
    echo(
        f"watching {metrics_url} ({source}) for {windows} windows of {window_s:g} s;"
        f" prior {prior.name}, model {model.name}"
    )

    def said(i: int, window: StepWindow | None) -> None:
        if window is None:
            echo(f"  window {i}: no counters (restarted, or not told)")
        else:
            echo(
                f"  window {i}: {window.steps:.0f} steps, batch {window.batch:.1f},"
                f" prefill {window.chunk:.0f}/step, mean step {window.itl_s * 1000:.2f} ms"
            )

    async def run() -> Any:
        src = telemetry_source(source, metrics_url)
        try:
            return await watch(
                src, windows=windows, window_s=window_s, settings=settings, on_window=said
            )
        finally:
            await src.aclose()

    seen = asyncio.run(run())
    if seen.failure:
        raise click.ClickException(f"scrape failed: {seen.failure}")
    fit = fit_step_constants(
        model, prior, seen.windows, settings.fit, name=name or f"{prior.name}+telemetry"
    )
    report = fit_report(model, prior, fit, seen.windows)
    for line in render_fit(report):
        echo(line)
    if fit.status is not FitStatus.FITTED:
        raise click.ClickException(
            f"fit refused ({fit.status.value}): {fit.detail}; no file written"
        )
    extras = {
        "created_unix_ms": int(time.time() * 1000),
        "fit": report,
        "calibration": {
            "method": "telemetry",
            "metrics_url": metrics_url,
            "source": source,
            "model": model.name,
            "prior": prior.model_dump(),
            "windows": windows,
            "window_s": window_s,
        },
    }
    save_profile(out_file, fit.profile, **extras)
    document = profile_document(fit.profile, **extras)
    if as_json:
        click.echo(json.dumps(document, indent=2))
    else:
        echo(f"wrote {out_file}")
    return document
