"""The event-driven P/D cluster: trace in, router + policy + servers + agents, a RunRecord out.

One event heap drives everything: request releases (open loop or closed loop), prefill
completions, KV arrivals at decode servers, decode steps (batched, see servers.py) and agent
periods. The leases policy goes through the real broker domain class
(:class:`crossflow_ctl.service.broker.Broker`: ``plan_admission``, ``debit_for``,
``try_debit``/``commit``/``release`` on the store) with a :class:`ManualClock` the simulator
moves; the store is the in-process :class:`MemoryStore` unless one is given (e.g. RedisStore).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from crossflow_ctl.domain.admission import AdmissionRequest, Decision
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.errors import CrossflowError
from crossflow_ctl.domain.models import NodeRole
from crossflow_ctl.service import Broker, BrokerSettings
from crossflow_ctl.sim.agents import DecodeAgent, PrefillAgent
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import RunRecord
from crossflow_ctl.sim.prefix_cache import CacheScope, PrefixCacheModel
from crossflow_ctl.sim.servers import (
    EV_DECODE_STEP,
    EV_PREFILL_DONE,
    DecodeServer,
    EventQueue,
    PrefillServer,
    Req,
    StepModel,
)
from crossflow_ctl.sim.traces import Trace
from crossflow_ctl.store.base import Store
from crossflow_ctl.store.memory import MemoryStore

EV_RELEASE = 1
EV_KV_ARRIVE = 4
EV_BORROW_ARRIVE = 5
EV_AGENT = 6
EV_POOL = 7

CLOCK_BASE_MS = 1_700_000_000_000


class Simulation:
    """One run of ``trace`` on the cluster and policy of ``config``."""

    def __init__(self, trace: Trace, config: SimConfig, store: Store | None = None) -> None:
        self.trace = trace
        self.cfg = config
        self.steps = StepModel(config.model_spec, config.node_profile)
        self.events = EventQueue()
        self.prefill = [
            PrefillServer(i, self.steps, config.prefill_chunk_tokens, self.events)
            for i in range(config.prefill_nodes)
        ]
        warm = trace.warmup_s
        self.decode = [
            DecodeServer(
                i,
                self.steps,
                self.events,
                kv_capacity=config.kv_capacity_tokens,
                max_batch=config.max_batch,
                max_macro=config.max_macro_steps,
                borrow_chunk=config.borrow_chunk_tokens,
                measure_from_s=warm,
            )
            for i in range(config.decode_nodes)
        ]
        self.cache = PrefixCacheModel(
            config.cache_scope, config.cache_capacity_tokens, config.prefill_nodes
        )
        self.nominal_prefill_tps = config.prefill_chunk_tokens / self.steps.step_s(
            0, 0, config.prefill_chunk_tokens
        )
        self.clock = ManualClock(CLOCK_BASE_MS)
        self.store: Store = store if store is not None else MemoryStore(seed=config.seed)
        self.broker = Broker(
            self.store, self.clock, BrokerSettings(policy=config.broker_policy), "sim"
        )
        self.decode_ids = tuple(f"decode-{i}" for i in range(config.decode_nodes))
        period = config.agent_period_ms / 1000.0
        self.decode_agents = [
            DecodeAgent(
                s,
                self.decode_ids[s.idx],
                config.model_spec,
                config.node_profile,
                config.lease,
                period,
                config.lease_ttl_ms,
                follow_chunk=config.lease_sized_chunks,
            )
            for s in self.decode
        ]
        self.prefill_agents = [
            PrefillAgent(
                s,
                f"prefill-{s.idx}",
                config.lease,
                period,
                config.lease_ttl_ms,
                config.kv_capacity_tokens,
            )
            for s in self.prefill
        ]
        self.reqs: dict[int, Req] = {}
        self.children: dict[int, list[int]] = {}
        self.spawned: dict[int, list[int]] = {}
        self.pending = 0
        self.now = 0.0
        self.record = RunRecord(label=config.label, trace=trace.name, scale=trace.scale)
        self.window_s = config.window_s / trace.scale
        self._win: dict[int, list[float]] = {}
        self._finishes: list[tuple[float, int, int]] = []
        """(finish, input, output tokens) of every served request, for the steady-state window."""

    # -- setup ------------------------------------------------------------------------------
    def _load_trace(self) -> None:
        for i, r in enumerate(self.trace.requests):
            if r.after_finish is not None:
                self.children.setdefault(r.after_finish, []).append(i)
            elif r.after_release is not None:
                self.spawned.setdefault(r.after_release, []).append(i)
            else:
                self.events.push(r.arrival_s, EV_RELEASE, i)
        self.pending = len(self.trace.requests)

    async def _start_agents(self) -> None:
        if self.cfg.policy is not PolicyKind.LEASES:
            return
        self._sync_clock(0.0)
        for node_id in self.decode_ids:
            await self.broker.register(node_id, NodeRole.DECODE, "default", {})
        for agent in self.prefill_agents:
            await self.broker.register(agent.node_id, NodeRole.PREFILL, "default", {})
        period = self.cfg.agent_period_ms / 1000.0
        n = len(self.decode_agents) + len(self.prefill_agents)
        for i in range(len(self.decode_agents)):
            self.events.push(period * i / n, EV_AGENT, i)
        for i in range(len(self.prefill_agents)):
            self.events.push(period * (len(self.decode_agents) + i) / n, EV_POOL, i)

    def _sync_clock(self, t: float) -> int:
        now_ms = CLOCK_BASE_MS + int(t * 1000.0)
        self.clock.set(now_ms)
        return now_ms

    # -- run --------------------------------------------------------------------------------
    async def run(self, progress: Callable[[int, int], None] | None = None) -> RunRecord:
        started = time.perf_counter()
        self._load_trace()
        await self._start_agents()
        total = self.pending
        events = 0
        while len(self.events) and self.pending > 0:
            t, kind, target, payload = self.events.pop()
            self.now = t
            events += 1
            if kind == EV_DECODE_STEP:
                server = self.decode[target]
                server.step_end(t, int(payload))  # type: ignore[call-overload]
                await self._drain(server, t)
            elif kind == EV_PREFILL_DONE:
                self._prefill_done(self.prefill[target].finish(t), t)
            elif kind == EV_RELEASE:
                await self._release(target, t)
            elif kind == EV_KV_ARRIVE:
                server = self.decode[target]
                server.arrive_normal(payload, t)  # type: ignore[arg-type]
                await self._drain(server, t)
            elif kind == EV_BORROW_ARRIVE:
                server = self.decode[target]
                server.arrive_borrowed(payload, t)  # type: ignore[arg-type]
                await self._drain(server, t)
            elif kind == EV_AGENT:
                await self.decode_agents[target].tick(self.broker, t, self._sync_clock(t))
                self.events.push(t + self.decode_agents[target].period_s, EV_AGENT, target)
            elif kind == EV_POOL:
                await self.prefill_agents[target].tick(self.broker, t, self._sync_clock(t))
                self.events.push(t + self.prefill_agents[target].period_s, EV_POOL, target)
            if progress is not None and events % 4096 == 0:
                progress(total - self.pending, total)
        if progress is not None:
            progress(total - self.pending, total)
        self._finish_record(time.perf_counter() - started, events)
        return self.record

    # -- routing ----------------------------------------------------------------------------
    async def _release(self, i: int, t: float) -> None:
        r = self.trace.requests[i]
        if r.cached_tokens is None:
            best, _ = self.cache.best_node(r.hash_ids)
            target = best if best is not None else self._least_loaded_prefill(t)
            cached = self.cache.admit(r.hash_ids, r.input_tokens, target)
        else:
            target = self._least_loaded_prefill(t)
            cached = r.cached_tokens
        req = Req(
            rid=i,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            cached_tokens=cached,
            release_s=t,
            measured=t >= self.trace.warmup_s,
        )
        self.reqs[i] = req
        for child in self.spawned.get(i, ()):
            self.events.push(t + self.trace.requests[child].delay_s, EV_RELEASE, child)
        if req.kv_need > self.cfg.kv_capacity_tokens:
            self.record.dropped += 1
            self._done(req, t)
            return
        node = await self._route(req, t)
        if node is None:
            self.prefill[
                target if self.cache.scope is CacheScope.NODE else self._least_loaded_prefill(t)
            ].enqueue(req, t)
        else:
            req.borrowed = True
            delay = self.steps.transfer_s(req.cached_tokens)
            self.events.push(t + delay, EV_BORROW_ARRIVE, node, req)

    def _least_loaded_prefill(self, t: float) -> int:
        return min(range(len(self.prefill)), key=lambda j: self.prefill[j].outstanding_tokens(t))

    def _pool_wait_s(self, t: float) -> float:
        out = sum(p.outstanding_tokens(t) for p in self.prefill)
        return out / (self.nominal_prefill_tps * len(self.prefill))

    async def _route(self, req: Req, t: float) -> int | None:
        """The decode node that will prefill ``req`` itself, or None for the normal path."""
        policy = self.cfg.policy
        if policy is PolicyKind.STATIC:
            return None
        if policy is PolicyKind.THRESHOLD:
            return self._threshold(req, t)
        return await self._lease(req, t)

    def _threshold(self, req: Req, t: float) -> int | None:
        cfg = self.cfg
        short = req.uncached_tokens < cfg.threshold_short_tokens
        if not short and self._pool_wait_s(t) * 1000.0 <= cfg.threshold_queue_ms:
            return None
        fits = [
            d
            for d in self.decode
            if d.kv_used + d.borrowed_outstanding + req.kv_need <= d.kv_capacity
        ]
        if not fits:
            return None
        return min(fits, key=lambda d: (d.borrowed_outstanding, d.kv_used, d.idx)).idx

    async def _lease(self, req: Req, t: float) -> int | None:
        self._sync_clock(t)
        request = AdmissionRequest(
            request_id=str(req.rid),
            uncached_prompt_tokens=req.uncached_tokens,
            cached_prefix_tokens=req.cached_tokens,
            expected_output_tokens=req.output_tokens,
            candidate_node_ids=self.decode_ids,
        )
        answer = await self.broker.admit(request)
        reasons = self.record.admit_reasons
        reasons[answer.reason.value] = reasons.get(answer.reason.value, 0) + 1
        if answer.decision is not Decision.BORROW:
            if answer.plan is not None and answer.reason.value == "no_room":
                short = self.record.short_credits
                for check in answer.plan.nodes:
                    for name in check.short_credits:
                        short[name] = short.get(name, 0) + 1
            return None
        await self._check_overcommit(answer.node_id, t)
        try:
            await self.broker.commit(answer.reservation_id)
        except CrossflowError:
            self.record.release_failures += 1
            return None
        req.reservation_id = answer.reservation_id
        return self.decode_ids.index(answer.node_id)

    async def _check_overcommit(self, node_id: str, t: float) -> None:
        state = await self.store.get_node(node_id, self._sync_clock(t))
        if state.lease is None:
            self.record.overcommits += 1
            return
        cap = state.lease.lease.credits.scaled(self.cfg.broker_policy.borrow_share)
        if cap.short_of(state.open_debits):
            self.record.overcommits += 1

    # -- completions ------------------------------------------------------------------------
    def _prefill_done(self, req: Req, t: float) -> None:
        node = min(
            self.decode,
            key=lambda d: (d.kv_used + sum(w.kv_need for w in d.waiting), d.idx),
        )
        self.events.push(t + self.steps.transfer_s(req.input_tokens), EV_KV_ARRIVE, node.idx, req)

    async def _drain(self, server: DecodeServer, t: float) -> None:
        if server.borrow_done:
            done, server.borrow_done = server.borrow_done, []
            for req in done:
                if req.reservation_id:
                    try:
                        await self.broker.release(req.reservation_id, "prefilled")
                    except CrossflowError:
                        self.record.release_failures += 1
        if server.finished:
            finished, server.finished = server.finished, []
            for req in finished:
                self._done(req, t)

    def _done(self, req: Req, t: float) -> None:
        self.pending -= 1
        for child in self.children.get(req.rid, ()):
            self.events.push(t + self.trace.requests[child].delay_s, EV_RELEASE, child)
        if req.first_token_s >= 0:
            self._observe(req)

    def _observe(self, req: Req) -> None:
        rec = self.record
        ttft = req.first_token_s - req.release_s
        itl = (
            (req.finish_s - req.first_token_s) / (req.output_tokens - 1)
            if req.output_tokens > 1
            else 0.0
        )
        win = self._win.setdefault(int(req.release_s // self.window_s), [0.0, 0.0, 0.0, 0.0, 0.0])
        win[0] += req.uncached_tokens
        win[1] += req.output_tokens
        win[2] += req.borrowed
        win[3] += ttft
        win[4] += 1
        self._finishes.append((req.finish_s, req.input_tokens, req.output_tokens))
        if not req.measured:
            return
        rec.measured += 1
        rec.completed += 1
        rec.ttft_s.append(ttft)
        rec.itl_req_s.append(itl)
        rec.input_tokens += req.input_tokens
        rec.output_tokens += req.output_tokens
        rec.borrowed += req.borrowed
        cfg = self.cfg
        rec.slo_ok += ttft * 1000.0 <= cfg.ttft_slo_ms and itl * 1000.0 <= cfg.lease.itl_slo_ms
        rec.span_s = max(rec.span_s, req.finish_s)

    def _finish_record(self, wall_s: float, events: int) -> None:
        rec = self.record
        first = min((r.release_s for r in self.reqs.values() if r.measured), default=0.0)
        rec.span_s = max(0.0, rec.span_s - first)
        start = self.trace.warmup_s
        end = max((r.release_s for r in self.reqs.values()), default=0.0)
        if end > start:
            rec.steady_s = end - start
            inside = [f for f in self._finishes if start <= f[0] <= end]
            rec.steady_input_tokens = sum(f[1] for f in inside)
            rec.steady_output_tokens = sum(f[2] for f in inside)
        end = self.now
        rec.busy_s = sum(p.busy_until(end) for p in self.prefill) + sum(
            d.busy_until(end) for d in self.decode
        )
        rec.capacity_s = end * (len(self.prefill) + len(self.decode))
        rec.borrow_kv_waits = sum(d.borrow_kv_waits for d in self.decode)
        for agent in self.decode_agents if self.cfg.policy is PolicyKind.LEASES else ():
            rec.leases += agent.leases
            rec.lease_chunk_sum += agent.chunk_sum
            for why, n in agent.zero_reasons.items():
                rec.zero_reasons[why] = rec.zero_reasons.get(why, 0) + n
            for name, v in agent.credit_sums.items():
                rec.lease_credit_sums[name] = rec.lease_credit_sums.get(name, 0.0) + v
        for d in self.decode:
            for k, w in d.itl_hist.items():
                rec.itl_hist[k] = rec.itl_hist.get(k, 0) + w
        rec.windows = [
            (
                idx * self.window_s,
                w[0] / w[1] if w[1] else 0.0,
                w[2] / w[4] if w[4] else 0.0,
                w[3] / w[4] if w[4] else 0.0,
            )
            for idx, w in sorted(self._win.items())
        ]
        rec.sim_events = events
        rec.wall_s = wall_s


async def simulate(
    trace: Trace,
    config: SimConfig,
    store: Store | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RunRecord:
    """Run ``trace`` through the cluster and policy of ``config``."""
    return await Simulation(trace, config, store).run(progress)
