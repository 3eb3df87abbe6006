"""``crossflow-agent calibrate``: measure this node's roofline and write a profile file.

It sweeps decode batch, context length and prefill chunk size on the node's device, times three
kernels (paged decode attention, prefill GEMM, and both in one mixed step), pairs each time with
the kernel's analytic FLOPs and bytes (``crossflow_kernels.costs``), fits the capacity model's
constants by least squares (``crossflow_ctl.domain.calibration``), prints the fit error and
writes a version-1 profile (``crossflow_agent.profile``) that ``crossflow-agent run --profile``
reads.

On a CUDA device the kernels are the compiled Triton ones; without a GPU the PyTorch references
run on the CPU (a CPU profile describes the CPU, which is only useful for trying the pipeline).
torch and triton are the optional extra ``crossflow[kernels]`` and are imported only when the
command measures, so the agent installs and starts without them.

The measuring (``crossflow_kernels.sweep``) and the fitting are separable: ``--save-timings``
keeps the raw timings and ``--from-timings`` fits saved ones without torch, e.g. timings taken
by ``kernels/gpu_check.sh`` on a GPU box that lacks pydantic.

The fitted overhead is that of one kernel launch; an engine step launches many kernels and
samples, so ``--step-overhead-s`` writes the engine's own per-step overhead into the profile
instead (the fitted value stays in the file as ``calibration.kernel_overhead_s``).

``--from-telemetry`` needs no GPU, no kernel and no torch: it watches a running engine's
``/metrics`` (``--metrics-url``, ``--source vllm|sglang``) for ``--windows`` windows of
``--window-s`` seconds, fits the step-time constants to them from a prior (``--prior`` preset or
``--prior-profile`` file; :mod:`crossflow_ctl.domain.step_fit`) and writes the fitted profile,
with the fit's error, the prior's and each window, when the fit is accepted (exit 1 when it is
refused: an idle engine, too few busy windows, or an error over the limit). The constants are
fitted for ``--model``: run the agent with the same one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from crossflow_agent.profile import load_profile, profile_document, save_profile
from crossflow_ctl.domain.calibration import CalibrationFit, TimingSample, fit_node_profile
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, ModelSpec
from crossflow_ctl.domain.errors import ConfigError, InvalidArgument

TIMINGS_FORMAT_VERSION = 1
"""The version of ``crossflow_kernels.sweep``'s timings document this module reads and writes."""


@dataclass(frozen=True, slots=True)
class Measured:
    kind: str
    label: str
    sample: TimingSample


CPU_FALLBACK = (
    "--device auto: no CUDA device is visible (torch.cuda.is_available() is false), so this "
    "falls back to cpu: the PyTorch reference kernels timed on this CPU. The profile describes "
    "the CPU, not a GPU; use it only to try the pipeline, never for `crossflow-agent run "
    "--profile` on a GPU node (--device cuda refuses instead of falling back)"
)
"""Said on stderr (also with --json) when ``auto`` finds no GPU."""


def resolve_device(choice: str) -> str:
    try:
        import torch
    except ImportError:
        raise click.ClickException(
            "calibrate needs torch and triton: pip install 'crossflow[kernels]'"
        ) from None
    if choice == "auto":
        if torch.cuda.is_available():
            return "cuda"
        click.echo(CPU_FALLBACK, err=True)
        return "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: no CUDA device is visible")
    return choice


def measure_node(
    *,
    device: str,
    sweep: str,
    dtype: str,
    model: ModelSpec,
    echo: Callable[[str], None],
    save_timings: Path | None = None,
) -> tuple[list[Measured], str, dict[str, Any]]:
    """Run the kernels' sweep, printing each timing; optionally save the raw timings."""
    from crossflow_kernels import sweep as kernel_sweep

    heads = kernel_sweep.Heads(model.q_heads, model.kv_heads, model.head_dim)
    timings = []
    for t in kernel_sweep.run_sweep(kernel_sweep.PLANS[(device, sweep)], device, dtype, heads):
        echo(kernel_sweep.format_timing(t))
        timings.append(t)
    measured = [
        Measured(t.kind, t.label, TimingSample(
            flops=t.flops, bytes_moved=t.bytes_moved, seconds=t.seconds, kind=t.kind))
        for t in timings
    ]  # fmt: skip
    dev_name = kernel_sweep.device_name(device)
    backend = "triton" if device == "cuda" else "torch-reference"
    meta: dict[str, Any] = {"backend": backend, "sweep": sweep, "dtype": dtype,
                            "model": model.name}  # fmt: skip
    if save_timings is not None:
        doc = kernel_sweep.timings_document(timings, dev_name, meta)
        kernel_sweep.write_timings(save_timings, doc)
    return measured, dev_name, meta


def load_timings(path: Path) -> tuple[list[Measured], str, dict[str, Any]]:
    """Read a timings document (written by ``--save-timings`` or ``crossflow_kernels.sweep``)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("version") != TIMINGS_FORMAT_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {TIMINGS_FORMAT_VERSION}")
        measured = [
            Measured(t["kind"], t.get("label", ""), TimingSample(
                flops=t["flops"], bytes_moved=t["bytes_moved"], seconds=t["seconds"], kind=t["kind"]
            ))
            for t in doc["timings"]
        ]  # fmt: skip
        return measured, str(doc.get("device", "unknown")), dict(doc.get("calibration", {}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError) as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint="--from-timings") from None


def profile_extras(fit: CalibrationFit, dev_name: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The keys a calibrated profile carries next to ``version`` and ``profile``."""
    return {
        "device": dev_name,
        "created_unix_ms": int(time.time() * 1000),
        "fit": fit.fit.model_dump(),
        "calibration": meta,
    }


@click.command()
@click.option(
    "--out",
    "out_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default="crossflow-profile.json",
    show_default=True,
    help="Profile file to write (read by `crossflow-agent run --profile`).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="cuda: compiled Triton kernels; cpu: PyTorch references on the CPU; auto: cuda when a "
    "GPU is visible, else cpu (and says so).",
)
@click.option("--sweep", type=click.Choice(["full", "quick"]), default="full", show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option(
    "--model",
    type=click.Choice(sorted(MODEL_PRESETS)),
    help="Kernels: their attention heads and hidden size [llama-3.1-8b]. --from-telemetry: the"
    " model the agent prices with [gpt-oss-120b, the agent's default].",
)
@click.option("--name", help="Profile name (default: the device's name).")
@click.option(
    "--network-bytes-per-s",
    type=click.FloatRange(min=1.0),
    default=25e9,
    show_default=True,
    help="KV transfer bandwidth (not measured here).",
)
@click.option(
    "--step-overhead-s",
    type=click.FloatRange(0.0, 1.0),
    help="Engine per-step overhead to write instead of the fitted per-kernel-call overhead "
    "(an engine step launches many kernels and samples; the fit sees one launch).",
)
@click.option(
    "--engine-like",
    type=click.Choice(sorted(NODE_PRESETS)),
    default="h200",
    show_default=True,
    help="Preset whose engine-side figures the profile takes (host work per step and per "
    "request, GEMM row tile): the kernels do not measure them.",
)
@click.option(
    "--save-timings",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Also write the raw timings (JSON) before fitting.",
)
@click.option(
    "--from-timings",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Fit timings saved earlier instead of measuring (no torch needed).",
)
@click.option(
    "--from-telemetry",
    is_flag=True,
    help="Fit the step-time constants to a running engine's /metrics instead of timing kernels.",
)
@click.option(
    "--metrics-url",
    default="http://127.0.0.1:8000/metrics",
    show_default=True,
    help="--from-telemetry: the engine's Prometheus endpoint.",
)
@click.option(
    "--source",
    type=click.Choice(["vllm", "sglang"]),
    default="vllm",
    show_default=True,
    help="--from-telemetry: the engine's kind.",
)
@click.option(
    "--window-s",
    type=click.FloatRange(0.05, 3600.0),
    default=5.0,
    show_default=True,
    help="--from-telemetry: seconds per window.",
)
@click.option(
    "--windows",
    type=click.IntRange(1, 10_000),
    default=12,
    show_default=True,
    help="--from-telemetry: windows to watch (the engine should be busy, with varied load).",
)
@click.option(
    "--prior",
    type=click.Choice(sorted(NODE_PRESETS)),
    default="h200",
    show_default=True,
    help="--from-telemetry: the preset the fit starts from and pulls toward.",
)
@click.option(
    "--prior-profile",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="--from-telemetry: a profile file to start from instead of --prior.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the written document as JSON.")
def calibrate(
    out_file: Path,
    device: str,
    sweep: str,
    dtype: str,
    model: str | None,
    name: str | None,
    network_bytes_per_s: float,
    step_overhead_s: float | None,
    engine_like: str,
    save_timings: Path | None,
    from_timings: Path | None,
    from_telemetry: bool,
    metrics_url: str,
    source: str,
    window_s: float,
    windows: int,
    prior: str,
    prior_profile: Path | None,
    as_json: bool,
) -> None:
    """Measure this node's roofline (kernels, or --from-telemetry) and write a profile file."""
    echo: Callable[[str], None] = (lambda _line: None) if as_json else click.echo
    if from_telemetry:
        from crossflow_agent.telemetry_calibrate import calibrate_from_telemetry

        try:
            base = load_profile(prior_profile) if prior_profile else NODE_PRESETS[prior]
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--prior-profile") from None
        calibrate_from_telemetry(
            out_file=out_file,
            metrics_url=metrics_url,
            source=source,
            window_s=window_s,
            windows=windows,
            model=MODEL_PRESETS[model or "gpt-oss-120b"],
            prior=base,
            name=name,
            as_json=as_json,
            echo=echo,
        )
        return
    model = model or "llama-3.1-8b"
    if from_timings is not None:
        measured, dev_name, meta = load_timings(from_timings)
        meta = {**meta, "refit_from": str(from_timings)}
        echo(f"fitting {len(measured)} timings from {from_timings} ({dev_name})")
    else:
        dev = resolve_device(device)
        echo(f"calibrating on {dev}, sweep={sweep}, dtype={dtype}, model={model}")
        measured, dev_name, meta = measure_node(
            device=dev, sweep=sweep, dtype=dtype, model=MODEL_PRESETS[model], echo=echo,
            save_timings=save_timings,
        )  # fmt: skip
    meta["kinds"] = {
        k: sum(1 for m in measured if m.kind == k) for k in ("decode", "prefill", "mixed")
    }
    try:
        fit = fit_node_profile(
            [m.sample for m in measured],
            name=name or dev_name,
            network_bytes_per_s=network_bytes_per_s,
        )
    except InvalidArgument as exc:
        raise click.ClickException(f"fit refused: {exc}") from None
    meta["kernel_overhead_s"] = fit.profile.step_overhead_s
    like = NODE_PRESETS[engine_like]
    engine: dict[str, float | int] = {
        "host_step_s": like.host_step_s,
        "host_per_request_s": like.host_per_request_s,
        "gemm_tile_rows": like.gemm_tile_rows,
    }
    if step_overhead_s is not None:
        engine["step_overhead_s"] = step_overhead_s
    meta["engine_like"] = engine_like
    fit = fit.model_copy(update={"profile": fit.profile.model_copy(update=engine)})
    extras = profile_extras(fit, dev_name, meta)
    save_profile(out_file, fit.profile, **extras)
    p, f = fit.profile, fit.fit
    if as_json:
        click.echo(json.dumps(profile_document(p, **extras), indent=2))
        return
    echo(
        f"fit: flops_per_s={p.flops_per_s:.4g} hbm_bytes_per_s={p.hbm_bytes_per_s:.4g} "
        f"step_overhead_s={p.step_overhead_s:.3g} overlap_penalty={p.overlap_penalty:.3f}"
    )
    echo(
        f"fit error: rmse={f.rmse_s * 1e6:.2f} us, max relative error={f.max_rel_error:.1%} "
        f"over {f.samples} timings"
    )
    echo(f"wrote {out_file}")
