"""Input builders shared by the tests, the timing harness and calibration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crossflow_kernels.costs import AttentionShape, GemmShape


@dataclass(frozen=True, slots=True)
class AttentionInputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    shape: AttentionShape
    pages_used: int

    def args(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens)


def attention_inputs(
    context_lens: list[int],
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_pages: int = 3,
) -> AttentionInputs:
    """A paged KV pool holding ``context_lens`` (one entry per request), pages shuffled.

    Values are drawn on ``device`` (a device generator: the same seed gives different values on
    CPU and GPU, the same values on reruns).

    Each request's pages are scattered through the pool in random order (non-contiguous block
    tables), the pool has ``spare_pages`` unused pages, and table entries past a request's last
    page point at page 0 (a valid id the kernels must ignore).
    """
    if not context_lens or min(context_lens) < 1:
        raise ValueError("context_lens: need at least one request, each with context >= 1")
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per = [-(-n // page_size) for n in context_lens]
    used = sum(pages_per)
    total = used + spare_pages
    order = torch.randperm(total, generator=gen, device=device)[:used].to(torch.int32).cpu()
    table = torch.zeros((len(context_lens), max(pages_per)), dtype=torch.int32)
    start = 0
    for row, n in enumerate(pages_per):
        table[row, :n] = order[start : start + n]
        start += n
    pool = (total, page_size, kv_heads, head_dim)
    k = torch.randn(pool, generator=gen, device=device, dtype=dtype)
    v = torch.randn(pool, generator=gen, device=device, dtype=dtype)
    q = torch.randn((len(context_lens), q_heads, head_dim), generator=gen, device=device,
                    dtype=dtype)  # fmt: skip
    shape = AttentionShape(
        batch=len(context_lens),
        context_tokens=sum(context_lens),
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=page_size,
        dtype_bytes=torch.finfo(dtype).bits // 8,
    )
    return AttentionInputs(
        q=q,
        k_cache=k,
        v_cache=v,
        block_tables=table.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        shape=shape,
        pages_used=used,
    )


def gemm_inputs(
    tokens: int,
    hidden: int,
    out: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, GemmShape]:
    """``a [tokens, hidden]`` and ``w [hidden, out]`` scaled so outputs stay near unit size."""
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn((tokens, hidden), generator=gen, device=device).to(dtype)
    w = (torch.randn((hidden, out), generator=gen, device=device) * hidden**-0.5).to(dtype)
    shape = GemmShape(m=tokens, k=hidden, n=out, dtype_bytes=torch.finfo(dtype).bits // 8)
    return a, w, shape
