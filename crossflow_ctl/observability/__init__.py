"""Metrics, traces and logs for the broker and the agent (issue 7).

Usage, in a process entry point (configure once, there; library code only uses the API)::

    from crossflow_ctl.observability import (
        BrokerMetrics, parse_listen, setup_logging, setup_metrics, setup_tracing,
    )

    setup_logging(json=settings.log_json, level=settings.log_level)
    setup_tracing(settings.otlp_endpoint)                  # None: nothing exported
    endpoint = await setup_metrics(*parse_listen(settings.metrics_listen))   # port 0 works
    metrics = BrokerMetrics(endpoint.meter_provider)       # or AgentMetrics(...)
    # the broker's server interceptor wraps each RPC in rpc_span (crossflow_ctl.broker.interceptor)
    ...
    await endpoint.close()                                 # on shutdown

Library code (servicers, the agent loop) takes the ``BrokerMetrics``/``AgentMetrics`` it is
given (``BrokerMetrics.noop()`` in tests that do not care) and calls one method per event::

    metrics.record_admission(admission.decision, admission.reason, seconds,
                             shadow_decision=admission.shadow_decision)
    metrics.record_store_operation("debit", seconds, ok=True)
    metrics.record_lease("accepted", zero_reason=lease.zero_reason)   # or "stale" / "invalid"
    metrics.set_node_credits(node_id, available); metrics.stream_opened() / stream_closed()
    agent_metrics.record_scrape(seconds, failure=None | "timeout" | ...)
    agent_metrics.record_lease_sent(lease.credits, lease.zero_reason)
    agent_metrics.set_calibration(calibrator.state())   # each calibration period

Inside an RPC (the broker's interceptor made the span current)::

    annotate_decision(admission.decision, admission.reason, admission.node_id)
    structlog.get_logger().debug("admission decided", decision=..., reason=...)  # has trace_id

Prometheus names: ``crossflow_broker_admissions_total{decision,reason}``,
``crossflow_broker_admission_duration_seconds``, ``crossflow_broker_store_operation_duration_
seconds{operation}``, ``crossflow_broker_store_errors_total``,
``crossflow_broker_lost_debit_replies_total`` (late debits whose reply was lost: granted or not
is unknown, held until the hold TTL; alert on it), ``crossflow_broker_leases_received_
total{result}``, ``crossflow_broker_zero_leases_total{reason}``, ``crossflow_broker_open_
reservations``, ``crossflow_broker_borrowed_tokens``, ``crossflow_broker_node_available_credits
{node,credit}``, ``crossflow_broker_stream_connections``, ``crossflow_broker_decode_nodes{state}``
(lending, expired, no_lease or the zero reason), ``crossflow_broker_node_itl_seconds{node}``,
``crossflow_broker_node_itl_slo_seconds{node}``, ``crossflow_broker_node_open_reservations
{node}``, ``crossflow_broker_reservation_events_total{event}`` (commit, release, expire,
commit_late, release_late); ``crossflow_agent_scrape_duration_
seconds``, ``crossflow_agent_scrape_failures_total{reason}``, ``crossflow_agent_leases_sent_total
{kind}``, ``crossflow_agent_zero_leases_total{reason}``, ``crossflow_agent_stream_connected``,
``crossflow_agent_stream_reconnects_total``, ``crossflow_agent_lease_credits{credit}``;
online calibration: ``crossflow_agent_step_constant{constant,profile}`` (profile prior, fitted,
active), ``crossflow_agent_calibration_error{profile}``, ``crossflow_agent_calibration_windows``,
``crossflow_agent_calibration_periods_total{status}``, ``crossflow_agent_calibration_using
{state}``.
"""

from crossflow_ctl.observability.instruments import AgentMetrics, BrokerMetrics
from crossflow_ctl.observability.logs import add_trace_context, setup_logging
from crossflow_ctl.observability.metrics import MetricsEndpoint, parse_listen, setup_metrics
from crossflow_ctl.observability.tracing import (
    annotate_decision,
    annotate_node,
    extract_context,
    inject_metadata,
    mark_error,
    rpc_span,
    setup_tracing,
    span,
    spans_recorded,
)

__all__ = [
    "AgentMetrics",
    "BrokerMetrics",
    "MetricsEndpoint",
    "add_trace_context",
    "annotate_decision",
    "annotate_node",
    "extract_context",
    "inject_metadata",
    "mark_error",
    "parse_listen",
    "rpc_span",
    "setup_logging",
    "setup_metrics",
    "setup_tracing",
    "span",
    "spans_recorded",
]
