"""Simulated node agents: a telemetry snapshot of a simulated server, then the agent's real rules.

The snapshot is what an engine's ``/metrics`` would say (batch, KV used/total, context sum,
rates and ITL quantiles over the last period); the lease comes from
:func:`crossflow_ctl.domain.leasing.decide` (zero-lease rules, ITL hysteresis, capacity model)
and prefill load from :func:`crossflow_ctl.domain.leasing.pool_load`, exactly as the agent
daemon computes them. Leases go to the broker domain class (and so the store) every period;
each lease is stamped with the last notice the agent had read (DESIGN.md §5.4).
"""

from __future__ import annotations

import contextlib

from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, roofline
from crossflow_ctl.domain.errors import CrossflowError
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.leasing import ItlGuard, decide, pool_load
from crossflow_ctl.domain.lending import ChunkSizer, OpenDebits
from crossflow_ctl.domain.models import CREDIT_NAMES
from crossflow_ctl.domain.telemetry import EngineSnapshot
from crossflow_ctl.service import Broker
from crossflow_ctl.sim.servers import DecodeServer, PrefillServer


class DecodeAgent:
    def __init__(
        self,
        server: DecodeServer,
        node_id: str,
        model: ModelSpec,
        node: NodeProfile,
        settings: LeaseSettings,
        period_s: float,
        ttl_ms: int,
        follow_chunk: bool = True,
    ) -> None:
        self.server = server
        self.node_id = node_id
        self.model = model
        self.node = node
        self.settings = settings
        self.period_s = period_s
        self.ttl_ms = ttl_ms
        self.guard = ItlGuard()
        self.open_debits = OpenDebits()
        self.sizer = (
            ChunkSizer(
                roofline(model, node),
                settings.itl_slo_ms / 1000.0 * settings.slo_margin,
                settings.chunk_step_tokens,
                settings.max_chunk_tokens,
            )
            if follow_chunk
            else None
        )
        """The engine's chunk rule once the agent runs: each borrowed prompt's chunk is sized for
        its prefix within the agent's ITL budget."""
        self.version = 0
        self.last_notice_seq = 0
        self.last_tokens = 0
        self.zero_leases = 0
        self.leases = 0
        self.zero_reasons: dict[str, int] = {}
        self.credit_sums: dict[str, float] = dict.fromkeys(CREDIT_NAMES, 0.0)
        """Sum of each credit over the non-zero leases (for the report's mean lease)."""
        self.chunk_sum = 0
        """Sum of the sized borrowed chunk over the non-zero leases."""

    def snapshot(self, t: float, now_ms: int) -> EngineSnapshot:
        s = self.server
        p50, p99, _ = s.recent_itl(t, self.period_s)
        produced = s.tokens_out - self.last_tokens
        self.last_tokens = s.tokens_out
        return EngineSnapshot.model_construct(
            taken_at_ms=now_ms,
            source="sim",
            running_requests=s.batch,
            queued_requests=len(s.waiting) + len(s.borrow_q),
            kv_used_tokens=s.kv_used,
            kv_total_tokens=s.kv_capacity,
            decode_context_tokens=s.context_tokens(t),
            generation_rate_tps=produced / self.period_s,
            prompt_rate_tps=0.0,
            itl_p50_ms=p50,
            itl_p99_ms=p99,
            kv_transfer_bytes_per_s=None,
            outstanding_uncached_tokens=s.borrowed_outstanding,
            borrowed_kv_tokens=s.borrowed_kv,
            prefill_processing_rate_tps=0.0,
            window_s=self.period_s,
        )

    async def tick(self, broker: Broker, t: float, now_ms: int) -> None:
        notices = await broker.read_notices(self.node_id, self.last_notice_seq, 0)
        if notices:
            self.last_notice_seq = notices[-1].seq
            self.open_debits.apply(notices)
        decision = decide(
            self.snapshot(t, now_ms),
            now_ms=now_ms,
            model=self.model,
            node=self.node,
            settings=self.settings,
            guard=self.guard,
            open_debits=self.open_debits,
        )
        self.guard = decision.guard
        self.server.sizer = self.sizer
        self.version += 1
        lease = decision.to_lease(
            node_id=self.node_id,
            epoch=1,
            version=self.version,
            ttl_ms=self.ttl_ms,
            last_notice_seq=self.last_notice_seq,
        )
        self.leases += 1
        if lease.zero_reason is not None:
            self.zero_leases += 1
            why = lease.zero_reason.value
            self.zero_reasons[why] = self.zero_reasons.get(why, 0) + 1
        else:
            for name, value in zip(CREDIT_NAMES, lease.credits.as_tuple(), strict=True):
                self.credit_sums[name] += value
            if decision.capacity is not None:
                self.chunk_sum += decision.capacity.chunk_tokens
        await broker.ingest_lease(lease)


class PrefillAgent:
    def __init__(
        self,
        server: PrefillServer,
        node_id: str,
        settings: LeaseSettings,
        period_s: float,
        ttl_ms: int,
        kv_total_tokens: int,
    ) -> None:
        self.server = server
        self.node_id = node_id
        self.settings = settings
        self.period_s = period_s
        self.ttl_ms = ttl_ms
        self.kv_total_tokens = kv_total_tokens
        self.last_processed = 0.0

    def snapshot(self, t: float, now_ms: int) -> EngineSnapshot:
        s = self.server
        processed = s.processed_tokens(t)
        rate = max(0.0, processed - self.last_processed) / self.period_s
        self.last_processed = processed
        return EngineSnapshot.model_construct(
            taken_at_ms=now_ms,
            source="sim",
            running_requests=1 if s.current is not None else 0,
            queued_requests=len(s.queue),
            kv_used_tokens=0,
            kv_total_tokens=self.kv_total_tokens,
            decode_context_tokens=0,
            generation_rate_tps=0.0,
            prompt_rate_tps=rate,
            itl_p50_ms=None,
            itl_p99_ms=None,
            kv_transfer_bytes_per_s=None,
            outstanding_uncached_tokens=s.outstanding_tokens(t),
            prefill_processing_rate_tps=rate,
            window_s=self.period_s,
        )

    async def tick(self, broker: Broker, t: float, now_ms: int) -> None:
        load = pool_load(
            self.snapshot(t, now_ms),
            now_ms=now_ms,
            node_id=self.node_id,
            pool="default",
            ttl_ms=self.ttl_ms,
            settings=self.settings,
        )
        if load is not None:
            # Fail closed: on a store error the pool load expires and Demand fails.
            with contextlib.suppress(CrossflowError):
                await broker.ingest_pool_load(load)
