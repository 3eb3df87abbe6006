"""PyTorch reference implementations: the ground truth the Triton kernels are checked against.

They share the Triton versions' interface (``crossflow_kernels.triton_ops``), compute in fp32 and
return the input dtype, and are also what ``crossflow-agent calibrate`` times on a node without a
GPU.

Layouts (all tensors on one device):

- ``q``: ``[batch, q_heads, head_dim]``, one query token per request;
- ``k_cache``, ``v_cache``: ``[num_blocks, block_size, kv_heads, head_dim]``, the paged KV pool;
- ``block_tables``: ``[batch, max_blocks]`` int32, page ids of each request in order (entries past
  a request's last page are ignored);
- ``context_lens``: ``[batch]`` int32, tokens of context per request (at least 1);
- ``a``: ``[tokens, hidden]``, ``w``: ``[hidden, out]`` for the prefill GEMM.
"""

from __future__ import annotations

import torch


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Raise ValueError naming the argument at fault."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [batch, q_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache/v_cache: expected equal [blocks, block_size, kv_heads, head_dim]")
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError("k_cache: head_dim differs from q")
    if q_heads % kv_heads:
        raise ValueError(f"q: q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError("block_tables: expected [batch, max_blocks]")
    if context_lens.shape != (batch,):
        raise ValueError("context_lens: expected [batch]")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables/context_lens: expected int32")
    if context_lens.is_cuda or batch == 0:
        return  # value checks below would synchronise the device; the kernels mask instead
    if int(context_lens.min()) < 1:
        raise ValueError("context_lens: every request needs at least one context token")
    pages_needed = int(((context_lens.max() + k_cache.shape[1] - 1) // k_cache.shape[1]).item())
    if pages_needed > block_tables.shape[1]:
        raise ValueError("block_tables: fewer columns than the longest context needs")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of each request's single query token over its paged context."""
    check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    sm_scale = scale if scale is not None else head_dim**-0.5
    # Gather every request's pages (padded to the widest table), mask the tail, one softmax.
    pages = block_tables.long()
    width = pages.shape[1] * block_size
    k = k_cache[pages].reshape(batch, width, kv_heads, head_dim).float()
    v = v_cache[pages].reshape(batch, width, kv_heads, head_dim).float()
    qg = q.float().view(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, k) * sm_scale
    position = torch.arange(width, device=q.device)
    valid = position[None, :] < context_lens[:, None]  # [batch, width]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgn,bnhd->bhgd", probs, v)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def prefill_gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w`` with fp32 accumulation, returned in the input dtype."""
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[0]:
        raise ValueError(f"a, w: shapes {tuple(a.shape)} and {tuple(w.shape)} do not chain")
    if a.is_cuda:
        return a @ w  # cuBLAS accumulates fp16/bf16 in fp32
    return (a.float() @ w.float()).to(a.dtype)


def mixed_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode-attention batch and a prefill chunk in one step (here: one after the other)."""
    attn = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return attn, prefill_gemm(a, w)
