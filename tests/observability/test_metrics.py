"""The Prometheus endpoint, scraped over real HTTP, and the typed instrument holders."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from crossflow_ctl.domain.admission import Decision, Reason
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.domain.models import Credits, ZeroReason
from crossflow_ctl.observability import (
    AgentMetrics,
    BrokerMetrics,
    MetricsEndpoint,
    instruments,
    parse_listen,
    setup_metrics,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
async def endpoint() -> AsyncIterator[MetricsEndpoint]:
    ep = await setup_metrics("127.0.0.1", 0, set_global=False)
    try:
        yield ep
    finally:
        await ep.close()


async def scrape(ep: MetricsEndpoint) -> Samples:
    async with httpx.AsyncClient(timeout=5.0) as client:
        response = await client.get(ep.url)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def test_port_zero_binds_a_real_port(endpoint: MetricsEndpoint) -> None:
    assert endpoint.port > 0
    assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
    async with httpx.AsyncClient(timeout=5.0) as client:
        assert (await client.get(f"http://127.0.0.1:{endpoint.port}/nope")).status_code == 404
        assert (await client.post(endpoint.url)).status_code == 405
        head = await client.head(f"{endpoint.url}?x=1")
        assert head.status_code == 200 and head.headers["content-type"].startswith("text/plain")
        for path in ("/", "/healthz"):
            ok = await client.get(f"http://127.0.0.1:{endpoint.port}{path}")
            assert (ok.status_code, ok.text) == (200, "ok\n")
    await endpoint.close()
    await endpoint.close()  # idempotent


async def test_broker_metrics_are_exposed_with_prometheus_names(
    endpoint: MetricsEndpoint,
) -> None:
    m = BrokerMetrics(endpoint.meter_provider)
    m.record_admission(Decision.BORROW, Reason.BORROWED, 0.002)
    m.record_admission(Decision.NORMAL, Reason.NO_DEMAND, 0.0004)
    m.record_admission("normal", "no_demand", 0.0006)
    m.record_admission(Decision.NORMAL, Reason.SHADOW_MODE, 0.001, shadow_decision=Decision.BORROW)
    m.record_store_operation("debit", 0.0015)
    m.record_store_operation("debit", 0.05, ok=False)
    m.record_lease("accepted")
    m.record_lease("accepted", zero_reason=ZeroReason.ITL_OVER_SLO)
    m.record_lease("stale")
    m.record_lease("invalid")
    m.record_reservation_event("commit")
    m.record_lost_debits(2)
    m.set_open_reservations(3)
    m.set_borrowed_tokens(4096)
    m.set_node_credits("decode-0", Credits(compute_tokens=8000, kv_tokens=20000, slots=4))
    m.stream_opened()
    m.stream_opened()
    m.stream_closed()
    m.record_store_breaker_open()
    m.set_store_breaker(1)

    s = await scrape(endpoint)
    adm = "crossflow_broker_admissions_total"
    assert value(s, adm, decision="borrow", reason="borrowed") == 1
    assert value(s, adm, decision="normal", reason="no_demand") == 2
    assert value(s, adm, decision="normal", reason="shadow_mode") == 1
    assert value(s, "crossflow_broker_shadow_decisions_total", decision="borrow") == 1
    assert value(s, "crossflow_broker_admission_duration_seconds_count") == 4
    assert value(s, "crossflow_broker_admission_duration_seconds_sum") == pytest.approx(0.004)
    # Base units: 0.4 ms and 0.6 ms fall at or under the 1 ms bucket, 2 ms does not.
    assert value(s, "crossflow_broker_admission_duration_seconds_bucket", le="0.001") == 3
    store = "crossflow_broker_store_operation_duration_seconds_count"
    assert value(s, store, operation="debit") == 2
    assert value(s, "crossflow_broker_store_errors_total", operation="debit") == 1
    leases = "crossflow_broker_leases_received_total"
    assert value(s, leases, result="accepted") == 2
    assert value(s, leases, result="stale") == 1
    assert value(s, leases, result="invalid") == 1
    assert value(s, "crossflow_broker_zero_leases_total", reason="itl_over_slo") == 1
    assert value(s, "crossflow_broker_reservation_events_total", event="commit") == 1
    assert value(s, "crossflow_broker_lost_debit_replies_total") == 2  # the name operators alert on
    assert value(s, "crossflow_broker_open_reservations") == 3
    assert value(s, "crossflow_broker_borrowed_tokens") == 4096
    credits = "crossflow_broker_node_available_credits"
    assert value(s, credits, node="decode-0", credit="compute_tokens") == 8000
    assert value(s, credits, node="decode-0", credit="kv_tokens") == 20000
    assert value(s, credits, node="decode-0", credit="slots") == 4
    assert value(s, credits, node="decode-0", credit="kv_transfer_bytes") == 0
    assert value(s, "crossflow_broker_stream_connections") == 1
    assert value(s, "crossflow_broker_store_breaker_state") == 1  # open
    assert value(s, "crossflow_broker_store_breaker_opens_total") == 1


async def test_label_values_are_bounded(endpoint: MetricsEndpoint) -> None:
    m = BrokerMetrics(endpoint.meter_provider, max_nodes=2)
    for i in range(5):
        m.record_admission("normal", f"made-up-{i}", 0.001)
        m.record_lease(f"weird-{i}")
        m.set_node_credits(f"node-{i}", Credits(compute_tokens=i + 1))
    s = await scrape(endpoint)
    assert value(s, "crossflow_broker_admissions_total", decision="normal", reason="other") == 5
    assert value(s, "crossflow_broker_leases_received_total", result="other") == 5
    nodes = {
        dict(labels)["node"]
        for name, labels in s
        if name == "crossflow_broker_node_available_credits"
    }
    assert nodes == {"node-0", "node-1"}


async def test_admission_labels_made_once_stay_bounded_for_odd_values(
    endpoint: MetricsEndpoint,
) -> None:
    """The (decision, reason) labels are made once per pair and kept, up to a bound: a flood of
    odd reasons neither grows the memo past it nor changes what is counted."""
    m = BrokerMetrics(endpoint.meter_provider)
    odd = 2 * instruments._MAX_ADMISSION_ATTRIBUTES
    for i in range(odd):
        m.record_admission("normal", f"odd-{i}", 0.001)
    m.record_admission(Decision.BORROW, Reason.BORROWED, 0.001)
    m.record_admission("borrow", "borrowed", 0.001)
    assert len(instruments._ADMISSION_ATTRIBUTES) <= instruments._MAX_ADMISSION_ATTRIBUTES
    s = await scrape(endpoint)
    adm = "crossflow_broker_admissions_total"
    assert (
        value(s, adm, decision="normal", reason="other")
        == 2 * instruments._MAX_ADMISSION_ATTRIBUTES
    )
    assert value(s, adm, decision="borrow", reason="borrowed") == 2


async def test_forgotten_node_leaves_the_scrape(endpoint: MetricsEndpoint) -> None:
    m = BrokerMetrics(endpoint.meter_provider)
    m.set_node_credits("a", Credits(slots=1))
    m.set_node_credits("b", Credits(slots=2))
    m.set_node_credits("b", Credits(slots=5))
    m.forget_node("a")
    s = await scrape(endpoint)
    credits = "crossflow_broker_node_available_credits"
    assert value(s, credits, node="b", credit="slots") == 5
    assert (credits, frozenset({("node", "a"), ("credit", "slots")})) not in s


async def test_agent_metrics_are_exposed(endpoint: MetricsEndpoint) -> None:
    m = AgentMetrics(endpoint.meter_provider)
    m.record_scrape(0.02)
    m.record_scrape(1.5, failure="timeout")
    m.record_scrape(0.01, failure="unreachable")
    m.record_lease_sent(Credits(compute_tokens=1000, output_tokens=300, slots=2))
    m.record_lease_sent(Credits(), ZeroReason.TELEMETRY_STALE)
    m.stream_connected()
    m.stream_disconnected()
    m.stream_connected()

    s = await scrape(endpoint)
    assert value(s, "crossflow_agent_scrape_duration_seconds_count") == 3
    assert value(s, "crossflow_agent_scrape_duration_seconds_sum") == pytest.approx(1.53)
    assert value(s, "crossflow_agent_scrape_failures_total", reason="timeout") == 1
    assert value(s, "crossflow_agent_scrape_failures_total", reason="unreachable") == 1
    assert value(s, "crossflow_agent_leases_sent_total", kind="credit") == 1
    assert value(s, "crossflow_agent_leases_sent_total", kind="zero") == 1
    assert value(s, "crossflow_agent_zero_leases_total", reason="telemetry_stale") == 1
    assert value(s, "crossflow_agent_stream_connections_total") == 2
    assert value(s, "crossflow_agent_stream_reconnects_total") == 1
    assert value(s, "crossflow_agent_stream_connected") == 1
    # The latest lease sent was the zero lease.
    assert value(s, "crossflow_agent_lease_credits", credit="compute_tokens") == 0


async def test_agent_calibration_is_exposed(endpoint: MetricsEndpoint) -> None:
    """The step-time constants (prior, fitted, active), both errors, the windows and the state."""
    from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
    from crossflow_ctl.domain.online_calibration import OnlineCalibrator
    from tests.domain.test_step_fit import TRUTH, varied_windows

    cal = OnlineCalibrator(MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"])
    m = AgentMetrics(endpoint.meter_provider)
    for period, win in enumerate(varied_windows(TRUTH, 0, n=4), start=1):
        cal.add(win, at_s=float(period))
        cal.update(float(period))
        m.set_calibration(cal.state())
    s = await scrape(endpoint)
    fit = cal.state().fit
    assert fit is not None
    for profile, node in (("prior", NODE_PRESETS["h200"]), ("fitted", fit.profile)):
        assert value(
            s, "crossflow_agent_step_constant", constant="flops_per_s", profile=profile
        ) == pytest.approx(node.flops_per_s)
    assert value(
        s, "crossflow_agent_step_constant", constant="hbm_bytes_per_s", profile="active"
    ) == pytest.approx(cal.profile.hbm_bytes_per_s)
    assert value(s, "crossflow_agent_calibration_error", profile="fitted") == pytest.approx(
        fit.error
    )
    assert value(s, "crossflow_agent_calibration_error", profile="prior") > fit.error
    assert value(s, "crossflow_agent_calibration_windows") == 4
    assert value(s, "crossflow_agent_calibration_periods_total", status="too_few_windows") == 2
    assert value(s, "crossflow_agent_calibration_periods_total", status="fitted") == 2
    using = {u: value(s, "crossflow_agent_calibration_using", state=u) for u in
             ("prior", "moving", "fitted")}  # fmt: skip
    assert sum(using.values()) == 1 and using["prior"] == 0


async def test_noop_holders_accept_every_event() -> None:
    b = BrokerMetrics.noop()
    b.record_admission(Decision.BORROW, Reason.BORROWED, 0.001, shadow_decision=Decision.BORROW)
    b.record_store_operation("debit", 0.001, ok=False)
    b.set_node_credits("n", Credits(slots=1))
    b.stream_opened()
    a = AgentMetrics.noop()
    a.record_scrape(0.1, failure="parse")
    a.record_lease_sent(Credits(), "cordoned")
    a.stream_disconnected()


async def test_busy_port_is_a_config_error(endpoint: MetricsEndpoint) -> None:
    with pytest.raises(ConfigError) as err:
        await setup_metrics("127.0.0.1", endpoint.port, set_global=False)
    assert err.value.field == "metrics_listen"


def test_parse_listen() -> None:
    assert parse_listen("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("9464", ":9464", "host:", "host:99999", "host:x"):
        with pytest.raises(ConfigError):
            parse_listen(bad)
