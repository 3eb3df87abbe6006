"""What an engine's telemetry says at one instant: the input of the capacity model.

An :class:`EngineSnapshot` records what a telemetry source observed, as observed. It does not
refuse odd values (a negative gauge, used > total, NaN): judging plausibility is the lease
rules' job (:func:`crossflow_ctl.domain.leasing.implausibility`), which turns such a snapshot
into a zero lease with its reason instead of a crash or a guess.

Rates and ITL quantiles are computed by the source over the window since its previous scrape
(counter deltas / elapsed time, ``histogram_quantile`` over bucket deltas); ``None`` means the
window had no samples (an idle engine, or the first scrape).
"""

from __future__ import annotations

from typing import Any

from crossflow_ctl.domain.models import Frozen, _built


class EngineSnapshot(Frozen):
    """One engine's state at ``taken_at_ms`` (agent wall clock, Unix ms)."""

    taken_at_ms: int
    source: str = ""
    """Which source produced it (``sglang``, ``vllm``, ``synthetic``), for logs only."""

    running_requests: int = 0
    """Requests in the decode batch now."""
    queued_requests: int = 0
    """Requests waiting in the engine's queue."""
    kv_used_tokens: int = 0
    """KV-cache token slots in use."""
    kv_total_tokens: int = 0
    """KV-cache token slots the engine has in all."""
    decode_context_tokens: int = 0
    """Sum of the context lengths of the running decode requests (the roofline's ``C``)."""

    generation_rate_tps: float = 0.0
    """Output tokens generated per second over the last window."""
    prompt_rate_tps: float = 0.0
    """Prompt (prefill) tokens processed per second over the last window."""
    itl_p50_ms: float | None = None
    """Median inter-token latency over the last window."""
    itl_p99_ms: float | None = None
    """99th-percentile inter-token latency over the last window."""
    kv_transfer_bytes_per_s: float | None = None
    """Observed KV transfer speed into the node (informational; credit uses the profile)."""

    outstanding_uncached_tokens: int = 0
    """Uncached prompt tokens queued or in flight (prefill role; borrowed work on decode)."""
    borrowed_kv_tokens: int = 0
    """KV token slots held by borrowed requests still in prefill (decode role; 0 when the engine
    cannot tell them apart, which leaves them counted by both the lease and the broker)."""
    kv_waiting_requests: int = 0
    """Requests waiting for KV room (decode role): transferred from the prefill pool, queued by
    the engine but not yet given KV. KV that frees goes to them first (SGLang's
    ``num_decode_prealloc_queue_reqs``; vLLM's ``num_requests_waiting_by_reason{reason=
    "capacity"}``)."""
    kv_waiting_tokens: int | None = None
    """The KV token slots those requests will take, when the engine tells (SGLang's
    ``pending_prealloc_token_usage`` x its KV total); None: the lease estimates them per request
    (``LeaseSettings.waiting_request_kv_tokens``)."""
    prefill_processing_rate_tps: float = 0.0
    """Uncached prompt tokens processed per second recently (prefill role)."""
    prefill_queue_wait_ms: float | None = None
    """Time the server needs to clear the prompts it holds, running and queued, counting their
    cached-prefix (context) cost (prefill role): the wait of a prompt sent to it now. None: the
    source cannot tell (no engine exports it; the simulator's servers do)."""
    prefill_mean_cached_tokens: float | None = None
    """Cached prefix tokens of a recent prompt, on average (prefill role): what prices the
    queued prompts on the roofline when the engine tells counts and token totals only
    (:func:`~crossflow_ctl.domain.leasing.modelled_queue_wait_ms`). None: not told."""

    window_s: float = 0.0
    """Length of the window behind the rates and quantiles (0 on a first scrape)."""

    @classmethod
    def observed(cls, values: dict[str, Any]) -> EngineSnapshot:
        """:meth:`~crossflow_ctl.domain.models.Frozen.trusted` for a dict the caller built with
        every field, in order, of its type: the dict becomes the snapshot's own (the caller
        keeps no reference), with neither keyword packing nor the order check (1.3 us, not
        2.5). For the simulator's per-tick telemetry, tens of thousands of snapshots a run;
        tests compare its snapshots with validated ones."""
        return _built(cls, values, _FIELD_NAMES)

    @property
    def kv_free_tokens(self) -> int:
        return max(0, self.kv_total_tokens - self.kv_used_tokens)


NUMERIC_FIELDS: tuple[str, ...] = tuple(
    name for name, f in EngineSnapshot.model_fields.items() if f.annotation is not str
)
"""The snapshot's numeric fields, in declaration order (counts, rates, quantiles, times)."""

_FIELD_NAMES: frozenset[str] = frozenset(EngineSnapshot.model_fields)
