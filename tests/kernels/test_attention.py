"""Paged decode attention: Triton (interpreted on CPU, compiled on GPU) against the references.

Tolerances (max abs error after scaling inputs ~N(0, 1)): outputs are convex combinations of V
rows, |out| <= ~4, and both sides accumulate in fp32, so the error is the final rounding to the
storage dtype plus fp32 reordering: fp16 (10-bit mantissa) atol 2e-3 + rtol 2e-3; bf16 (7-bit
mantissa) atol 1.6e-2 + rtol 1.6e-2. The PyTorch reference is itself checked against a naive
float64 loop.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="kernel tests need the .[kernels] extra (torch)")
pytest.importorskip("triton", reason="kernel tests need the .[kernels] extra (triton)")

from crossflow_kernels import reference, triton_ops  # noqa: E402
from crossflow_kernels.workloads import attention_inputs  # noqa: E402

pytestmark = pytest.mark.kernels

TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def naive_attention(q, k_cache, v_cache, block_tables, context_lens):
    """Token-by-token float64 attention, written for clarity rather than speed."""
    batch, q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        n = int(context_lens[b])
        rows = [(int(block_tables[b, t // page_size]), t % page_size) for t in range(n)]
        for hq in range(q_heads):
            hk = hq // group
            keys = torch.stack([k_cache[p, s, hk].double() for p, s in rows])
            vals = torch.stack([v_cache[p, s, hk].double() for p, s in rows])
            scores = keys @ q[b, hq].double() / math.sqrt(head_dim)
            out[b, hq] = torch.softmax(scores, dim=0) @ vals
    return out


CASES = [
    # (context_lens, q_heads, kv_heads, head_dim, page_size)
    ([1, 17, 70, 33], 8, 2, 64, 16),  # GQA group 4, ragged, a one-token request
    ([5, 16, 31], 4, 4, 32, 16),  # plain multi-head, contexts on and off page edges
    ([40, 9], 6, 2, 48, 8),  # group 3 and head_dim 48: both padded to powers of two
    ([23, 1, 64], 8, 1, 64, 5),  # multi-query, a page size that is not a power of two
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_triton_matches_reference(case, dtype, kernel_device) -> None:
    ctx, q_heads, kv_heads, head_dim, page = case
    inp = attention_inputs(
        ctx, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page, dtype=dtype,
        device=kernel_device, seed=len(ctx) + head_dim,
    )  # fmt: skip
    got = triton_ops.paged_decode_attention(*inp.args())
    want = reference.paged_decode_attention(*inp.args())
    assert got.dtype == dtype and got.shape == inp.q.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_reference_matches_naive_float64(dtype) -> None:
    inp = attention_inputs(
        [1, 17, 70, 33], q_heads=8, kv_heads=2, head_dim=32, page_size=16, dtype=dtype
    )
    want = naive_attention(*inp.args())
    got = reference.paged_decode_attention(*inp.args())
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def test_block_table_is_followed_not_assumed_contiguous(kernel_device) -> None:
    """The shuffled table gives a different answer than reading the pool in order would."""
    inp = attention_inputs(
        [48, 48], q_heads=4, kv_heads=2, head_dim=32, page_size=16, dtype=torch.float16,
        device=kernel_device, seed=7,
    )  # fmt: skip
    in_order = torch.arange(6, dtype=torch.int32, device=kernel_device).view(2, 3)
    assert not torch.equal(inp.block_tables, in_order)
    shuffled = triton_ops.paged_decode_attention(*inp.args())
    straight = triton_ops.paged_decode_attention(
        inp.q, inp.k_cache, inp.v_cache, in_order, inp.context_lens
    )
    assert (shuffled.float() - straight.float()).abs().max() > 0.1


def test_pages_and_slots_past_the_context_are_ignored(kernel_device) -> None:
    inp = attention_inputs(
        [20, 3], q_heads=4, kv_heads=2, head_dim=32, page_size=16, dtype=torch.float16,
        device=kernel_device, spare_pages=2,
    )  # fmt: skip
    before = triton_ops.paged_decode_attention(*inp.args())
    k, v = inp.k_cache.clone(), inp.v_cache.clone()
    used = set(inp.block_tables[0, :2].tolist()) | {int(inp.block_tables[1, 0])}
    spare = [p for p in range(k.shape[0]) if p not in used]
    k[spare] = 1000.0  # pages nobody owns
    v[spare] = 1000.0
    last0, last1 = int(inp.block_tables[0, 1]), int(inp.block_tables[1, 0])
    k[last0, 4:] = 1000.0  # slots past request 0's 20 tokens (page 2 holds tokens 16..19)
    v[last0, 4:] = 1000.0
    k[last1, 3:] = 1000.0
    v[last1, 3:] = 1000.0
    table = inp.block_tables.clone()
    table[1, 1] = spare[0]  # a table entry past request 1's last page, pointing at garbage
    after = triton_ops.paged_decode_attention(inp.q, k, v, table, inp.context_lens)
    assert torch.equal(before, after)


@pytest.mark.parametrize(
    ("field", "mutate"),
    [
        ("q", lambda a: {**a, "q": a["q"][0]}),
        ("q_heads", lambda a: {**a, "q": a["q"][:, :3]}),
        ("block_tables", lambda a: {**a, "block_tables": a["block_tables"].long()}),
        ("context_lens", lambda a: {**a, "context_lens": a["context_lens"] * 0}),
        ("block_tables", lambda a: {**a, "block_tables": a["block_tables"][:, :1]}),
    ],
)
def test_bad_arguments_are_refused_with_their_name(field, mutate) -> None:
    inp = attention_inputs([20, 40], q_heads=4, kv_heads=2, head_dim=16, page_size=16,
                           dtype=torch.float16)  # fmt: skip
    names = ("q", "k_cache", "v_cache", "block_tables", "context_lens")
    args = mutate(dict(zip(names, inp.args(), strict=True)))
    for fn in (reference.paged_decode_attention, triton_ops.paged_decode_attention):
        with pytest.raises(ValueError, match=field):
            fn(**args)


def test_dtype_outside_fp16_bf16_is_refused_by_the_kernel() -> None:
    inp = attention_inputs([8], q_heads=2, kv_heads=1, head_dim=16, page_size=4,
                           dtype=torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="q/k_cache/v_cache"):
        triton_ops.paged_decode_attention(*inp.args())
