"""Triton kernels with the same interface as ``crossflow_kernels.reference``.

The launchers here validate arguments, pick tile sizes and launch the ``@triton.jit`` bodies of
``crossflow_kernels.triton_jit``. Under ``TRITON_INTERPRET=1`` (set before triton is imported)
the same code runs on the CPU with small tiles, which is how the tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from crossflow_kernels.reference import check_attention_args
from crossflow_kernels.triton_jit import _attention_kernel, _gemm_kernel, _mixed_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Tile sizes and launch settings; interpreted runs use small tiles to stay fast."""

    attn_tokens: int  # context tokens per attention iteration
    gemm_m: int
    gemm_n: int
    gemm_k: int
    group_m: int
    num_warps: int
    num_stages: int


GPU_TILES = TileConfig(64, 128, 128, 64, 8, 8, 3)
INTERPRETER_TILES = TileConfig(16, 16, 16, 16, 2, 4, 1)


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def default_tiles() -> TileConfig:
    return INTERPRETER_TILES if interpreting() else GPU_TILES


# -- launchers -----------------------------------------------------------------------------------


def _attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float | None,
) -> tuple[object, ...]:
    check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q/k_cache/v_cache: expected one of {SUPPORTED_DTYPES}, all equal")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head_dim axis must be contiguous")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables: rows must be contiguous")
    _, q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    sm_scale = scale if scale is not None else head_dim**-0.5
    return (
        q, k_cache, v_cache, block_tables, context_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        sm_scale, page_size, group, head_dim, kv_heads,
    )  # fmt: skip


def _widen(dtype: torch.dtype) -> bool:
    """Widen bf16 tiles to fp32 before ``tl.dot`` in the interpreter (see ``triton_jit``)."""
    return interpreting() and dtype == torch.bfloat16


def _attention_meta(q: torch.Tensor, kv_heads: int, tiles: TileConfig) -> dict[str, int | bool]:
    group = q.shape[1] // kv_heads
    return {
        "BLOCK_T": tiles.attn_tokens,
        "BLOCK_G": max(triton.next_power_of_2(group), 16),  # tl.dot needs 16 rows
        "BLOCK_D": max(triton.next_power_of_2(q.shape[2]), 16),
        "WIDEN": _widen(q.dtype),
    }


def _gemm_args(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> tuple[object, ...]:
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[0]:
        raise ValueError(f"a, w: shapes {tuple(a.shape)} and {tuple(w.shape)} do not chain")
    if a.dtype not in SUPPORTED_DTYPES or w.dtype != a.dtype:
        raise ValueError(f"a/w: expected one of {SUPPORTED_DTYPES}, both equal")
    m, k = a.shape
    n = w.shape[1]
    return (
        a, w, c, m, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), c.stride(0), c.stride(1),
    )  # fmt: skip


def _gemm_meta(a: torch.Tensor, tiles: TileConfig) -> dict[str, int | bool]:
    return {
        "BLOCK_M": tiles.gemm_m,
        "BLOCK_N": tiles.gemm_n,
        "BLOCK_K": tiles.gemm_k,
        "GROUP_M": tiles.group_m,
        "WIDEN": _widen(a.dtype),
    }


def _gemm_programs(a: torch.Tensor, w: torch.Tensor, tiles: TileConfig) -> int:
    return int(triton.cdiv(a.shape[0], tiles.gemm_m) * triton.cdiv(w.shape[1], tiles.gemm_n))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    *,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """Triton version of :func:`crossflow_kernels.reference.paged_decode_attention`."""
    cfg = tiles or default_tiles()
    out = torch.empty_like(q)
    args = _attention_args(q, k_cache, v_cache, block_tables, context_lens, out, scale)
    grid = (q.shape[0] * k_cache.shape[2],)
    if grid[0]:
        _attention_kernel[grid](
            *args, **_attention_meta(q, k_cache.shape[2], cfg), num_warps=cfg.num_warps
        )
    return out


def prefill_gemm(
    a: torch.Tensor, w: torch.Tensor, *, tiles: TileConfig | None = None
) -> torch.Tensor:
    """Triton version of :func:`crossflow_kernels.reference.prefill_gemm`."""
    cfg = tiles or default_tiles()
    c = torch.empty((a.shape[0], w.shape[1]), dtype=a.dtype, device=a.device)
    args = _gemm_args(a, w, c)
    grid = (_gemm_programs(a, w, cfg),)
    _gemm_kernel[grid](
        *args, **_gemm_meta(a, cfg), num_warps=cfg.num_warps, num_stages=cfg.num_stages
    )
    return c


def mixed_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    *,
    tiles: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention and a prefill GEMM chunk in one launch (see the module docstring)."""
    if a.dtype != q.dtype:
        raise ValueError("a: the prefill chunk and the decode batch must share one dtype")
    cfg = tiles or default_tiles()
    out = torch.empty_like(q)
    c = torch.empty((a.shape[0], w.shape[1]), dtype=a.dtype, device=a.device)
    attn_args = _attention_args(q, k_cache, v_cache, block_tables, context_lens, out, scale)
    gemm_args = _gemm_args(a, w, c)
    gemm_programs = _gemm_programs(a, w, cfg)
    grid = (gemm_programs + q.shape[0] * k_cache.shape[2],)
    _mixed_kernel[grid](
        *attn_args,
        *gemm_args,
        gemm_programs,
        **{**_attention_meta(q, k_cache.shape[2], cfg), **_gemm_meta(a, cfg)},
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, c
