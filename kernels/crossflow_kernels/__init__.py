"""Triton kernels (with PyTorch references) that calibrate a node's roofline.

Three operations, each in two implementations with one interface:

- ``paged_decode_attention``: one query token per request, grouped-query heads, a paged KV cache
  addressed through a block table, ragged context lengths. Memory-bound.
- ``prefill_gemm``: ``[tokens, hidden] @ [hidden, out]`` in fp16/bf16 with fp32 accumulation.
  Compute-bound.
- ``mixed_step``: both at once, in one launch, so the interference of a borrowed prefill chunk on
  a decode step is measured rather than assumed.

``crossflow_kernels.reference`` holds the PyTorch versions, ``crossflow_kernels.triton_ops`` the
Triton ones, ``crossflow_kernels.costs`` the analytic FLOPs and bytes of each call and
``crossflow_kernels.timing`` a small timing harness. Importing this package does not import torch;
torch and triton are the optional extra ``crossflow[kernels]``.

This package imports nothing of the control plane (import-linter contract ``kernels-stand-alone``).
"""
