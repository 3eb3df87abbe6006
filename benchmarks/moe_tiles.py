"""The expert GEMM's row tile against vLLM's tuned fused-MoE config (issue 33 item 4).

    python benchmarks/moe_tiles.py [--hardware h200]

Prices the shapes docs/capacity.md quotes on the preset's flat ``gemm_tile_rows`` and on the
``BLOCK_SIZE_M`` that vLLM's tuned Triton config for GPT-OSS-120B's expert shape (E=128, N=2880)
on Hopper picks for the step's token count (the nearest tuned M), beside the paper's measured
decode ratios the presets are fitted to. The schedule is copied from
vllm/model_executor/layers/fused_moe/configs/E=128,N=2880,device_name=NVIDIA_H100_80GB_HBM3.json.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, Roofline

VLLM_BLOCK_SIZE_M = {
    1: 16, 2: 16, 4: 16, 8: 16, 16: 16, 24: 16, 32: 16, 48: 16, 64: 16, 96: 16, 128: 16,
    256: 32, 512: 32, 1024: 64, 1536: 64, 2048: 128, 3072: 128, 4096: 128,
}  # fmt: skip


def vllm_tile(tokens: int) -> int:
    """vLLM's choice: the config of the tuned M nearest the step's token count."""
    return VLLM_BLOCK_SIZE_M[min(VLLM_BLOCK_SIZE_M, key=lambda m: abs(m - tokens))]


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledTiles(Roofline):
    """The roofline with the expert tile taken from vLLM's schedule, step by step."""

    def _gemm_s(self, tokens: int) -> float:
        tiled = dataclasses.replace(self, tile=float(vllm_tile(tokens)), gemm_s={})
        return Roofline._gemm_s(tiled, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h200", choices=sorted(NODE_PRESETS))
    args = parser.parse_args()
    flat = Roofline.of(MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS[args.hardware])
    fields = {f.name: getattr(flat, f.name) for f in dataclasses.fields(Roofline)}
    scheduled = ScheduledTiles(**{**fields, "gemm_s": {}})
    print(f"| {args.hardware}, GPT-OSS-120B | flat {flat.tile:g} rows | vLLM's schedule |")
    print("|---|---|---|")
    rows: list[tuple[str, Callable[[Roofline], float], str]] = [
        ("decode 8 -> 20 (1K): throughput x", lambda r: (20 / r.step_s(20, 20 * 1024))
         / (8 / r.step_s(8, 8 * 1024)), "{:.2f}"),
        ("batch 8, 1K -> 82K: throughput", lambda r: r.step_s(8, 8 * 1024)
         / r.step_s(8, 8 * 82 * 1024) - 1.0, "{:+.1%}"),
        ("4 decode + 256 chunk, no prefix (ms)", lambda r: r.step_s(4, 4096, 256, 0) * 1e3,
         "{:.1f}"),
        ("4 decode + 256 chunk over 85k (ms)", lambda r: r.step_s(4, 107_701, 256, 85_184) * 1e3,
         "{:.1f}"),
        ("4 decode + 2048 chunk (ms)", lambda r: r.step_s(4, 4096, 2048, 0) * 1e3, "{:.1f}"),
    ]  # fmt: skip
    for name, of, fmt in rows:
        print(f"| {name} | {fmt.format(of(flat))} | {fmt.format(of(scheduled))} |")


if __name__ == "__main__":
    main()
