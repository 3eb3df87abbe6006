# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton ``@jit`` kernel bodies (launched from ``crossflow_kernels.triton_ops``).

Triton reads a jitted function's annotations as specialisation hints, so these functions keep
their parameters unannotated; the mypy directive above is scoped to this module only.

Each kernel body is a helper so the mixed step can run both halves in one launch: its grid holds
the prefill GEMM's output tiles and the decode-attention programs side by side, so the GPU
schedules them together and the measured time includes their interference.

The interpreter (``TRITON_INTERPRET=1``) keeps bf16 as raw uint16 and multiplies it as integers
inside ``tl.dot``; both bodies therefore widen their tiles to fp32 before each dot when ``WIDEN``
is set (the launchers set it only when interpreting bf16). That is exact (a bf16 x bf16 product
fits fp32) and changes nothing on a GPU.
"""

import triton
import triton.language as tl

# -- kernel bodies -------------------------------------------------------------------------------


@triton.jit
def _attend(
    b,
    h,
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cl_ptr,
    o_ptr,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    sm_scale,
    page_size,
    group,
    head_dim,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """One request ``b``, one KV head ``h``: all ``group`` query heads that share it.

    The group's query rows (padded to ``BLOCK_G`` >= 16 so both products run on tensor cores)
    meet ``BLOCK_T`` context tokens at a time, gathered through the block table; an online
    softmax keeps a running max and sum in fp32. Products take fp16/bf16 inputs with fp32
    accumulation; the probabilities are rounded to the value dtype for ``p @ v``, as
    FlashAttention does.
    """
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    mask_g = offs_g < group
    mask_d = offs_d < head_dim
    heads = h * group + offs_g
    q_off = b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    qd_mask = mask_g[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + q_off, mask=qd_mask, other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    ctx = tl.load(cl_ptr + b)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, ctx, BLOCK_T):
        pos = start + offs_t
        mask_t = pos < ctx
        page = tl.load(bt_ptr + b * stride_btb + pos // page_size, mask=mask_t, other=0)
        slot = pos % page_size
        page = page.to(tl.int64)
        kv_mask = mask_t[:, None] & mask_d[None, :]
        k_off = page[:, None] * stride_kp + slot[:, None] * stride_ks + h * stride_kh
        k = tl.load(k_ptr + k_off + offs_d[None, :], mask=kv_mask, other=0.0)
        if WIDEN:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [G, T], fp32
        s = tl.where(mask_t[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = page[:, None] * stride_vp + slot[:, None] * stride_vs + h * stride_vh
        v = tl.load(v_ptr + v_off + offs_d[None, :], mask=kv_mask, other=0.0)
        if WIDEN:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    o_off = b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=qd_mask)


@triton.jit
def _gemm_tile(
    pid,
    a_ptr,
    w_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_wk,
    stride_wn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` output tile of ``a @ w``, fp32 accumulation, grouped order."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if WIDEN:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# fmt: off
# -- kernels -------------------------------------------------------------------------------------


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, o_ptr,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_btb, stride_ob, stride_oh,
    sm_scale, page_size, group, head_dim, kv_heads,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, WIDEN: tl.constexpr,
):
    pid = tl.program_id(0)
    _attend(
        pid // kv_heads, pid % kv_heads, q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, o_ptr,
        stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_btb, stride_ob, stride_oh, sm_scale, page_size, group, head_dim,
        BLOCK_T, BLOCK_G, BLOCK_D, WIDEN,
    )


@triton.jit
def _gemm_kernel(
    a_ptr, w_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_wk, stride_wn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, WIDEN: tl.constexpr,
):
    _gemm_tile(
        tl.program_id(0), a_ptr, w_ptr, c_ptr, M, N, K,
        stride_am, stride_ak, stride_wk, stride_wn, stride_cm, stride_cn,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WIDEN,
    )


@triton.jit
def _mixed_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, o_ptr,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_btb, stride_ob, stride_oh,
    sm_scale, page_size, group, head_dim, kv_heads,
    a_ptr, w_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_wk, stride_wn, stride_cm, stride_cn,
    gemm_programs,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, WIDEN: tl.constexpr,
):
    """GEMM tiles first (the long programs), then one program per (request, KV head)."""
    pid = tl.program_id(0)
    if pid < gemm_programs:
        _gemm_tile(
            pid, a_ptr, w_ptr, c_ptr, M, N, K,
            stride_am, stride_ak, stride_wk, stride_wn, stride_cm, stride_cn,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WIDEN,
        )
    else:
        rest = pid - gemm_programs
        _attend(
            rest // kv_heads, rest % kv_heads, q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, o_ptr,
            stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, stride_btb, stride_ob, stride_oh, sm_scale, page_size, group, head_dim,
            BLOCK_T, BLOCK_G, BLOCK_D, WIDEN,
        )
