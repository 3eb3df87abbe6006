"""The gateway's Prometheus metrics (its own registry, served at ``/metrics``).

``crossflow_gateway_requests_total{path,code}``: requests by the path they took (``borrowed``,
``normal``, ``fallback``: no prefill engine answered and a decode engine prefilled it, or
``error``) and the HTTP status sent (``499`` when the client left before one was; a client
that hangs up mid-answer or right after its last byte is counted with the status it got).
``crossflow_gateway_ttft_seconds{path}``: from the request's arrival to the engine's first
byte. ``crossflow_gateway_overhead_seconds``: from arrival to the first engine hop being sent
(tokenizing, Admit, Commit, the held time excluded).
``crossflow_gateway_held_seconds``: time a prompt was held by late binding.
``crossflow_gateway_admissions_total{decision,reason,dispatch}``.
``crossflow_gateway_reservations_open``; ``crossflow_gateway_releases_total{outcome}``.
``crossflow_gateway_broker_unavailable_total``: Admits answered NORMAL because the broker could
not be asked (timeout, unreachable, store down). ``crossflow_gateway_engine_up{node,role}``;
``crossflow_gateway_engine_errors_total{node,role}``; ``crossflow_gateway_failovers_total
{role}``: requests moved to another engine because one failed before answering.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from crossflow_ctl.gateway.engines import Engine

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "crossflow_gateway_requests", "Requests by path taken and status", ["path", "code"],
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "crossflow_gateway_ttft_seconds", "Arrival to the engine's first byte", ["path"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.overhead = Histogram(
            "crossflow_gateway_overhead_seconds",
            "Arrival to the first engine hop sent, time held excluded",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.held = Histogram(
            "crossflow_gateway_held_seconds", "Time a prompt was held by late binding",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.admissions = Counter(
            "crossflow_gateway_admissions", "Admission outcomes",
            ["decision", "reason", "dispatch"], registry=r,
        )  # fmt: skip
        self.reservations_open = Gauge(
            "crossflow_gateway_reservations_open", "Reservations committed, not yet released",
            registry=r,
        )  # fmt: skip
        self.releases = Counter(
            "crossflow_gateway_releases", "Reservations released, by outcome", ["outcome"],
            registry=r,
        )  # fmt: skip
        self.broker_unavailable = Counter(
            "crossflow_gateway_broker_unavailable",
            "Requests sent on the normal path because the broker could not be asked",
            registry=r,
        )  # fmt: skip
        self.engine_up = Gauge(
            "crossflow_gateway_engine_up", "1 when the engine is in rotation", ["node", "role"],
            registry=r,
        )  # fmt: skip
        self.engine_errors = Counter(
            "crossflow_gateway_engine_errors", "Engine hops that failed", ["node", "role"],
            registry=r,
        )  # fmt: skip
        self.failovers = Counter(
            "crossflow_gateway_failovers", "Requests moved to another engine", ["role"],
            registry=r,
        )  # fmt: skip

    def engine_state(self, engine: Engine) -> None:
        self.engine_up.labels(engine.node_id, engine.role).set(1 if engine.healthy else 0)

    def forget_engine(self, engine: Engine) -> None:
        """An engine left the pool (discovery): its series go."""
        for metric in (self.engine_up, self.engine_errors):
            with contextlib.suppress(KeyError):
                metric.remove(engine.node_id, engine.role)

    def render(self) -> bytes:
        return generate_latest(self.registry)
