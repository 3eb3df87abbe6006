"""Time each Triton kernel against its PyTorch reference; report achieved rates and peak shares.

``python -m crossflow_kernels.bench --out results.json`` on a CUDA machine (the GPU check runs
it). Each row gives the kernel's and the reference's median time, the speed-up, the largest
difference between their outputs, and the achieved bandwidth and FLOP/s (analytic bytes and
FLOPs over the Triton time) as a share of the peaks given (an H200 by default: 4.8 TB/s HBM and
~990 dense bf16 TFLOP/s). The mixed step is also compared with its two halves run one after the
other, which shows how much the one-launch overlap saves. ``--small`` runs tiny shapes (on the
CPU under ``TRITON_INTERPRET=1`` too, to check the harness itself, not to time anything).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from crossflow_kernels import costs, reference, triton_ops, workloads
from crossflow_kernels.sweep import device_name, ragged
from crossflow_kernels.timing import time_call

H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 989e12


@dataclass(frozen=True, slots=True)
class Row:
    kernel: str
    shape: str
    triton_s: float
    reference_s: float
    speedup: float
    max_abs_diff: float
    bytes_per_s: float
    flops_per_s: float
    hbm_share: float
    flops_share: float


@dataclass(frozen=True, slots=True)
class Case:
    batch: int
    context: int
    chunk: int
    hidden: int


GPU_CASES = (Case(64, 4096, 2048, 4096), Case(8, 16384, 4096, 8192), Case(128, 1024, 1000, 4096))
SMALL_CASES = (Case(3, 40, 20, 48),)


def _diff(a: torch.Tensor | tuple[torch.Tensor, ...], b: Any) -> float:
    if isinstance(a, tuple):
        return max(_diff(x, y) for x, y in zip(a, b, strict=True))
    return float((a.float() - b.float()).abs().max())


def run(
    cases: tuple[Case, ...],
    device: torch.device,
    dtype: torch.dtype,
    *,
    heads: tuple[int, int, int] = (32, 8, 128),
    peaks: tuple[float, float] = (H200_HBM_BYTES_PER_S, H200_BF16_FLOPS),
    repeats: int = 10,
    warmup: int = 3,
) -> list[Row]:
    rows: list[Row] = []

    def row(name: str, shape: str, fast: Callable[[], Any], slow: Callable[[], Any],
            cost: costs.KernelCost) -> float:  # fmt: skip
        diff = _diff(fast(), slow())
        t_fast = time_call(fast, device, warmup=warmup, repeats=repeats).median_s
        t_slow = time_call(slow, device, warmup=warmup, repeats=repeats).median_s
        bw, fl = cost.bytes_moved / t_fast, cost.flops / t_fast
        rows.append(Row(name, shape, t_fast, t_slow, t_slow / t_fast, diff, bw, fl,
                        bw / peaks[0], fl / peaks[1]))  # fmt: skip
        return t_fast

    q_heads, kv_heads, head_dim = heads
    for c in cases:
        inp = workloads.attention_inputs(
            ragged(c.batch, c.context), q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
            page_size=16, dtype=dtype, device=device,
        )  # fmt: skip
        a, w, gshape = workloads.gemm_inputs(
            c.chunk, c.hidden, c.hidden, dtype=dtype, device=device
        )
        attn_cost = costs.attention_cost(inp.shape, blocks_read=inp.pages_used)
        gemm_cost = costs.gemm_cost(gshape)
        args = inp.args()
        t_attn = row(
            "decode_attention",
            f"B={c.batch} ctx~{c.context} heads={q_heads}/{kv_heads}x{head_dim}",
            partial(triton_ops.paged_decode_attention, *args),
            partial(reference.paged_decode_attention, *args),
            attn_cost,
        )
        t_gemm = row(
            "prefill_gemm",
            f"{c.chunk}x{c.hidden}x{c.hidden}",
            partial(triton_ops.prefill_gemm, a, w),
            partial(reference.prefill_gemm, a, w),
            gemm_cost,
        )
        t_mixed = row(
            "mixed_step",
            f"B={c.batch} ctx~{c.context} + chunk {c.chunk}x{c.hidden}",
            partial(triton_ops.mixed_step, *args, a, w),
            partial(reference.mixed_step, *args, a, w),
            attn_cost + gemm_cost,
        )
        # the overlap penalty this case implies: t_mixed = max + p * min
        big, small = max(t_attn, t_gemm), min(t_attn, t_gemm)
        halves = t_attn + t_gemm
        penalty = f"p~{(t_mixed - big) / small:.3f}"
        rows.append(Row("mixed_vs_halves", penalty, t_mixed, halves, halves / t_mixed,
                        0.0, 0.0, 0.0, 0.0, 0.0))  # fmt: skip
        del inp, args, a, w
    return rows


def render(rows: list[Row]) -> str:
    lines = [
        f"{'kernel':17s} {'shape':44s} {'triton us':>10s} {'torch us':>10s} {'x':>6s} "
        f"{'maxdiff':>8s} {'GB/s':>9s} {'TFLOP/s':>8s} {'%HBM':>6s} {'%FLOP':>6s}"
    ]
    for r in rows:
        lines.append(
            f"{r.kernel:17s} {r.shape:44s} {r.triton_s * 1e6:10.1f} {r.reference_s * 1e6:10.1f} "
            f"{r.speedup:6.2f} {r.max_abs_diff:8.4f} {r.bytes_per_s / 1e9:9.1f} "
            f"{r.flops_per_s / 1e12:8.2f} {r.hbm_share:6.1%} {r.flops_share:6.1%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results JSON to write")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--small", action="store_true", help="tiny shapes (harness check)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cases = SMALL_CASES if args.small else GPU_CASES
    heads = (4, 2, 16) if args.small else (32, 8, 128)
    warmup = 0 if args.small else 3
    rows = run(cases, device, dtype, heads=heads, repeats=args.repeats, warmup=warmup)
    print(render(rows), flush=True)
    doc = {
        "device": device_name(device.type),
        "dtype": args.dtype,
        "interpreted": triton_ops.interpreting(),
        "peaks": {"hbm_bytes_per_s": H200_HBM_BYTES_PER_S, "bf16_flops_per_s": H200_BF16_FLOPS},
        "rows": [asdict(r) for r in rows],
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
