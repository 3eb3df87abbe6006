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

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated

from pydantic import Field, model_validator

from crossflow_ctl.domain.identity import ByIdentity
from crossflow_ctl.domain.models import Frozen

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
        return self

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head (what a token's cache entry occupies)."""
        return int(2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes)

    @property
    def kv_layer_bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return int(2 * self.kv_heads * self.head_dim * self.kv_dtype_bytes)

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


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step's costs and times (seconds); see the module doc."""

    flops: float
    bytes_moved: float
    compute_s: float
    """Tensor-core busy time: sum over groups of FLOPs / FLOP/s."""
    memory_s: float
    """HBM busy time: sum over groups of bytes / bandwidth."""
    gpu_s: float
    host_s: float
    step_s: float

    @property
    def compute_activity(self) -> float:
        return self.compute_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def memory_activity(self) -> float:
        return self.memory_s / self.step_s if self.step_s > 0 else 0.0


def kernel_time_s(node: NodeProfile, flops: float, bytes_moved: float) -> float:
    """One kernel group's time on ``node``: ``max(t_c, t_m) + penalty * min(t_c, t_m)``."""
    t_c = flops / node.flops_per_s
    t_m = bytes_moved / node.hbm_bytes_per_s
    return max(t_c, t_m) + node.overlap_penalty * min(t_c, t_m)


@dataclass(frozen=True, slots=True)
class Roofline:
    """Constants of one (model, node) pair, precomputed: the hot path is plain float arithmetic."""

    inv_flops: float
    inv_bw: float
    penalty: float
    host_s: float
    host_req_s: float
    overhead_s: float
    tile: float
    dense_flops_per_row: float
    dense_bytes: float
    experts: float
    per_token: float
    keep: float
    """1 - k/E: the chance an expert is missed by one token."""
    expert_bytes: float
    expert_flops_per_row: float
    attn_flops: float
    """4 * q_heads * head_dim: attention FLOPs per (query, key) pair per layer."""
    kv_layer_bytes: float
    full_layers: float
    window_layers: float
    window: float
    gemm_s: dict[int, float] = field(default_factory=dict, compare=False, repr=False)
    """GPU time of the dense and expert groups by tokens in the step (a function of that count
    alone), as :meth:`step_s` meets each count: the lease arithmetic asks for the same few."""

    @classmethod
    def of(cls, model: ModelSpec, node: NodeProfile) -> Roofline:
        expert_params = model.expert_params if model.experts else 0.0
        dense_params = model.total_params - expert_params
        experts = float(model.experts)
        return cls(
            inv_flops=1.0 / node.flops_per_s,
            inv_bw=1.0 / node.hbm_bytes_per_s,
            penalty=node.overlap_penalty,
            host_s=node.host_step_s,
            host_req_s=node.host_per_request_s,
            overhead_s=node.step_overhead_s,
            tile=float(node.gemm_tile_rows),
            dense_flops_per_row=2.0 * dense_params,
            dense_bytes=dense_params * model.param_bytes,
            experts=experts,
            per_token=float(model.experts_per_token),
            keep=1.0 - model.experts_per_token / experts if experts else 1.0,
            expert_bytes=expert_params * (model.expert_param_bytes or model.param_bytes),
            expert_flops_per_row=2.0 * expert_params / experts if experts else 0.0,
            attn_flops=4.0 * model.q_heads * model.head_dim,
            kv_layer_bytes=2.0 * model.kv_heads * model.head_dim * model.kv_dtype_bytes,
            full_layers=float(model.layers - model.sliding_layers),
            window_layers=float(model.sliding_layers),
            window=float(model.sliding_window_tokens),
        )

    def groups(
        self, batch: float, context: float, chunk: float, prefix: float
    ) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        """(flops, bytes) of the dense, expert and attention groups. Plain arithmetic, so a
        window's mean step (fractional batch and chunk) is priced too
        (:mod:`crossflow_ctl.domain.step_fit`)."""
        tokens = batch + chunk
        tile = self.tile
        dense = (self.dense_flops_per_row * max(tokens, tile), self.dense_bytes)
        if self.experts:
            touched = self.experts * (1.0 - self.keep**tokens)
            rows = max(tokens * self.per_token, touched * tile)
            expert = (self.expert_flops_per_row * rows, self.expert_bytes * touched / self.experts)
        else:
            expert = (0.0, 0.0)
        pairs = self.full_layers * (context + chunk * (chunk / 2.0 + prefix))
        read = self.full_layers * (context + prefix + chunk)
        if self.window_layers:
            w = self.window
            windowed = min(context, batch * w)
            pairs += self.window_layers * (windowed + chunk * min(chunk / 2.0 + prefix, w))
            read += self.window_layers * (windowed + min(prefix, w) + chunk)
        attention = (self.attn_flops * pairs, self.kv_layer_bytes * read)
        return dense, expert, attention

    def cost(self, batch: int, context: int, chunk: int = 0, prefix: int = 0) -> StepCost:
        if batch == 0 and chunk == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        flops = nbytes = compute = memory = gpu = 0.0
        for f, b in self.groups(batch, context, chunk, prefix if chunk else 0):
            t_c, t_m = f * self.inv_flops, b * self.inv_bw
            flops, nbytes, compute, memory = flops + f, nbytes + b, compute + t_c, memory + t_m
            gpu += max(t_c, t_m) + self.penalty * min(t_c, t_m)
        host = self.host_s + self.host_req_s * (batch + (1 if chunk else 0))
        return StepCost(flops, nbytes, compute, memory, gpu, host, max(gpu, host) + self.overhead_s)

    def step_s(self, batch: int, context: int, chunk: int = 0, prefix: int = 0) -> float:
        """Predicted wall time of one engine step (seconds): :meth:`cost`'s ``step_s``, inlined
        (the agent and the simulator call it in loops; tests pin the two to each other)."""
        tokens = batch + chunk
        if tokens == 0:
            return 0.0
        if not chunk:
            prefix = 0
        inv_f, inv_b, pen = self.inv_flops, self.inv_bw, self.penalty
        gpu = self.gemm_s.get(tokens)
        if gpu is None:
            gpu = self._gemm_s(tokens)
        pairs = self.full_layers * (context + chunk * (chunk / 2.0 + prefix))
        read = self.full_layers * (context + prefix + chunk)
        if self.window_layers:
            w = self.window
            windowed = context if context < batch * w else batch * w
            span = chunk / 2.0 + prefix
            pairs += self.window_layers * (windowed + chunk * (span if span < w else w))
            read += self.window_layers * (windowed + (prefix if prefix < w else w) + chunk)
        t_c = self.attn_flops * pairs * inv_f
        t_m = self.kv_layer_bytes * read * inv_b
        gpu += t_c + pen * t_m if t_c > t_m else t_m + pen * t_c
        host = self.host_s + self.host_req_s * (batch + 1 if chunk else batch)
        return (gpu if gpu > host else host) + self.overhead_s

    def _gemm_s(self, tokens: int) -> float:
        inv_f, inv_b, pen, tile = self.inv_flops, self.inv_bw, self.penalty, self.tile
        t_c = self.dense_flops_per_row * (tokens if tokens > tile else tile) * inv_f
        t_m = self.dense_bytes * inv_b
        gpu = t_c + pen * t_m if t_c > t_m else t_m + pen * t_c
        if self.experts:
            touched = self.experts * (1.0 - self.keep**tokens)
            rows = tokens * self.per_token
            if touched * tile > rows:
                rows = touched * tile
            t_c = self.expert_flops_per_row * rows * inv_f
            t_m = self.expert_bytes * touched / self.experts * inv_b
            gpu += t_c + pen * t_m if t_c > t_m else t_m + pen * t_c
        if len(self.gemm_s) < GEMM_CACHE:
            self.gemm_s[tokens] = gpu
        return gpu


GEMM_CACHE = 1 << 16
"""Token counts whose GEMM time a Roofline keeps (steps carry at most batch + one chunk)."""


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
