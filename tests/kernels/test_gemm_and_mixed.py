"""Prefill GEMM and the one-launch mixed step against the PyTorch references.

GEMM tolerance: inputs ~N(0, 1) and N(0, 1/hidden) so outputs are ~N(0, 1); both sides accumulate
in fp32 and round once, so errors are one or two ulps of the output dtype: fp16 atol 2e-3 + rtol
2e-3, bf16 atol 1.6e-2 + rtol 1.6e-2 (also against a float64 matmul).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="kernel tests need the .[kernels] extra (torch)")
pytest.importorskip("triton", reason="kernel tests need the .[kernels] extra (triton)")

from crossflow_kernels import reference, triton_ops  # noqa: E402
from crossflow_kernels.workloads import attention_inputs, gemm_inputs  # noqa: E402

pytestmark = pytest.mark.kernels

TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])


@DTYPES
@pytest.mark.parametrize(
    ("tokens", "hidden", "out"),
    [(16, 16, 16), (37, 50, 45), (1, 70, 33), (100, 33, 129), (130, 17, 5)],
)
def test_gemm_matches_reference_on_ragged_shapes(tokens, hidden, out, dtype, kernel_device):
    a, w, _ = gemm_inputs(tokens, hidden, out, dtype=dtype, device=kernel_device, seed=tokens)
    got = triton_ops.prefill_gemm(a, w)
    assert got.dtype == dtype and got.shape == (tokens, out)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(
        got.float(), reference.prefill_gemm(a, w).float(), atol=atol, rtol=rtol
    )
    torch.testing.assert_close(got.double(), a.double() @ w.double(), atol=atol, rtol=rtol)


@DTYPES
def test_gemm_follows_strides_of_a_transposed_weight(dtype, kernel_device) -> None:
    a, w, _ = gemm_inputs(40, 24, 36, dtype=dtype, device=kernel_device)
    w_t = w.t().contiguous().t()  # same values, column-major storage
    assert not w_t.is_contiguous()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(
        triton_ops.prefill_gemm(a, w_t).float(), triton_ops.prefill_gemm(a, w).float(),
        atol=atol, rtol=rtol,
    )  # fmt: skip


def test_gemm_refuses_shapes_that_do_not_chain() -> None:
    a, w, _ = gemm_inputs(8, 16, 8, dtype=torch.float16)
    for fn in (reference.prefill_gemm, triton_ops.prefill_gemm):
        with pytest.raises(ValueError, match="do not chain"):
            fn(a, w[:8])


@DTYPES
def test_mixed_step_equals_its_halves(dtype, kernel_device) -> None:
    """One launch, both answers: exactly what the two separate kernels give, and the reference."""
    inp = attention_inputs(
        [1, 17, 70], q_heads=8, kv_heads=2, head_dim=32, page_size=16, dtype=dtype,
        device=kernel_device, seed=3,
    )  # fmt: skip
    a, w, _ = gemm_inputs(45, 40, 50, dtype=dtype, device=kernel_device, seed=4)
    attn, chunk = triton_ops.mixed_step(*inp.args(), a, w)
    assert torch.equal(attn, triton_ops.paged_decode_attention(*inp.args()))
    assert torch.equal(chunk, triton_ops.prefill_gemm(a, w))
    ref_attn, ref_chunk = reference.mixed_step(*inp.args(), a, w)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(attn.float(), ref_attn.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(chunk.float(), ref_chunk.float(), atol=atol, rtol=rtol)
