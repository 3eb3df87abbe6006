"""Analytic FLOPs and bytes: hand-checked numbers, and agreement with the capacity model."""

from __future__ import annotations

import pytest

from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, roofline
from crossflow_kernels.costs import (
    AttentionShape,
    GemmShape,
    attention_cost,
    gemm_cost,
    mixed_cost,
)


def test_gemm_cost_by_hand() -> None:
    cost = gemm_cost(GemmShape(m=3, k=5, n=7, dtype_bytes=2))
    assert cost.flops == 2 * 3 * 5 * 7
    assert cost.bytes_moved == (3 * 5 + 5 * 7 + 3 * 7) * 2


def test_attention_cost_by_hand() -> None:
    shape = AttentionShape(
        batch=2, context_tokens=40, q_heads=8, kv_heads=2, head_dim=64, block_size=16
    )
    cost = attention_cost(shape, blocks_read=4)
    assert cost.flops == 4 * 8 * 64 * 40
    kv = 2 * 2 * 64 * 40 * 2  # K and V, two KV heads, 40 tokens, fp16
    q_out = 2 * 2 * 8 * 64 * 2
    assert cost.bytes_moved == kv + q_out + 4 * (4 + 2)


def test_attention_flops_are_the_capacity_models_attention_term_per_layer() -> None:
    model = ModelSpec(
        name="t", layers=1, q_heads=8, kv_heads=2, head_dim=64, active_params=1.0, total_params=1.0
    )
    node = NodeProfile(name="n", flops_per_s=1e15, hbm_bytes_per_s=1e12)
    _, _, (attention_only, _) = roofline(model, node).groups(3, 500, 0, 0)
    kernel = AttentionShape(
        batch=3, context_tokens=500, q_heads=8, kv_heads=2, head_dim=64, block_size=16
    )
    assert attention_cost(kernel).flops == pytest.approx(attention_only)


def test_mixed_cost_is_the_sum() -> None:
    attn = AttentionShape(
        batch=1, context_tokens=9, q_heads=2, kv_heads=1, head_dim=8, block_size=4
    )
    gemm = GemmShape(m=4, k=4, n=4)
    both = mixed_cost(attn, gemm)
    assert both.flops == attention_cost(attn).flops + gemm_cost(gemm).flops
    assert both.bytes_moved == attention_cost(attn).bytes_moved + gemm_cost(gemm).bytes_moved


@pytest.mark.parametrize("field", ["batch", "context_tokens", "head_dim", "block_size"])
def test_shapes_refuse_non_positive_sizes(field: str) -> None:
    good = {"batch": 1, "context_tokens": 1, "q_heads": 2, "kv_heads": 1, "head_dim": 8,
            "block_size": 4}  # fmt: skip
    with pytest.raises(ValueError, match=field):
        AttentionShape(**{**good, field: 0})


def test_q_heads_must_be_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match="multiple"):
        AttentionShape(batch=1, context_tokens=1, q_heads=3, kv_heads=2, head_dim=8, block_size=4)
