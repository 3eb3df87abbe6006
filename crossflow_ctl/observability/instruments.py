"""Typed instrument holders: one method per event, bounded label sets, Prometheus names.

Instruments come from a MeterProvider (the global one by default). Before
:func:`~crossflow_ctl.observability.metrics.setup_metrics` runs, the global provider is
OpenTelemetry's proxy, whose instruments do nothing; :meth:`BrokerMetrics.noop` and
:meth:`AgentMetrics.noop` make that explicit. Every label value is checked against a fixed set
(``other`` when unknown) and per-node series are capped, so a misbehaving caller cannot blow up
the time-series count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry.metrics import (
    CallbackOptions,
    Meter,
    MeterProvider,
    NoOpMeterProvider,
    Observation,
    get_meter_provider,
)

from crossflow_ctl.domain.admission import Decision, Reason
from crossflow_ctl.domain.models import CREDIT_NAMES, Credits, ZeroReason
from crossflow_ctl.domain.online_calibration import CalibrationState, Using
from crossflow_ctl.domain.step_fit import CONSTANTS, FitStatus, constants_of

METER_NAME = "crossflow"
OTHER = "other"
DEFAULT_MAX_NODES = 512

LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
SCRAPE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

DECISIONS = frozenset(d.value for d in Decision)
REASONS = frozenset(r.value for r in Reason)
ZERO_REASONS = frozenset(z.value for z in ZeroReason)
LEASE_RESULTS = frozenset({"accepted", "stale", "invalid"})
RESERVATION_EVENTS = frozenset({"commit", "release", "expire", "commit_late", "release_late"})
"""``expire``: a reservation dropped at its TTL (neither released in time nor, held, committed);
``commit_late`` / ``release_late``: a Commit or Release that found its reservation gone (it
expired, and its node's next lease may have purged it already; or its node was deleted): the
router came after the TTL, and the room it meant to hold or free was already back in the lease."""
LENDING = "lending"
DECODE_NODE_STATES = frozenset({LENDING, "expired", "no_lease"} | ZERO_REASONS)
"""What a decode node's latest lease says: ``lending`` (live, with credit), ``expired``,
``no_lease`` (none received yet), or the zero lease's reason (``cordoned`` for a cordoned node)."""
STORE_OPERATIONS = frozenset(
    {
        "admit", "admission_view", "debit", "commit", "release", "lease", "pool_load",
        "register", "read", "policy", "notices", "cordon", "expire", "admin", "list_nodes",
    }
)  # fmt: skip
SCRAPE_FAILURES = frozenset({"unreachable", "timeout", "http_error", "parse", "implausible"})
FIT_STATUSES = frozenset(f.value for f in FitStatus)


def label(value: object, allowed: frozenset[str]) -> str:
    """``value`` (an enum or a string) when it is in ``allowed``, else ``other``."""
    text = str(getattr(value, "value", value))
    return text if text in allowed else OTHER


_ADMISSION_ATTRIBUTES: dict[tuple[object, object], dict[str, str]] = {}
"""The admissions counter's attributes for each (decision, reason) recorded (as :func:`label`
makes them, made once: every answer is recorded), shared by every recording and never
changed after."""
_MAX_ADMISSION_ATTRIBUTES = 256
"""Its bound (decisions x reasons, with room): odd values past it are labelled per call."""


def _meter(meter_provider: MeterProvider | None) -> Meter:
    provider = meter_provider if meter_provider is not None else get_meter_provider()
    return provider.get_meter(METER_NAME)


class _NodeCredits:
    """Per-node credit values for an observable gauge, capped at ``max_nodes`` nodes."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self.values: dict[str, tuple[int, ...]] = {}
        self.dropped = 0

    def set(self, node_id: str, credits: Credits) -> None:
        if node_id not in self.values and len(self.values) >= self.max_nodes:
            self.dropped += 1
            return
        self.values[node_id] = credits.as_tuple()

    def forget(self, node_id: str) -> None:
        self.values.pop(node_id, None)

    def observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        for node_id, values in list(self.values.items()):
            for name, value in zip(CREDIT_NAMES, values, strict=True):
                yield Observation(value, {"node": node_id, "credit": name})


class _NodeLoad:
    """Per-node ITL, ITL SLO and open reservations for observable gauges, capped like
    :class:`_NodeCredits`."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self.values: dict[str, tuple[float, float, int]] = {}

    def set(self, node_id: str, itl_s: float, itl_slo_s: float, open_reservations: int) -> None:
        if node_id not in self.values and len(self.values) >= self.max_nodes:
            return
        self.values[node_id] = (itl_s, itl_slo_s, open_reservations)

    def forget(self, node_id: str) -> None:
        self.values.pop(node_id, None)

    def _observe(self, index: int) -> Iterable[Observation]:
        for node_id, values in list(self.values.items()):
            yield Observation(values[index], {"node": node_id})

    def itl(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._observe(0)

    def itl_slo(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._observe(1)

    def open_reservations(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._observe(2)


class BrokerMetrics:
    """Everything a broker replica counts (``crossflow_broker_*``)."""

    def __init__(
        self, meter_provider: MeterProvider | None = None, *, max_nodes: int = DEFAULT_MAX_NODES
    ) -> None:
        m = _meter(meter_provider)
        self._admissions = m.create_counter(
            "crossflow_broker_admissions", "1", "Admit answers by decision and reason"
        )
        self._shadow = m.create_counter(
            "crossflow_broker_shadow_decisions",
            "1",
            "Decisions taken in shadow mode (answered NORMAL), by what they would have been",
        )
        self._admission_latency = m.create_histogram(
            "crossflow_broker_admission_duration",
            "s",
            "Time to answer one Admit",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self._store_latency = m.create_histogram(
            "crossflow_broker_store_operation_duration",
            "s",
            "Time of one store operation, by operation",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self._store_errors = m.create_counter(
            "crossflow_broker_store_errors", "1", "Store operations that failed or timed out"
        )
        self._lost_debits = m.create_counter(
            "crossflow_broker_lost_debit_replies",
            "1",
            "Debits whose Admit stopped waiting and whose reply was then lost: granted or not is"
            " unknown, and a grant holds its room until its hold TTL",
        )
        self._leases = m.create_counter(
            "crossflow_broker_leases_received", "1", "Leases received, by accepted/stale/invalid"
        )
        self._zero_leases = m.create_counter(
            "crossflow_broker_zero_leases", "1", "Accepted zero leases, by reason"
        )
        self._reservations = m.create_counter(
            "crossflow_broker_reservation_events", "1", "Reservation commits, releases, expiries"
        )
        self._open_reservations = m.create_gauge(
            "crossflow_broker_open_reservations", "1", "Reservations that still count"
        )
        self._borrowed_tokens = m.create_gauge(
            "crossflow_broker_borrowed_tokens",
            "1",
            "Uncached prompt tokens debited by open reservations",
        )
        self._streams = m.create_up_down_counter(
            "crossflow_broker_stream_connections", "1", "Agent lease streams open on this replica"
        )
        self._breaker_state = m.create_gauge(
            "crossflow_broker_store_breaker_state",
            "1",
            "Admission's circuit breaker over the store: 0 closed (Admit calls the store), "
            "1 open (Admit answers NORMAL store_unavailable at once), 2 half-open (probing)",
        )
        self._breaker_opens = m.create_counter(
            "crossflow_broker_store_breaker_opens",
            "1",
            "Times admission's circuit breaker opened after consecutive store failures",
        )
        self._node_credits = _NodeCredits(max_nodes)
        m.create_observable_gauge(
            "crossflow_broker_node_available_credits",
            [self._node_credits.observe],
            "1",
            "Available credit per node (lease x share - open debits), each credit in its unit",
        )
        self._decode_nodes = m.create_gauge(
            "crossflow_broker_decode_nodes",
            "1",
            "Registered decode nodes by what their latest lease says: lending, expired, no_lease"
            " or the zero lease's reason",
        )
        self._node_load = _NodeLoad(max_nodes)
        m.create_observable_gauge(
            "crossflow_broker_node_itl",
            [self._node_load.itl],
            "s",
            "Inter-token latency the node's latest live lease reports",
        )
        m.create_observable_gauge(
            "crossflow_broker_node_itl_slo",
            [self._node_load.itl_slo],
            "s",
            "ITL SLO the node's latest live lease reports",
        )
        m.create_observable_gauge(
            "crossflow_broker_node_open_reservations",
            [self._node_load.open_reservations],
            "1",
            "Reservations that still count on the node (borrowed work it holds)",
        )
        self._zero_series()

    def _zero_series(self) -> None:
        """Every bounded series at zero from the start, so a rate or a ratio over it exists
        (an alert on an error counter cannot wait for the first error to make its series)."""
        for reason in REASONS - {Reason.BORROWED.value, Reason.BROKER_UNAVAILABLE.value}:
            self._admissions.add(0, {"decision": Decision.NORMAL.value, "reason": reason})
        self._admissions.add(
            0, {"decision": Decision.BORROW.value, "reason": Reason.BORROWED.value}
        )
        for operation in STORE_OPERATIONS:
            self._store_errors.add(0, {"operation": operation})
        for event in RESERVATION_EVENTS:
            self._reservations.add(0, {"event": event})
        for reason in ZERO_REASONS:
            self._zero_leases.add(0, {"reason": reason})
        self._lost_debits.add(0)
        self.set_decode_nodes({})

    @classmethod
    def noop(cls) -> BrokerMetrics:
        return cls(NoOpMeterProvider())

    def record_admission(
        self,
        decision: Decision | str,
        reason: Reason | str,
        seconds: float,
        *,
        shadow_decision: Decision | str | None = None,
    ) -> None:
        attributes = _ADMISSION_ATTRIBUTES.get((decision, reason))
        if attributes is None:
            attributes = {"decision": label(decision, DECISIONS), "reason": label(reason, REASONS)}
            if len(_ADMISSION_ATTRIBUTES) < _MAX_ADMISSION_ATTRIBUTES:
                _ADMISSION_ATTRIBUTES[(decision, reason)] = attributes
        self._admissions.add(1, attributes)
        self._admission_latency.record(max(0.0, seconds))
        if shadow_decision is not None:
            self._shadow.add(1, {"decision": label(shadow_decision, DECISIONS)})

    def record_store_operation(self, operation: str, seconds: float, *, ok: bool = True) -> None:
        op = label(operation, STORE_OPERATIONS)
        self._store_latency.record(max(0.0, seconds), {"operation": op})
        if not ok:
            self._store_errors.add(1, {"operation": op})

    def record_lost_debits(self, count: int) -> None:
        """``count`` late debits whose reply was lost (their fate unknown)."""
        self._lost_debits.add(count)

    def record_lease(self, result: str, zero_reason: ZeroReason | str | None = None) -> None:
        """One lease received: accepted, stale or invalid (zero reason when accepted zero)."""
        self._leases.add(1, {"result": label(result, LEASE_RESULTS)})
        if zero_reason is not None and result == "accepted":
            self.record_zero_lease(zero_reason)

    def record_zero_lease(self, reason: ZeroReason | str) -> None:
        self._zero_leases.add(1, {"reason": label(reason, ZERO_REASONS)})

    def record_reservation_event(self, event: str, count: int = 1) -> None:
        self._reservations.add(count, {"event": label(event, RESERVATION_EVENTS)})

    def set_open_reservations(self, count: int) -> None:
        self._open_reservations.set(count)

    def set_borrowed_tokens(self, tokens: int) -> None:
        self._borrowed_tokens.set(tokens)

    def set_node_credits(self, node_id: str, available: Credits) -> None:
        """Latest available credit of a node (series capped at ``max_nodes`` nodes)."""
        self._node_credits.set(node_id, available)

    def set_node_load(
        self, node_id: str, *, itl_ms: float, itl_slo_ms: float, open_reservations: int
    ) -> None:
        """A decode node's latest ITL and SLO (from its live lease) and the reservations that
        still count on it (series capped at ``max_nodes`` nodes)."""
        self._node_load.set(node_id, itl_ms / 1000.0, itl_slo_ms / 1000.0, open_reservations)

    def forget_node(self, node_id: str) -> None:
        self._node_credits.forget(node_id)
        self._node_load.forget(node_id)

    def set_decode_nodes(self, counts: Mapping[str, int]) -> None:
        """Decode nodes per lease state; every state is set (0 when absent), so the share of
        each is a plain ratio; states outside :data:`DECODE_NODE_STATES` count as ``other``."""
        totals = dict.fromkeys(DECODE_NODE_STATES | {OTHER}, 0)
        for state, count in counts.items():
            totals[state if state in DECODE_NODE_STATES else OTHER] += count
        for state, count in totals.items():
            self._decode_nodes.set(count, {"state": state})

    def set_store_breaker(self, state: int) -> None:
        """The breaker's state as its number (``domain.breaker.BREAKER_STATE_VALUES``)."""
        self._breaker_state.set(state)

    def record_store_breaker_open(self) -> None:
        self._breaker_opens.add(1)

    def stream_opened(self) -> None:
        self._streams.add(1)

    def stream_closed(self) -> None:
        self._streams.add(-1)


class AgentMetrics:
    """Everything a node agent counts (``crossflow_agent_*``)."""

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        m = _meter(meter_provider)
        self._scrape_latency = m.create_histogram(
            "crossflow_agent_scrape_duration",
            "s",
            "Time of one engine telemetry scrape",
            explicit_bucket_boundaries_advisory=SCRAPE_BUCKETS_S,
        )
        self._scrape_failures = m.create_counter(
            "crossflow_agent_scrape_failures", "1", "Engine scrapes that failed, by reason"
        )
        self._leases_sent = m.create_counter(
            "crossflow_agent_leases_sent", "1", "Leases sent to the broker, by kind credit/zero"
        )
        self._zero_leases = m.create_counter(
            "crossflow_agent_zero_leases", "1", "Zero leases sent, by reason"
        )
        self._stream_connected = m.create_gauge(
            "crossflow_agent_stream_connected", "1", "1 while the lease stream is up"
        )
        self._connections = m.create_counter(
            "crossflow_agent_stream_connections", "1", "Lease streams opened to a broker"
        )
        self._reconnects = m.create_counter(
            "crossflow_agent_stream_reconnects", "1", "Lease streams lost and retried"
        )
        self._credits = m.create_gauge(
            "crossflow_agent_lease_credits", "1", "Credits of the latest lease sent, per credit"
        )
        self._step_constants = m.create_gauge(
            "crossflow_agent_step_constant",
            "1",
            "Step-time constants of the capacity model (NodeProfile fields), per constant:"
            " profile=prior (preset or file), fitted (the last fit of the engine's telemetry),"
            " active (what leases are priced with)",
        )
        self._calibration_error = m.create_gauge(
            "crossflow_agent_calibration_error",
            "1",
            "Relative RMS error of the step-time model over the calibration windows,"
            " profile=prior or fitted",
        )
        self._calibration_windows = m.create_gauge(
            "crossflow_agent_calibration_windows", "1", "Busy telemetry windows the fit uses"
        )
        self._calibration_periods = m.create_counter(
            "crossflow_agent_calibration_periods",
            "1",
            "Calibration periods run, by the fit's status (fitted, too_few_windows,"
            " no_evidence, poor_fit)",
        )
        self._calibration_using = m.create_gauge(
            "crossflow_agent_calibration_using",
            "1",
            "1 for what leases are priced with now: state=prior, moving (toward the fit) or fitted",
        )
        # Series at zero from the start: an agent that never reaches a broker shows 0, not
        # nothing (an alert cannot see a series that was never made).
        self._stream_connected.set(0)
        self._connections.add(0)
        self._reconnects.add(0)
        for reason in SCRAPE_FAILURES:
            self._scrape_failures.add(0, {"reason": reason})
        for reason in ZERO_REASONS:
            self._zero_leases.add(0, {"reason": reason})

    @classmethod
    def noop(cls) -> AgentMetrics:
        return cls(NoOpMeterProvider())

    def record_scrape(self, seconds: float, *, failure: str | None = None) -> None:
        """One scrape; ``failure`` names why it failed (unreachable, timeout, parse, ...)."""
        self._scrape_latency.record(max(0.0, seconds))
        if failure is not None:
            self._scrape_failures.add(1, {"reason": label(failure, SCRAPE_FAILURES)})

    def record_lease_sent(
        self, credits: Credits, zero_reason: ZeroReason | str | None = None
    ) -> None:
        if zero_reason is None:
            self._leases_sent.add(1, {"kind": "credit"})
        else:
            self._leases_sent.add(1, {"kind": "zero"})
            self._zero_leases.add(1, {"reason": label(zero_reason, ZERO_REASONS)})
        self.set_credits(credits)

    def set_credits(self, credits: Credits | Mapping[str, int]) -> None:
        values = credits if isinstance(credits, Mapping) else credits.model_dump()
        for name in CREDIT_NAMES:
            self._credits.set(int(values.get(name, 0)), {"credit": name})

    def set_calibration(self, state: CalibrationState) -> None:
        """One calibration period's outcome (the agent calls it when a window closes)."""
        fit = state.fit
        profiles = {"prior": state.prior, "active": state.active}
        if fit is not None:
            profiles["fitted"] = fit.profile
            self._calibration_error.set(fit.error, {"profile": "fitted"})
            self._calibration_error.set(fit.prior_error, {"profile": "prior"})
            self._calibration_periods.add(1, {"status": label(fit.status, FIT_STATUSES)})
        for which, profile in profiles.items():
            values = constants_of(profile)
            for name in CONSTANTS:
                self._step_constants.set(values[name], {"constant": name, "profile": which})
        self._calibration_windows.set(state.windows)
        for using in Using:
            self._calibration_using.set(1 if state.using is using else 0, {"state": using.value})

    def stream_connected(self) -> None:
        self._connections.add(1)
        self._stream_connected.set(1)

    def stream_disconnected(self, *, reconnecting: bool = True) -> None:
        self._stream_connected.set(0)
        if reconnecting:
            self._reconnects.add(1)
