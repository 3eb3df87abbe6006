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
command runs, so the agent installs and starts without them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from crossflow_agent.profile import save_profile
from crossflow_ctl.domain.calibration import CalibrationFit, TimingSample, fit_node_profile
from crossflow_ctl.domain.capacity import MODEL_PRESETS, ModelSpec
from crossflow_ctl.domain.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class SweepPlan:
    """What to time: every decode shape, every chunk, and mixes of the two."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    """Context tokens per request (each batch is ragged around this mean)."""
    chunks: tuple[int, ...]
    """Prefill chunk sizes (GEMM rows)."""
    hidden: int | None
    """GEMM hidden and out size; None takes q_heads * head_dim of the model."""
    max_heads: int | None
    """Cap on query heads (keeps CPU runs short); the GQA ratio is kept."""
    page_size: int
    warmup: int
    repeats: int


PLANS: dict[tuple[str, str], SweepPlan] = {
    ("cuda", "full"): SweepPlan((1, 8, 32, 128), (512, 4096, 16384), (256, 1024, 4096),
                                None, None, 16, 3, 10),
    ("cuda", "quick"): SweepPlan((1, 16, 64), (1024, 8192), (256, 2048), None, None, 16, 2, 5),
    ("cpu", "full"): SweepPlan((1, 4, 16), (256, 1024, 4096), (128, 512), 1024, 8, 16, 2, 7),
    ("cpu", "quick"): SweepPlan((1, 4), (128, 512), (256, 512), 512, 4, 16, 2, 5),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Measured:
    kind: str
    label: str
    sample: TimingSample


def _ragged(batch: int, mean: int) -> list[int]:
    """Context lengths spread +-50% around ``mean`` (deterministic), summing to batch * mean."""
    if batch == 1:
        return [mean]
    lens = [max(1, round(mean * (0.5 + i / (batch - 1)))) for i in range(batch)]
    lens[-1] += batch * mean - sum(lens)
    return [max(1, n) for n in lens]


def _heads(model: ModelSpec, cap: int | None) -> tuple[int, int]:
    q, kv = model.q_heads, model.kv_heads
    if cap is not None and q > cap:
        kv = max(1, kv * cap // q)
        q = kv * (model.q_heads // model.kv_heads)
    return q, kv


def run_sweep(
    plan: SweepPlan, device: str, dtype_name: str, model: ModelSpec
) -> Iterator[Measured]:
    """Time every shape of ``plan`` on ``device`` (lazy torch/kernels imports)."""
    import torch

    from crossflow_kernels import costs, reference, workloads
    from crossflow_kernels.timing import time_call

    ops: Any = reference
    if device == "cuda":
        from crossflow_kernels import triton_ops

        ops = triton_ops
    else:
        # One intra-op thread: on a shared CPU, spinning worker threads turn a 100 us call into
        # a 50 ms one whenever another process holds a core, and the fit would chase that.
        torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    dev = torch.device(device)
    q_heads, kv_heads = _heads(model, plan.max_heads)
    hidden = plan.hidden or model.q_heads * model.head_dim
    attn_inputs = {
        (b, c): workloads.attention_inputs(
            _ragged(b, c), q_heads=q_heads, kv_heads=kv_heads, head_dim=model.head_dim,
            page_size=plan.page_size, dtype=dtype, device=dev, seed=b * 7919 + c,
        )
        for b in plan.batches
        for c in plan.contexts
    }  # fmt: skip
    gemms = {p: workloads.gemm_inputs(p, hidden, hidden, dtype=dtype, device=dev, seed=p)
             for p in plan.chunks}  # fmt: skip

    def attn_cost(inp: workloads.AttentionInputs) -> costs.KernelCost:
        return costs.attention_cost(inp.shape, blocks_read=inp.pages_used)

    def timed(kind: str, label: str, fn: Callable[[], object], cost: costs.KernelCost) -> Measured:
        t = time_call(fn, dev, warmup=plan.warmup, repeats=plan.repeats)
        sample = TimingSample(
            flops=cost.flops, bytes_moved=cost.bytes_moved, seconds=t.median_s, kind=kind
        )
        return Measured(kind, label, sample)

    for (b, c), inp in attn_inputs.items():
        attn = partial(ops.paged_decode_attention, *inp.args())
        yield timed("decode", f"batch={b} ctx={c}", attn, attn_cost(inp))
    for p, (a, w, shape) in gemms.items():
        gemm = partial(ops.prefill_gemm, a, w)
        yield timed("prefill", f"chunk={p} hidden={hidden}", gemm, costs.gemm_cost(shape))
    for b in plan.batches[1:]:
        for c in plan.contexts:
            inp = attn_inputs[(b, c)]
            for p, (a, w, shape) in gemms.items():
                mixed = partial(ops.mixed_step, *inp.args(), a, w)
                cost = attn_cost(inp) + costs.gemm_cost(shape)
                yield timed("mixed", f"batch={b} ctx={c} chunk={p}", mixed, cost)


def device_name(device: str) -> str:
    import platform

    import torch

    if device == "cuda":
        return str(torch.cuda.get_device_name(0))
    return f"cpu:{platform.processor() or platform.machine()}"


def resolve_device(choice: str) -> str:
    try:
        import torch
    except ImportError:
        raise click.ClickException(
            "calibrate needs torch and triton: pip install 'crossflow[kernels]'"
        ) from None
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: no CUDA device is visible")
    return choice


TIMINGS_FORMAT_VERSION = 1


def measure_node(
    *, device: str, sweep: str, dtype: str, model: ModelSpec, echo: Callable[[str], None]
) -> tuple[list[Measured], str]:
    """Run the sweep, printing each timing with its achieved rates."""
    measured: list[Measured] = []
    for m in run_sweep(PLANS[(device, sweep)], device, dtype, model):
        measured.append(m)
        s = m.sample
        echo(
            f"{m.kind:8s} {m.label:32s} {s.seconds * 1e6:11.1f} us "
            f"{s.bytes_moved / s.seconds / 1e9:9.2f} GB/s {s.flops / s.seconds / 1e12:9.4f} TFLOP/s"
        )
    return measured, device_name(device)


def save_timings_file(
    path: Path, measured: list[Measured], dev_name: str, meta: dict[str, Any]
) -> None:
    """Raw timings, so a profile can be re-fitted later (``--from-timings``) without the GPU."""
    doc = {
        "version": TIMINGS_FORMAT_VERSION,
        "device": dev_name,
        "calibration": meta,
        "timings": [{"label": m.label, **m.sample.model_dump()} for m in measured],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def load_timings(path: Path) -> tuple[list[Measured], str, dict[str, Any]]:
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
    help="cuda: compiled Triton kernels; cpu: PyTorch references.",
)
@click.option("--sweep", type=click.Choice(["full", "quick"]), default="full", show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option(
    "--model",
    type=click.Choice(sorted(MODEL_PRESETS)),
    default="llama-3.1-8b",
    show_default=True,
    help="Attention heads and hidden size of the kernels.",
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
    "--save-timings",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Also write the raw timings (JSON) before fitting.",
)
@click.option(
    "--from-timings",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Fit timings saved earlier instead of measuring (no torch needed).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the written document as JSON.")
def calibrate(
    out_file: Path,
    device: str,
    sweep: str,
    dtype: str,
    model: str,
    name: str | None,
    network_bytes_per_s: float,
    step_overhead_s: float | None,
    save_timings: Path | None,
    from_timings: Path | None,
    as_json: bool,
) -> None:
    """Measure this node's roofline with the kernels and write a versioned profile file."""
    echo: Callable[[str], None] = (lambda _line: None) if as_json else click.echo
    if from_timings is not None:
        measured, dev_name, meta = load_timings(from_timings)
        meta = {**meta, "refit_from": str(from_timings)}
        echo(f"fitting {len(measured)} timings from {from_timings} ({dev_name})")
    else:
        dev = resolve_device(device)
        backend = "triton" if dev == "cuda" else "torch-reference"
        echo(f"calibrating on {dev} ({backend}), sweep={sweep}, dtype={dtype}, model={model}")
        measured, dev_name = measure_node(
            device=dev, sweep=sweep, dtype=dtype, model=MODEL_PRESETS[model], echo=echo
        )
        meta = {"backend": backend, "sweep": sweep, "dtype": dtype, "model": model}
        if save_timings is not None:
            save_timings_file(save_timings, measured, dev_name, meta)
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
    if step_overhead_s is not None:
        fit = fit.model_copy(
            update={"profile": fit.profile.model_copy(update={"step_overhead_s": step_overhead_s})}
        )
    extras = profile_extras(fit, dev_name, meta)
    save_profile(out_file, fit.profile, **extras)
    p, f = fit.profile, fit.fit
    if as_json:
        click.echo(json.dumps({"profile": p.model_dump(), **extras}, indent=2))
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
