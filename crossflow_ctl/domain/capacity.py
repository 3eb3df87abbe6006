"""Roofline capacity model: how long a decode step takes, with or without a borrowed prefill chunk.

The model (one formula, used by the agent, the simulator and the calibration fit):

    flops  = 2 * active_params * (B + P)                         # dense/MoE matmuls
           + 4 * layers * q_heads * head_dim * (C + P * (P/2 + X))  # attention
    bytes  = param_bytes * min(total_params, active_params * (B + P))   # weights touched
           + kv_bytes_per_token * (C + X + P)                    # KV read and written
    t_c    = flops / flops_per_s
    t_m    = bytes / hbm_bytes_per_s
    step_s = max(t_c, t_m) + overlap_penalty * min(t_c, t_m) + step_overhead_s

where B is the decode batch (requests), C the sum of their context lengths (tokens), P the
borrowed prefill chunk (uncached tokens) and X its cached prefix length. ``overlap_penalty`` is 0
when compute and memory overlap perfectly and 1 when they serialise; the kernels' mixed-step
calibration measures it (crossflow_kernels, ``crossflow-agent calibrate``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from crossflow_ctl.domain.models import Frozen

Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class ModelSpec(Frozen):
    """The served model's shape, as far as step time cares."""

    name: str
    layers: Annotated[int, Field(gt=0, le=1000)]
    q_heads: Annotated[int, Field(gt=0, le=1024)]
    kv_heads: Annotated[int, Field(gt=0, le=1024)]
    head_dim: Annotated[int, Field(gt=0, le=4096)]
    active_params: Positive
    """Parameters used per token (all of them for a dense model)."""
    total_params: Positive
    param_bytes: Positive = 2.0
    """Bytes per weight (2 for bf16, ~0.53 for MXFP4 with scales)."""
    kv_dtype_bytes: Positive = 2.0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head."""
        return int(2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes)


class NodeProfile(Frozen):
    """What one GPU server achieves (not its datasheet peak). Calibration writes this."""

    name: str
    flops_per_s: Positive
    """Achievable dense FLOP/s for the served dtype."""
    hbm_bytes_per_s: Positive
    """Achievable HBM bandwidth."""
    step_overhead_s: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.004
    """Fixed per-step cost: scheduling, kernel launches, sampling."""
    overlap_penalty: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.25
    """Share of the smaller of compute and memory time that does not overlap the larger."""
    network_bytes_per_s: Positive = 25e9
    """KV transfer bandwidth into the node."""


class StepShape(Frozen):
    batch: Annotated[int, Field(ge=0)] = 0
    context_tokens: Annotated[int, Field(ge=0)] = 0
    prefill_tokens: Annotated[int, Field(ge=0)] = 0
    prefix_tokens: Annotated[int, Field(ge=0)] = 0


def step_flops(model: ModelSpec, shape: StepShape) -> float:
    tokens = shape.batch + shape.prefill_tokens
    p = shape.prefill_tokens
    attn = 4.0 * model.layers * model.q_heads * model.head_dim
    return 2.0 * model.active_params * tokens + attn * (
        shape.context_tokens + p * (p / 2.0 + shape.prefix_tokens)
    )


def step_bytes(model: ModelSpec, shape: StepShape) -> float:
    tokens = shape.batch + shape.prefill_tokens
    if tokens == 0:
        return 0.0
    weights = model.param_bytes * min(model.total_params, model.active_params * tokens)
    kv = model.kv_bytes_per_token * (
        shape.context_tokens + shape.prefix_tokens + shape.prefill_tokens
    )
    return weights + kv


def step_time_s(model: ModelSpec, node: NodeProfile, shape: StepShape) -> float:
    """Predicted wall time of one engine step of ``shape`` (seconds)."""
    if shape.batch == 0 and shape.prefill_tokens == 0:
        return 0.0
    t_c = step_flops(model, shape) / node.flops_per_s
    t_m = step_bytes(model, shape) / node.hbm_bytes_per_s
    return max(t_c, t_m) + node.overlap_penalty * min(t_c, t_m) + node.step_overhead_s


# -- presets ----------------------------------------------------------------------------------
# Achievable figures are ~70% of datasheet dense bf16 FLOP/s and ~85% of HBM bandwidth.

MODEL_PRESETS: dict[str, ModelSpec] = {
    "gpt-oss-120b": ModelSpec(
        name="gpt-oss-120b",
        layers=36,
        q_heads=64,
        kv_heads=8,
        head_dim=64,
        active_params=5.1e9,
        total_params=117e9,
        param_bytes=0.53,
        kv_dtype_bytes=2.0,
    ),
    "glm-4.5": ModelSpec(
        name="glm-4.5",
        layers=92,
        q_heads=96,
        kv_heads=8,
        head_dim=128,
        active_params=32e9,
        total_params=355e9,
        param_bytes=1.0,
        kv_dtype_bytes=2.0,
    ),
    "llama-3.1-8b": ModelSpec(
        name="llama-3.1-8b",
        layers=32,
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        active_params=8e9,
        total_params=8e9,
        param_bytes=2.0,
        kv_dtype_bytes=2.0,
    ),
}

NODE_PRESETS: dict[str, NodeProfile] = {
    "h100": NodeProfile(name="h100", flops_per_s=0.7 * 989e12, hbm_bytes_per_s=0.85 * 3.35e12),
    "h200": NodeProfile(name="h200", flops_per_s=0.7 * 989e12, hbm_bytes_per_s=0.85 * 4.8e12),
    "gb300": NodeProfile(
        name="gb300",
        flops_per_s=0.7 * 2.5e15,
        hbm_bytes_per_s=0.85 * 8e12,
        network_bytes_per_s=100e9,
    ),
}
