"""The roofline step-time kernel on plain floats: no pydantic, no I/O (compiled with mypyc when
the package is built so: setup.py). The model it computes, and the pydantic figures its
constants come from, are :mod:`crossflow_ctl.domain.capacity`'s (which re-exports these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile


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
    index_flops: float = 0.0
    """Indexer FLOPs per (query, key) pair per layer, over every past token (0: no indexer)."""
    index_bytes: float = 0.0
    """Indexer key bytes read per past token per layer."""
    index_layers: float = 0.0
    gemm_s: dict[int, float] = field(default_factory=dict, compare=False, repr=False)
    """GPU time of the dense and expert groups by tokens in the step (a function of that count
    alone), as :meth:`step_s` meets each count: the lease arithmetic asks for the same few."""

    @classmethod
    def of(cls, model: ModelSpec, node: NodeProfile) -> Roofline:
        expert_params = model.expert_params if model.experts else 0.0
        dense_params = model.total_params - expert_params
        experts = float(model.experts)
        # sparse attention attends to at most top-k tokens a query: a window's cost on every
        # layer (the tokens chosen are not the last ones, but as many); its indexer reads all
        full_layers, window_layers, window = (
            (0.0, float(model.layers), float(model.sparse_topk_tokens))
            if model.sparse_topk_tokens
            else (
                float(model.layers - model.sliding_layers),
                float(model.sliding_layers),
                float(model.sliding_window_tokens),
            )
        )
        indexed = model.indexer_heads * model.indexer_head_dim
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
            attn_flops=2.0 * model.q_heads * (model.attention_dim or 2 * model.head_dim),
            kv_layer_bytes=model.attention_kv_bytes,
            full_layers=full_layers,
            window_layers=window_layers,
            window=window,
            index_flops=2.0 * indexed,
            index_bytes=model.indexer_kv_bytes,
            index_layers=float(model.layers) if indexed else 0.0,
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
        flops, nbytes = self.attn_flops * pairs, self.kv_layer_bytes * read
        if self.index_layers:
            every = self.index_layers
            flops += self.index_flops * every * (context + chunk * (chunk / 2.0 + prefix))
            nbytes += self.index_bytes * every * (context + prefix + chunk)
        return dense, expert, (flops, nbytes)

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
        if self.index_layers:  # sparse attention's indexer: every past token, every layer
            every = self.index_layers
            t_c += self.index_flops * every * (context + chunk * (chunk / 2.0 + prefix)) * inv_f
            t_m += self.index_bytes * every * (context + prefix + chunk) * inv_b
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
