"""The lease loop: every period, scrape -> lease rules -> lease (or pool load) on the stream.

Per period (fixed schedule on the monotonic clock; a late tick skips missed ones):

1. read the highest notice sequence seen so far and the open reservations those notices leave
   (before the scrape: the snapshot is then known to be taken after every notice up to it,
   DESIGN.md §5.4, and borrowed work the broker still counts is not subtracted again);
2. scrape the engine (bounded by the scrape timeout), and feed its step counters to the online
   calibration (every ``calibration.window_s`` a window closes and the step-time constants move
   toward a fit of the engine's own telemetry, under the guards of
   :mod:`crossflow_ctl.domain.online_calibration`; the fit runs off the event loop);
3. decode role: apply the zero-lease rules and the capacity model
   (:func:`crossflow_ctl.domain.leasing.decide`), stamp node, epoch, next version, TTL and the
   notice sequence, round its credits down and send it when the deadband says so (a change
   beyond it, a new notice sequence, a zero reason, a new session, a refusal, or half the TTL
   since the last one: :mod:`crossflow_ctl.domain.deadband`); prefill role: send the pool load
   and a heartbeat.

A cordon/uncordon directive or a new session wakes the loop at once. On stop, a last zero lease
(SHUTTING_DOWN) is sent if connected and the stream is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import structlog

from crossflow_agent.scrape_log import ScrapeHealth
from crossflow_agent.settings import AgentSettings
from crossflow_agent.sources.base import ScrapeError, StepCounting, TelemetrySource
from crossflow_agent.stream import OUTBOX_SIZE, LeaseStream
from crossflow_ctl.aio import wait_any
from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, prefill_rate_tps, roofline
from crossflow_ctl.domain.clock import Clock, SystemClock
from crossflow_ctl.domain.deadband import Deadband
from crossflow_ctl.domain.lease_credits import CapacityBreakdown, LeaseSettings
from crossflow_ctl.domain.leasing import ItlGuard, LeaseDecision, decide, pool_load
from crossflow_ctl.domain.models import MAX_HORIZON_MS, Credits, Lease, NodeRole, ZeroReason
from crossflow_ctl.domain.online_calibration import (
    CalibrationState,
    OnlineCalibrator,
    StepModelReport,
)
from crossflow_ctl.domain.telemetry import EngineSnapshot
from crossflow_ctl.observability import AgentMetrics
from crossflow_ctl.wire.convert import (
    lease_to_proto,
    pool_load_to_proto,
    role_to_proto,
    step_model_to_proto,
)

log = structlog.get_logger()

AGENT_VERSION = "crossflow-agent/0.1.0"


def hello_request(
    *,
    node_id: str,
    role: NodeRole,
    epoch: int,
    pool: str,
    labels: dict[str, str],
    last_notice_seq: int,
) -> lease_pb2.ConnectRequest:
    """The first message of every session (and of every resumed one)."""
    hello = lease_pb2.Hello(
        node_id=node_id,
        role=common_pb2.NodeRole.ValueType(role_to_proto(role)),
        epoch=epoch,
        pool=pool,
        labels=labels,
        last_notice_seq=last_notice_seq,
        agent_version=AGENT_VERSION,
        notice_batches=True,  # stream.py reads ConnectResponse.notices
        refusal_acks=True,  # stream.py takes the cumulative ack on heartbeat answers
    )
    return lease_pb2.ConnectRequest(hello=hello)


def lease_request(lease: Lease) -> lease_pb2.ConnectRequest:
    return lease_pb2.ConnectRequest(lease=lease_to_proto(lease))


def _describe(source: TelemetrySource) -> str:
    url = getattr(source, "url", None)
    return f"{source.name} {url}" if url else source.name


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        source: TelemetrySource,
        model: ModelSpec,
        node: NodeProfile,
        *,
        metrics: AgentMetrics | None = None,
        clock: Clock | None = None,
        epoch: int | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``monotonic``: seconds, for the deadband's renewal (never the wall clock: one that
        stepped back would hold a lease past its TTL)."""
        self.settings = settings
        self.source = source
        self.model, self.node = model, node
        """The served model and the node's prior profile (preset or profile file)."""
        self.calibration = (
            OnlineCalibrator(model, node, settings.calibration)
            if settings.calibration.enabled
            else None
        )
        self._calibration_said = ""
        self._step_model: StepModelReport | None = None
        self._step_model_sent = (-1, -1)
        """(stream session, calibration period) of the step model last sent to a broker."""
        self.metrics = metrics or AgentMetrics.noop()
        self.clock = clock or SystemClock()
        self.epoch = epoch if epoch is not None else self.clock.now_ms()
        """New at every process start: the start time in ms (DESIGN.md §2)."""
        self.version = 0
        self.guard = ItlGuard()
        self._capacity: CapacityBreakdown | None = None
        """The last decision's capacity: it seeds the next period's searches (``decide``'s
        ``previous``; the same answers, fewer step-time evaluations while the load holds)."""
        self.scrape_health = ScrapeHealth(_describe(source), time.monotonic)
        self._state_said = ""
        """The lease state last logged ("lending", a zero reason, "unsent"; "" before the
        first), so only changes are said at info."""
        self._unacked: dict[tuple[int, int], tuple[ZeroReason | None, str]] = {}
        """(zero reason, detail) of each lease sent and not acked yet, by (epoch, version): its
        state is said once the broker accepts it (a lease on no stream lends nothing)."""
        self._broker_lease: tuple[LeaseSettings, LeaseSettings] | None = None
        """The local lease settings and their copy with the broker's horizon (lease_settings)."""
        self._monotonic = monotonic
        self.deadband = Deadband(settings.deadband_bits)
        """Which computed leases go (:mod:`crossflow_ctl.domain.deadband`)."""
        self._sent: tuple[Lease, float, int] | None = None
        """The last lease sent, when (monotonic ms) and on which session (its count)."""
        self._itls: deque[tuple[float, float]] = deque()
        """(monotonic ms, ITL) read over the last half TTL (Deadband.low_itl)."""
        self.sent = 0
        self.held = 0
        """Leases sent, and computed but held back by the deadband."""
        self._wake = asyncio.Event()
        self.stream = LeaseStream(
            endpoints=settings.brokers,
            hello=self._hello,
            metrics=self.metrics,
            connect_timeout_s=settings.connect_timeout_ms / 1000,
            backoff_initial_s=settings.backoff_initial_ms / 1000,
            backoff_max_s=settings.backoff_max_ms / 1000,
            stall_timeout_s=max(1.0, 10 * settings.period_ms / 1000),
            max_message_bytes=settings.max_message_bytes,
            on_change=self._wake.set,
            on_ack=self._acked,
            credentials=settings.broker_auth,
        )

    def _hello(self, last_notice_seq: int) -> lease_pb2.ConnectRequest:
        s = self.settings
        return hello_request(
            node_id=s.node_id,
            role=s.role,
            epoch=self.epoch,
            pool=s.pool,
            labels=dict(s.labels),
            last_notice_seq=last_notice_seq,
        )

    # -- one period ----------------------------------------------------------------------------

    async def observe(self) -> tuple[EngineSnapshot | None, str, ZeroReason]:
        """One bounded scrape: (snapshot, "", _) or (None, why it failed, the zero reason)."""
        started = time.perf_counter()
        timeout_s = self.settings.scrape_timeout_ms / 1000
        try:
            async with asyncio.timeout(timeout_s):
                snapshot = await self.source.scrape()
        except ScrapeError as exc:
            self.metrics.record_scrape(time.perf_counter() - started, failure=exc.kind)
            self.scrape_health.failed(exc.kind, str(exc))
            reason = (
                ZeroReason.TELEMETRY_IMPLAUSIBLE
                if exc.kind == "implausible"
                else ZeroReason.TELEMETRY_MISSING
            )
            return None, f"{exc.kind}: {exc}", reason
        except TimeoutError:
            self.metrics.record_scrape(time.perf_counter() - started, failure="timeout")
            self.scrape_health.failed("timeout", f"scrape took over {timeout_s:g} s")
            return None, f"timeout: scrape took over {timeout_s:g} s", ZeroReason.TELEMETRY_MISSING
        self.metrics.record_scrape(time.perf_counter() - started)
        self.scrape_health.ok()
        return snapshot, "", ZeroReason.TELEMETRY_MISSING

    @property
    def profile(self) -> NodeProfile:
        """The profile leases are priced with: the calibrated one, else the prior."""
        return self.calibration.profile if self.calibration is not None else self.node

    async def calibrate(self, snapshot: EngineSnapshot | None) -> None:
        """Feed the scrape's step counters to the online calibration (a scrape that gave a
        snapshot only); a period that closes a window fits off the event loop."""
        cal, source = self.calibration, self.source
        if cal is None or snapshot is None or not isinstance(source, StepCounting):
            return
        totals = source.step_totals()
        if not cal.closes(totals):
            cal.observe(totals)
            return
        await asyncio.to_thread(cal.observe, totals)
        state = cal.state()
        self.metrics.set_calibration(state)
        self._say_calibration(state)
        self._step_model = StepModelReport.of(state, self.clock.now_ms())

    def send_step_model(self) -> None:
        """Tell the broker the calibration (for describe): after each period, and once more on
        each new stream session (a broker that restarted, or another replica)."""
        report = self._step_model
        if report is None:
            return
        sent = (self.stream.state.sessions, report.periods)
        if sent == self._step_model_sent or not self.stream.state.connected:
            return
        message = lease_pb2.ConnectRequest(step_model=step_model_to_proto(report))
        if self.stream.send(message):
            self._step_model_sent = sent

    def _say_calibration(self, state: CalibrationState) -> None:
        """Log the calibration's state at info when it changes (prior, moving, fitted, and why
        a fit was refused), every period at debug."""
        fit = state.fit
        status = fit.status.value if fit is not None else ""
        said = f"{state.using.value}/{status}"
        fields = {
            "using": state.using.value,
            "fit": status,
            "fit_error": None if fit is None else round(fit.error, 4),
            "prior_error": None if fit is None else round(fit.prior_error, 4),
            "windows": state.windows,
            "detail": None if fit is None else fit.detail or None,
        }
        if said == self._calibration_said:
            log.debug("calibration.period", **fields)
            return
        self._calibration_said = said
        log.info("calibration.changed", **fields)

    def _next_version(self) -> int:
        s = self.stream.state
        if s.stale_epoch > self.epoch:
            log.warning(
                "lease.epoch_behind",
                epoch=self.epoch,
                stored_epoch=s.stale_epoch,
                hint="the clock went back, or another agent runs for this node",
            )
            self.epoch, self.version = s.stale_epoch + 1, 0
        elif s.stale_epoch == self.epoch and s.stale_version > self.version:
            self.version = s.stale_version
        self.version += 1
        return self.version

    def lease_for(self, decision: LeaseDecision, last_notice_seq: int) -> Lease:
        return decision.to_lease(
            node_id=self.settings.node_id,
            epoch=self.epoch,
            version=self._next_version(),
            ttl_ms=self.settings.ttl_ms,
            last_notice_seq=last_notice_seq,
        )

    def lease_settings(self) -> LeaseSettings:
        """The lease settings, with the broker's borrow horizon (its Welcome's, or the latest
        SessionSettings it pushed when its policy changed).

        The broker prices each grant's output over its own horizon and keeps a committed
        reservation for its commit TTL, which it validates against that horizon only; credits
        sized over a different local horizon would not match those debits, and a longer one
        would let borrowed prefill outlast the reservation (DESIGN.md §2, §4). The local
        ``horizon_ms`` stands until a broker sends one (0: not welcomed, or an older broker).
        """
        lease = self.settings.lease
        horizon = min(self.stream.state.borrow_horizon_ms, MAX_HORIZON_MS)
        if horizon <= 0 or horizon == lease.horizon_ms:
            return lease
        kept = self._broker_lease
        if kept is None or kept[0] is not lease or kept[1].horizon_ms != horizon:
            # one copy per horizon the broker sends, not one a period: the capacity model
            # looks up what it derives from the settings by the object's identity
            kept = self._broker_lease = (lease, lease.model_copy(update={"horizon_ms": horizon}))
        return kept[1]

    async def tick(self) -> Lease | None:
        """One period's work; the lease sent (decode role) or None (prefill role)."""
        state = self.stream.state
        seq = state.last_notice_seq  # read BEFORE the snapshot is taken
        open_debits = state.open_debits.totals()  # as of that sequence
        snapshot, failure, failure_reason = await self.observe()
        await self.calibrate(snapshot)
        now_ms = self.clock.now_ms()
        s = self.settings
        node = self.profile
        if s.role is NodeRole.PREFILL:
            load = pool_load(
                snapshot,
                now_ms=now_ms,
                node_id=s.node_id,
                pool=s.pool,
                ttl_ms=s.ttl_ms,
                settings=s.lease,
                modelled_rate_tps=prefill_rate_tps(self.model, node, s.lease.prefill_chunk_tokens),
                roof=roofline(self.model, node),
            )
            if load is not None:
                self.stream.send(lease_pb2.ConnectRequest(pool_load=pool_load_to_proto(load)))
            heartbeat = lease_pb2.Heartbeat(sent_unix_ms=now_ms)
            self.stream.send(lease_pb2.ConnectRequest(heartbeat=heartbeat))
            return None
        decision = decide(
            snapshot,
            now_ms=now_ms,
            model=self.model,
            node=node,
            settings=self.lease_settings(),
            guard=self.guard,
            cordoned=self.stream.state.cordoned,
            failure=failure,
            failure_reason=failure_reason,
            open_debits=open_debits,
            previous=self._capacity,
        )
        self.guard = decision.guard
        self._capacity = decision.capacity
        lease = self.deadband.shape(self.lease_for(decision, seq))
        self.send_step_model()
        now = self._monotonic() * 1000.0
        if self.deadband.enabled and lease.itl_ms > 0:
            lease = self.deadband.low_itl(lease, self._low_itl(now, lease))

        sessions = self.stream.state.sessions
        sent = self._sent if self._sent is not None and self._sent[2] == sessions else None
        going = self.deadband.to_send(
            lease, sent[0] if sent else None, now, sent[1] if sent else 0.0
        )
        if going is None:
            self.held += 1
            return lease
        lease = going
        if self.stream.send(lease_request(lease)):
            self._sent = (lease, now, sessions)
            self.sent += 1
            self.metrics.record_lease_sent(lease.credits, lease.zero_reason)
            self._unacked[(lease.epoch, lease.version)] = (lease.zero_reason, lease.zero_detail)
            if len(self._unacked) > OUTBOX_SIZE * 2:  # acks lost with a session
                del self._unacked[next(iter(self._unacked))]
        else:
            self._say_unsent(lease)
        return lease

    def _low_itl(self, now_ms: float, lease: Lease) -> float:
        """The lowest ITL read over the last half TTL, this period's included."""
        itls = self._itls
        itls.append((now_ms, lease.itl_ms))
        while itls[0][0] < now_ms - lease.ttl_ms / 2:
            itls.popleft()
        return min(itl for _, itl in itls)

    def _acked(self, epoch: int, version: int, accepted: bool) -> None:
        """A lease ack: the state of an accepted lease is the node's state at the broker.

        Accepted, it acks every lease sent up to it and not refused (a broker answering
        refusal acks acks cumulatively, on a heartbeat answer): their states are said in order,
        so a state the node passed through between two answers is said too. Refused: that
        lease only, and the next period sends one whatever the deadband says."""
        key = (epoch, version)
        if not accepted:
            self._unacked.pop(key, None)
            self._sent = None
            return
        for older in sorted(k for k in self._unacked if k <= key):
            self._say_lease_state(*self._unacked.pop(older))

    def _say_unsent(self, lease: Lease) -> None:
        """A lease computed with no broker session to send it on: said once until a broker
        accepts one again (the stream's session_failed says why there is none); not while the
        first session is still being set up."""
        stream = self.stream.state
        if self._state_said == "unsent" or (stream.attempts == 0 and stream.sessions == 0):
            return
        log.info(
            "lease.unsent",
            would_be="lending" if lease.zero_reason is None else lease.zero_reason.value,
            effect="no broker connection: the node lends nothing until a broker accepts a lease",
        )
        self._state_said = "unsent"

    def _say_lease_state(self, reason: ZeroReason | None, detail: str) -> None:
        """Log when the broker accepted a lease that turns the node zero (with why) or lending
        again, once per change: without it an agent at info said nothing while its node lent
        nothing (ITL over the SLO, say). NO_CAPACITY (a full node) is lending's normal ebb,
        said at debug only."""
        if reason is ZeroReason.NO_CAPACITY:
            log.debug("lease.zero", reason=reason.value, detail=detail)
            return
        state = "lending" if reason is None else reason.value
        if state == self._state_said:
            return
        if reason is None:
            log.info("lease.lending", was=self._state_said or None)
        else:
            log.info("lease.zeroed", reason=reason.value, detail=detail)
        self._state_said = state

    # -- the loop ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every period until ``stop``; then the staged shutdown."""
        period_s = self.settings.period_ms / 1000
        stream_task = asyncio.create_task(self.stream.run(), name="lease-stream")
        log.info(
            "agent.started",
            node_id=self.settings.node_id,
            epoch=self.epoch,
            role=self.settings.role.value,
            source=self.source.name,
        )
        try:
            next_at = time.monotonic()
            while not stop.is_set():
                self._wake.clear()
                try:
                    await self.tick()
                except Exception as exc:  # a bug must not leave the last credit standing
                    log.exception("agent.tick_failed")
                    self._send_zero(ZeroReason.TELEMETRY_IMPLAUSIBLE, f"agent error: {exc!r}")
                next_at += period_s
                now = time.monotonic()
                if next_at < now:  # late: skip the missed ticks
                    next_at = now + period_s
                await wait_any(stop, self._wake, timeout_s=next_at - time.monotonic())
        finally:
            await self._shutdown(stream_task)

    def _zero_lease(self, reason: ZeroReason, detail: str) -> Lease:
        return LeaseDecision(
            zero_reason=reason, zero_detail=detail, itl_slo_ms=self.settings.lease.itl_slo_ms
        ).to_lease(
            node_id=self.settings.node_id,
            epoch=self.epoch,
            version=self._next_version(),
            ttl_ms=self.settings.ttl_ms,
            last_notice_seq=self.stream.state.last_notice_seq,
        )

    def _send_zero(self, reason: ZeroReason, detail: str) -> None:
        if self.settings.role is not NodeRole.DECODE:
            return
        lease = self._zero_lease(reason, detail)
        if self.stream.send(lease_request(lease)):
            self.metrics.record_lease_sent(Credits(), reason)

    async def _shutdown(self, stream_task: asyncio.Task[None]) -> None:
        final = None
        if self.stream.state.connected and self.settings.role is NodeRole.DECODE:
            final = lease_request(self._zero_lease(ZeroReason.SHUTTING_DOWN, "agent stopping"))
            self.metrics.record_lease_sent(Credits(), ZeroReason.SHUTTING_DOWN)
        acked = await self.stream.close(final, self.settings.shutdown_grace_ms / 1000)
        stream_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stream_task
        log.info("agent.stopped", final_lease_acked=acked)
