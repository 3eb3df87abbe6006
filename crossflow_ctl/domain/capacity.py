"""Roofline capacity model: how long an engine step takes, with or without a borrowed prefill chunk.

One model, used by the agent, the simulator, sizing and (per kernel) the calibration fit. A step
with B decode requests (contexts summing to C tokens) and a borrowed prefill chunk of P uncached
tokens over a cached prefix of X tokens runs T = B + P tokens through three kernel groups, one
after the other:

* **dense** (attention projections, router, unembedding; every non-expert weight):
  ``bytes = dense_params * param_bytes``, ``flops = 2 * dense_params * max(T, tile)``;
* **experts** (MoE): with E routed experts and k per token, the T tokens of a layer touch
  ``D(T) = E * (1 - (1 - k/E)^T)`` distinct experts on average (uniform routing), so weight bytes
  grow sub-linearly with T up to all experts: ``bytes = expert_params * expert_param_bytes * D/E``.
  The tensor cores work in row tiles (``gemm_tile_rows``: 64 for Hopper's wgmma, 128 for
  Blackwell): each touched expert computes at least a tile, ``rows = max(T*k, D*tile)`` and
  ``flops = 2 * expert_params / E * rows``. Padding is why compute activity rises with the batch
  more slowly than the useful FLOPs do, and differently from throughput;
* **attention**: full layers read every context token's K and V, sliding-window layers
  (GPT-OSS alternates full and 128-token windows) at most ``window`` per request:
  ``flops = 4 * q_heads * head_dim * (Lf * (C + P*(P/2 + X))
  + Lw * (min(C, B*W) + P*min(P/2 + X, W)))``,
  ``bytes = kv_bytes_per_layer_token * (Lf * (C + X + P) + Lw * (min(C, B*W) + min(X, W) + P))``.

Each group takes ``max(t_c, t_m) + overlap_penalty * min(t_c, t_m)`` (the calibration fit's
per-kernel formula, :func:`kernel_time_s`); the GPU time is their sum. The engine's host work for
the step (scheduling, sampling, output processing: ``host_step_s + host_per_request_s * requests``)
runs concurrently with the GPU (the overlap schedulers of SGLang and vLLM V1), so

    step_s = max(gpu_s, host_s) + step_overhead_s        # launch/sync, not overlapped

Compute activity (share of the step the tensor cores are busy) is ``sum(t_c) / step_s`` and
memory activity (share of the step HBM is busy, i.e. DRAM traffic as a rate) ``sum(t_m) / step_s``.

Calibration against the paper's testbed (arXiv 2609.27085 §2; GPT-OSS-120B): a 2.5x larger decode
batch (8 -> 20 requests, 1K-token contexts) gives 1.74x throughput and 1.44x compute activity;
contexts 1K -> 82K at batch 8 give ~2x memory traffic and ~-10% throughput. A pure GPU roofline
cannot give both: 8 x 82K tokens of full-layer KV is ~24 GB per step, ~6 ms on an H200, so the
-10% means the testbed's small-batch steps are bounded by host work that the extra KV reads hide
under, while the padded expert GEMMs outgrow it when the batch grows. The presets' host and tile
figures are fitted to those four ratios (``tests/domain/test_capacity.py`` pins them); FLOP/s and
bandwidth are ~70% of datasheet dense bf16 and ~85% of HBM. ``crossflow-agent calibrate`` measures
FLOP/s, bandwidth and the penalty on the node itself; host figures come from the preset.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated

from pydantic import Field, model_validator

from crossflow_ctl.domain.identity import ByIdentity
from crossflow_ctl.domain.models import Frozen
from crossflow_ctl.domain.roofline import GEMM_CACHE as GEMM_CACHE
from crossflow_ctl.domain.roofline import Roofline as Roofline
from crossflow_ctl.domain.roofline import StepCost as StepCost

Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class ModelSpec(Frozen):
    """The served model's shape, as far as step time cares."""

    name: str
    layers: Annotated[int, Field(gt=0, le=1000)]
    q_heads: Annotated[int, Field(gt=0, le=1024)]
    kv_heads: Annotated[int, Field(gt=0, le=1024)]
    head_dim: Annotated[int, Field(gt=0, le=4096)]
    active_params: Positive
    """Parameters used per token (all of them for a dense model); informational."""
    total_params: Positive
    param_bytes: Positive = 2.0
    """Bytes per dense (non-expert) weight: 2 for bf16, 1 for fp8."""
    kv_dtype_bytes: Positive = 2.0
    experts: Annotated[int, Field(ge=0, le=65_536)] = 0
    """Routed experts per MoE layer (0: a dense model)."""
    experts_per_token: Annotated[int, Field(ge=0, le=1024)] = 0
    expert_params: NonNegative = 0.0
    """Parameters in all routed experts of all layers (the rest of ``total_params`` is dense)."""
    expert_param_bytes: NonNegative = 0.0
    """Bytes per expert weight (~0.53 for MXFP4 with scales); 0: same as ``param_bytes``."""
    sliding_window_tokens: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    sliding_layers: Annotated[int, Field(ge=0, le=1000)] = 0
    """Layers that attend only to the last ``sliding_window_tokens`` tokens."""
    kv_latent_dim: Annotated[int, Field(ge=0, le=65_536)] = 0
    """MLA: values cached per token per layer (the compressed KV latent plus the decoupled rope
    key); 0: K and V of every KV head (``2 * kv_heads * head_dim``)."""
    attention_dim: Annotated[int, Field(ge=0, le=65_536)] = 0
    """Per query head, the dims of the QK and the PV products summed (MLA with absorbed
    weights: latent + rope, plus latent); 0: ``2 * head_dim``."""
    sparse_topk_tokens: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    """DeepSeek-style sparse attention: each query attends to at most this many past tokens
    (chosen by an indexer), on every layer; every token stays cached. 0: dense attention."""
    indexer_heads: Annotated[int, Field(ge=0, le=1024)] = 0
    indexer_head_dim: Annotated[int, Field(ge=0, le=4096)] = 0
    """The sparse attention's indexer, which scores every past token for every query."""
    indexer_kv_bytes: NonNegative = 0.0
    """Bytes per token per layer of the indexer's key cache."""

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.experts and not (0 < self.experts_per_token <= self.experts):
            raise ValueError("experts_per_token must be in 1..experts for an MoE model")
        if self.experts and not 0 < self.expert_params < self.total_params:
            raise ValueError("expert_params must be in (0, total_params) for an MoE model")
        if self.sliding_layers > self.layers:
            raise ValueError("sliding_layers must not exceed layers")
        if self.sliding_layers and not self.sliding_window_tokens:
            raise ValueError("sliding_layers needs sliding_window_tokens")
        if self.sparse_topk_tokens and self.sliding_layers:
            raise ValueError("sparse_topk_tokens and sliding_layers do not combine")
        return self

    @property
    def attention_kv_bytes(self) -> float:
        """Bytes the attention reads per cached token per layer (K and V, or the MLA latent)."""
        values = self.kv_latent_dim or 2 * self.kv_heads * self.head_dim
        return values * self.kv_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Every layer's cache entry for one token (what it occupies, and what a transfer
        moves)."""
        return int(self.layers * self.kv_layer_bytes_per_token)

    @property
    def kv_layer_bytes_per_token(self) -> int:
        """One token's cache entry in one layer: K and V (or the MLA latent), and the sparse
        attention indexer's key."""
        return int(self.attention_kv_bytes + self.indexer_kv_bytes)

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights as served (dense at ``param_bytes``, experts at
        ``expert_param_bytes``)."""
        experts = self.expert_params if self.experts else 0.0
        return (self.total_params - experts) * self.param_bytes + experts * (
            self.expert_param_bytes or self.param_bytes
        )


class NodeProfile(Frozen):
    """What one GPU server achieves (not its datasheet peak). Calibration writes this."""

    name: str
    flops_per_s: Positive
    """Achievable dense FLOP/s for the served dtype."""
    hbm_bytes_per_s: Positive
    """Achievable HBM bandwidth."""
    step_overhead_s: Seconds = 0.0005
    """Fixed per-step cost that overlaps nothing: kernel launches, synchronisation."""
    overlap_penalty: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.25
    """Share of the smaller of a kernel's compute and memory time that does not overlap the
    larger (0: perfect overlap, 1: serialised)."""
    network_bytes_per_s: Positive = 25e9
    """KV transfer bandwidth into the node."""
    host_step_s: Seconds = 0.0
    """Engine host work per step (scheduling, sampling), run concurrently with the GPU."""
    host_per_request_s: Annotated[float, Field(ge=0.0, le=0.1, allow_inf_nan=False)] = 0.0
    """Host work per request in the step."""
    gemm_tile_rows: Annotated[int, Field(ge=1, le=1024)] = 1
    """Rows a GEMM computes at least per weight matrix it touches (tensor-core M tile)."""
    hbm_capacity_bytes: NonNegative = 0.0
    """HBM on the GPU (the datasheet's GB, 1e9 bytes); 0: not known (KV cannot be sized)."""


class StepShape(Frozen):
    batch: Annotated[int, Field(ge=0)] = 0
    context_tokens: Annotated[int, Field(ge=0)] = 0
    prefill_tokens: Annotated[int, Field(ge=0)] = 0
    prefix_tokens: Annotated[int, Field(ge=0)] = 0


def kernel_time_s(node: NodeProfile, flops: float, bytes_moved: float) -> float:
    """One kernel group's time on ``node``: ``max(t_c, t_m) + penalty * min(t_c, t_m)``."""
    t_c = flops / node.flops_per_s
    t_m = bytes_moved / node.hbm_bytes_per_s
    return max(t_c, t_m) + node.overlap_penalty * min(t_c, t_m)


def roofline(model: ModelSpec, node: NodeProfile) -> Roofline:
    """The precomputed constants for ``(model, node)``, looked up by object identity first
    (:class:`~crossflow_ctl.domain.identity.ByIdentity`), then by value (equal objects give
    equal constants)."""
    return _ROOFLINES.get(model, node)


@lru_cache(maxsize=64)
def _by_value(model: ModelSpec, node: NodeProfile) -> Roofline:
    return Roofline.of(model, node)


_ROOFLINES: ByIdentity[Roofline] = ByIdentity(_by_value)


def step_cost(model: ModelSpec, node: NodeProfile, shape: StepShape) -> StepCost:
    return roofline(model, node).cost(
        shape.batch, shape.context_tokens, shape.prefill_tokens, shape.prefix_tokens
    )


def step_time_s(model: ModelSpec, node: NodeProfile, shape: StepShape) -> float:
    """Predicted wall time of one engine step of ``shape`` (seconds)."""
    return roofline(model, node).step_s(
        shape.batch, shape.context_tokens, shape.prefill_tokens, shape.prefix_tokens
    )


# -- presets ----------------------------------------------------------------------------------
# GPT-OSS-120B (model card, Aug 2025): 36 layers alternating full and 128-token sliding-window
# attention, 64 query / 8 KV heads of 64, 128 experts top-4 in MXFP4 (114.7B params), 2.1B dense
# (attention, router, embeddings) in bf16. Host and tile figures: see the module doc.

MODEL_PRESETS: dict[str, ModelSpec] = {
    "gpt-oss-120b": ModelSpec(
        name="gpt-oss-120b",
        layers=36,
        q_heads=64,
        kv_heads=8,
        head_dim=64,
        active_params=5.1e9,
        total_params=116.8e9,
        param_bytes=2.0,
        kv_dtype_bytes=2.0,
        experts=128,
        experts_per_token=4,
        expert_params=114.7e9,
        expert_param_bytes=0.53,
        sliding_window_tokens=128,
        sliding_layers=18,
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
        experts=160,
        experts_per_token=8,
        expert_params=340e9,
    ),
    # GLM-5.2 (GlmMoeDsaForCausalLM): no config.json of GLM-5.2 itself was found in public
    # sources; its family's (GLM-5, GLM-5.1, the same architecture) is used, matching what issue
    # 33 states: 78 layers (3 dense, 75 MoE), hidden 6144, 64 heads, MLA (q_lora 2048, kv_lora
    # 512, rope 64, qk 192, v 256), 256 routed experts of 2048 top-8 plus 1 shared, DSA indexer
    # 32 heads x 128 over a top-2048 of past tokens, 744B parameters, FP8 weights
    # (docs/capacity.md).
    # Expert params: 75 layers x 256 x 3 x 6144 x 2048. Assumed: bf16 latent KV, an fp8 indexer
    # key with a 4-byte scale.
    "glm-5.2": ModelSpec(
        name="glm-5.2",
        layers=78,
        q_heads=64,
        kv_heads=1,
        head_dim=192,
        active_params=40e9,
        total_params=744e9,
        param_bytes=1.0,
        kv_dtype_bytes=2.0,
        experts=256,
        experts_per_token=8,
        expert_params=75 * 256 * 3 * 6144 * 2048,
        expert_param_bytes=1.0,
        kv_latent_dim=512 + 64,
        attention_dim=(512 + 64) + 512,
        sparse_topk_tokens=2048,
        indexer_heads=32,
        indexer_head_dim=128,
        indexer_kv_bytes=128 + 4,
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

_HOPPER = {
    "overlap_penalty": 1.0,
    "gemm_tile_rows": 64,
    "host_step_s": 0.0134,
    "host_per_request_s": 2e-5,
    "step_overhead_s": 0.00025,
}
NODE_PRESETS: dict[str, NodeProfile] = {
    "h100": NodeProfile(
        name="h100",
        flops_per_s=0.7 * 989e12,
        hbm_bytes_per_s=0.85 * 3.35e12,
        hbm_capacity_bytes=80e9,
        **_HOPPER,
    ),
    "h200": NodeProfile(
        name="h200",
        flops_per_s=0.7 * 989e12,
        hbm_bytes_per_s=0.85 * 4.8e12,
        hbm_capacity_bytes=141e9,
        **_HOPPER,
    ),
    "gb300": NodeProfile(
        name="gb300",
        flops_per_s=0.7 * 2.5e15,
        hbm_bytes_per_s=0.85 * 8e12,
        hbm_capacity_bytes=288e9,
        network_bytes_per_s=100e9,
        overlap_penalty=1.0,
        gemm_tile_rows=128,
        host_step_s=0.009,
        host_per_request_s=2e-5,
        step_overhead_s=0.0005,
    ),
}


@lru_cache(maxsize=64)
def server_profile(node: NodeProfile, gpus: int) -> NodeProfile:
    """One server of ``gpus`` GPUs like ``node`` serving one model replica (tensor and expert
    parallel across them): FLOP/s, HBM bandwidth and capacity and network scale with the GPUs,
    ideally (no collective cost: optimistic for both pools alike); the engine's host work does
    not. Models whose weights exceed one GPU (glm-5.2: 744 GB) need it."""
    if gpus <= 1:
        return node
    return node.model_copy(
        update={
            "name": f"{node.name}x{gpus}",
            "flops_per_s": node.flops_per_s * gpus,
            "hbm_bytes_per_s": node.hbm_bytes_per_s * gpus,
            "hbm_capacity_bytes": node.hbm_capacity_bytes * gpus,
            "network_bytes_per_s": node.network_bytes_per_s * gpus,
        }
    )


KV_MEMORY_RESERVE = 0.10
"""Share of HBM an engine leaves to activations, CUDA graphs and the allocator: vLLM's
``gpu_memory_utilization`` defaults to 0.9 (docs/capacity.md)."""


def decode_kv_capacity_tokens(
    model: ModelSpec, node: NodeProfile, max_batch: int, reserve: float = KV_MEMORY_RESERVE
) -> int:
    """KV tokens one decode server holds: HBM less the reserve and the weights, less the
    sliding-window layers' KV (at most ``window`` tokens per request, for a full batch of
    ``max_batch``), over the bytes a token takes on the full-attention layers. 0 when the node's
    HBM is not known or the weights leave no room."""
    if node.hbm_capacity_bytes <= 0:
        return 0
    per_layer = model.kv_layer_bytes_per_token
    windows = model.sliding_layers * model.sliding_window_tokens * per_layer * max_batch
    free = node.hbm_capacity_bytes * (1.0 - reserve) - model.weight_bytes - windows
    per_token = (model.layers - model.sliding_layers) * per_layer
    if free <= 0 or per_token <= 0:
        return 0
    return int(free // per_token)


def prefill_time_s(roof: Roofline, uncached: int, cached: int, chunk_tokens: int) -> float:
    """Time to prefill one prompt alone (``uncached`` tokens after a ``cached`` prefix) in
    chunks of ``chunk_tokens``: each chunk attends to the prefix and the chunks before it."""
    total, done = 0.0, 0
    while done < uncached:
        p = min(chunk_tokens, uncached - done)
        total += roof.step_s(0, 0, p, cached + done)
        done += p
    return total


def prefill_rate_tps(model: ModelSpec, node: NodeProfile, chunk_tokens: int) -> float:
    """Uncached prompt tokens per second of a prefill server running chunks of ``chunk_tokens``
    with no cached prefix: the rate its outstanding work drains at while it runs (a cached
    prefix only slows it, so this is the optimistic end)."""
    if chunk_tokens <= 0:
        return 0.0
    return chunk_tokens / roofline(model, node).step_s(0, 0, chunk_tokens)
