"""The calibration sweep: time decode attention, prefill GEMM and the mixed step over a grid.

Each timing carries the kernel call's analytic FLOPs and bytes (``crossflow_kernels.costs``), so
a fit over them yields achieved FLOP/s and bandwidth. The fit itself lives with the capacity model
(``crossflow_ctl.domain.calibration``, run by ``crossflow-agent calibrate``); this module only
measures, and writes the timings document that ``crossflow-agent calibrate --from-timings`` reads:

    {"version": 1, "device": "...", "calibration": {...},
     "timings": [{"kind": "decode|prefill|mixed", "label": "...", "flops": F,
                  "bytes_moved": B, "seconds": t}, ...]}

On CUDA it times the Triton kernels; on the CPU the PyTorch references (with one intra-op thread:
on a shared CPU, spinning worker threads turn a 100 us call into a 50 ms one whenever another
process holds a core). ``python -m crossflow_kernels.sweep --help`` runs it stand-alone.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from crossflow_kernels import costs, reference, workloads
from crossflow_kernels.timing import time_call

TIMINGS_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class SweepPlan:
    """What to time: every decode shape, every chunk, and mixes of the two."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    """Mean context tokens per request (each batch is ragged around it)."""
    chunks: tuple[int, ...]
    """Prefill chunk sizes (GEMM rows)."""
    hidden: int | None
    """GEMM hidden and out size; None takes q_heads * head_dim."""
    max_heads: int | None
    """Cap on query heads (keeps CPU runs short); the GQA ratio is kept."""
    page_size: int
    warmup: int
    repeats: int


PLANS: dict[tuple[str, str], SweepPlan] = {
    # GPU batches start at 16: one program per (request, KV head) and no split over the context,
    # so smaller batches leave most SMs idle, which is not what the roofline describes.
    ("cuda", "full"): SweepPlan((16, 64, 256), (1024, 4096, 16384), (256, 1024, 4096),
                                None, None, 16, 3, 10),
    ("cuda", "quick"): SweepPlan((16, 64), (2048, 8192), (512, 2048), None, None, 16, 2, 5),
    ("cpu", "full"): SweepPlan((1, 4, 16), (256, 1024, 4096), (128, 512), 1024, 8, 16, 2, 7),
    ("cpu", "quick"): SweepPlan((1, 4), (128, 512), (256, 512), 512, 4, 16, 2, 5),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Heads:
    """The attention shape of the served model."""

    q_heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class Timed:
    kind: str
    label: str
    flops: float
    bytes_moved: float
    seconds: float


def ragged(batch: int, mean: int) -> list[int]:
    """Context lengths spread +-50% around ``mean`` (deterministic), summing to batch * mean."""
    if batch == 1:
        return [mean]
    lens = [max(1, round(mean * (0.5 + i / (batch - 1)))) for i in range(batch)]
    lens[-1] = max(1, lens[-1] + batch * mean - sum(lens))
    return lens


def capped(heads: Heads, cap: int | None) -> Heads:
    if cap is None or heads.q_heads <= cap:
        return heads
    group = heads.q_heads // heads.kv_heads
    kv = max(1, cap // group)
    return Heads(kv * group, kv, heads.head_dim)


def run_sweep(plan: SweepPlan, device: str, dtype_name: str, heads: Heads) -> Iterator[Timed]:
    """Time every shape of ``plan`` on ``device``, one timing at a time."""
    ops: Any = reference
    if device == "cuda":
        from crossflow_kernels import triton_ops

        ops = triton_ops
    else:
        torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    dev = torch.device(device)
    h = capped(heads, plan.max_heads)
    hidden = plan.hidden or heads.q_heads * heads.head_dim
    gemms = {p: workloads.gemm_inputs(p, hidden, hidden, dtype=dtype, device=dev, seed=p)
             for p in plan.chunks}  # fmt: skip

    def timed(kind: str, label: str, fn: Callable[[], object], cost: costs.KernelCost) -> Timed:
        t = time_call(fn, dev, warmup=plan.warmup, repeats=plan.repeats)
        return Timed(kind, label, cost.flops, cost.bytes_moved, t.median_s)

    for p, (a, w, shape) in gemms.items():
        gemm = partial(ops.prefill_gemm, a, w)
        yield timed("prefill", f"chunk={p} hidden={hidden}", gemm, costs.gemm_cost(shape))
    for b in plan.batches:
        for c in plan.contexts:
            inp = workloads.attention_inputs(
                ragged(b, c), q_heads=h.q_heads, kv_heads=h.kv_heads, head_dim=h.head_dim,
                page_size=plan.page_size, dtype=dtype, device=dev, seed=b * 7919 + c,
            )  # fmt: skip
            attn_cost = costs.attention_cost(inp.shape, blocks_read=inp.pages_used)
            attn = partial(ops.paged_decode_attention, *inp.args())
            yield timed("decode", f"batch={b} ctx={c}", attn, attn_cost)
            if b == plan.batches[0]:
                continue  # mixes start from the second batch size
            for p, (a, w, shape) in gemms.items():
                mixed = partial(ops.mixed_step, *inp.args(), a, w)
                cost = attn_cost + costs.gemm_cost(shape)
                yield timed("mixed", f"batch={b} ctx={c} chunk={p}", mixed, cost)
            del inp


def device_name(device: str) -> str:
    if device == "cuda":
        return str(torch.cuda.get_device_name(0))
    return f"cpu:{platform.processor() or platform.machine()}"


def timings_document(
    timings: list[Timed], device: str, calibration: dict[str, Any]
) -> dict[str, Any]:
    return {
        "version": TIMINGS_FORMAT_VERSION,
        "device": device,
        "calibration": calibration,
        "timings": [asdict(t) for t in timings],
    }


def write_timings(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def format_timing(t: Timed) -> str:
    return (
        f"{t.kind:8s} {t.label:32s} {t.seconds * 1e6:11.1f} us "
        f"{t.bytes_moved / t.seconds / 1e9:9.2f} GB/s {t.flops / t.seconds / 1e12:9.4f} TFLOP/s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--sweep", choices=["full", "quick"], default="quick")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True, help="timings JSON to write")
    args = parser.parse_args(argv)
    heads = Heads(args.q_heads, args.kv_heads, args.head_dim)
    timings = []
    for t in run_sweep(PLANS[(args.device, args.sweep)], args.device, args.dtype, heads):
        print(format_timing(t), flush=True)
        timings.append(t)
    backend = "triton" if args.device == "cuda" else "torch-reference"
    meta = {"backend": backend, "sweep": args.sweep, "dtype": args.dtype, **asdict(heads)}
    write_timings(args.out, timings_document(timings, device_name(args.device), meta))
    print(f"wrote {len(timings)} timings to {args.out}")


if __name__ == "__main__":
    main()
