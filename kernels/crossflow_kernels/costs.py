"""Analytic FLOPs and bytes moved per kernel call (pure Python, no torch).

The calibration fit divides these by measured times, so they must count what the kernels really
do, not what a fused engine might do:

- decode attention reads every context token's K and V once for each KV head (grouped-query
  heads share the read), reads the query and block table, writes the output; it does ``2 * D``
  FLOPs for ``q . k`` and ``2 * D`` for ``p * v`` per query head and context token, which is the
  ``4 * q_heads * head_dim * C`` per layer of the attention group of
  ``crossflow_ctl.domain.capacity.Roofline.groups``;
- the GEMM does ``2 * M * N * K`` FLOPs and moves at least ``A + B + C`` once;
- the mixed step is the sum of its two halves.
"""

from __future__ import annotations

from dataclasses import dataclass

INDEX_BYTES = 4  # block tables and context lengths are int32


@dataclass(frozen=True, slots=True)
class KernelCost:
    """FLOPs and bytes moved by one kernel call."""

    flops: float
    bytes_moved: float

    def __add__(self, other: KernelCost) -> KernelCost:
        return KernelCost(self.flops + other.flops, self.bytes_moved + other.bytes_moved)


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One decode-attention call: ``context_tokens`` is the sum over the batch."""

    batch: int
    context_tokens: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("batch", "context_tokens", "q_heads", "kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.q_heads % self.kv_heads:
            raise ValueError("q_heads must be a multiple of kv_heads")


@dataclass(frozen=True, slots=True)
class GemmShape:
    """``[m, k] @ [k, n]``: m tokens, k hidden, n out."""

    m: int
    k: int
    n: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("m", "k", "n"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


def attention_cost(shape: AttentionShape, blocks_read: int | None = None) -> KernelCost:
    """Cost of one paged decode-attention call.

    ``blocks_read`` is the number of KV pages touched (defaults to the context rounded up to
    whole pages as if one request held it all; pass the exact count when known).
    """
    s = shape
    flops = 4.0 * s.q_heads * s.head_dim * s.context_tokens
    kv = 2.0 * s.kv_heads * s.head_dim * s.context_tokens * s.dtype_bytes
    q_and_out = 2.0 * s.batch * s.q_heads * s.head_dim * s.dtype_bytes
    pages = blocks_read if blocks_read is not None else -(-s.context_tokens // s.block_size)
    index = INDEX_BYTES * (pages + s.batch)
    return KernelCost(flops, kv + q_and_out + index)


def gemm_cost(shape: GemmShape) -> KernelCost:
    s = shape
    flops = 2.0 * s.m * s.n * s.k
    bytes_moved = float(s.m * s.k + s.k * s.n + s.m * s.n) * s.dtype_bytes
    return KernelCost(flops, bytes_moved)


def mixed_cost(attention: AttentionShape, gemm: GemmShape) -> KernelCost:
    return attention_cost(attention) + gemm_cost(gemm)
