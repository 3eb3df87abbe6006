"""The demo's view: its outside check of DESIGN.md §5.3 (open debits vs the lease they were
granted on), the live frame and the summary of the two measured runs."""

from __future__ import annotations

from crossflow_ctl.client import NodeView
from crossflow_ctl.demo.observe import Observations
from crossflow_ctl.demo.router import RunStats
from crossflow_ctl.demo.scrape import EngineCounts, EngineTotals, GatewayFigures, parse
from crossflow_ctl.demo.view import RunResult, summary, summary_data
from crossflow_ctl.domain.models import (
    Credits,
    Lease,
    NodeInfo,
    NodeState,
    Reservation,
    ReservationState,
    StoredLease,
    ZeroReason,
)


def _lease(version: int, compute: int) -> Lease:
    return Lease(
        node_id="d1",
        epoch=1,
        version=version,
        ttl_ms=1000,
        credits=Credits(compute_tokens=compute, kv_tokens=10**6, slots=8, output_tokens=10**6),
    )


def _res(rid: str, version: int, compute: int) -> Reservation:
    return Reservation(
        reservation_id=rid,
        node_id="d1",
        state=ReservationState.COMMITTED,
        debit=Credits(compute_tokens=compute, kv_tokens=10, slots=1),
        lease_epoch=1,
        lease_version=version,
        created_at_ms=0,
        expires_at_ms=10**12,
        grant_seq=1,
    )


def test_debits_within_share_of_the_granting_lease_pass() -> None:
    obs = Observations()
    history = {"d1": [_lease(3, 1_000), _lease(2, 10_000)]}
    # granted on v2 (share 0.5 of 10k = 5k): 3k + 2k fits, although v3 is far smaller
    obs.check_grants([_res("a", 2, 3_000), _res("b", 2, 2_000)], history, share=0.5)
    assert (obs.over_commits, obs.checked) == ([], 1)


def test_debits_beyond_the_granting_lease_are_flagged() -> None:
    obs = Observations()
    history = {"d1": [_lease(2, 10_000)]}
    obs.check_grants([_res("a", 2, 3_000), _res("b", 2, 2_500)], history, share=0.5)
    assert obs.over_commits == ["d1: compute_tokens"]


def test_lease_out_of_history_is_not_judged() -> None:
    obs = Observations()
    obs.check_grants([_res("a", 9, 10**6)], {"d1": [_lease(2, 10)]}, share=1.0)
    assert (obs.over_commits, obs.checked) == ([], 0)


def test_itl_summary_counts_nodes_whose_lease_is_zero_for_itl() -> None:
    def view(node_id: str, itl: float, reason: ZeroReason | None) -> NodeView:
        lease = Lease(
            node_id=node_id, epoch=1, version=1, ttl_ms=1000, itl_ms=itl, zero_reason=reason
        )
        stored = StoredLease(lease=lease, received_at_ms=0, expires_at_ms=10_000)
        return NodeView(state=NodeState(info=NodeInfo(node_id=node_id), lease=stored))

    obs = Observations()
    obs.observe(
        [
            view("d1", 20.0, None),
            view("d2", 80.0, ZeroReason.ITL_OVER_SLO),
            view("d3", 5.0, ZeroReason.TELEMETRY_IMPLAUSIBLE),
        ],
        now_ms=1_000,
    )
    assert sorted(obs.itl_ms) == [20.0, 80.0]
    assert obs.zero_leases == 2


def test_frame_and_wide_tables_show_an_unmeasured_itl_as_missing() -> None:
    """An idle node's lease says ITL 0 (no decode step measured): the demo view and get -o wide
    printed 0.0 ms, faster than any engine; json keeps the lease's number."""
    import json

    from crossflow_ctl.cli.output import OutputFormat, render_list
    from crossflow_ctl.cli.views import LEASE_COLUMNS, NODE_COLUMNS, lease_row, node_row
    from crossflow_ctl.demo.router import RunStats
    from crossflow_ctl.demo.scrape import GatewayFigures
    from crossflow_ctl.demo.view import frame

    def view(node_id: str, itl: float) -> NodeView:
        lease = Lease(node_id=node_id, epoch=1, version=1, ttl_ms=1000, itl_ms=itl)
        stored = StoredLease(lease=lease, received_at_ms=0, expires_at_ms=10_000)
        return NodeView(state=NodeState(info=NodeInfo(node_id=node_id), lease=stored))

    nodes = [view("idle", 0.0), view("busy", 14.9)]
    figures = GatewayFigures(requests={"borrowed": 2.0, "normal": 5.0})
    text = frame(
        "t", 1.0, RunStats(), nodes, [], Observations(), 1, at_ms=0,
        gateway="http://127.0.0.1:9", figures=figures,
    )  # fmt: skip
    itl = {line.split()[0]: line.split()[-1] for line in text.splitlines()[-2:]}
    assert itl == {"idle": "-", "busy": "14.9"}, text
    # the gateway's own count by path, and where to curl it
    assert (
        "gateway http://127.0.0.1:9 (curl http://127.0.0.1:9/metrics): borrowed 2, normal 5, "
        "fallback 0, error 0; reservations open 0"
    ) in text, text
    for rows, columns in (
        ([node_row(n, 0) for n in nodes], NODE_COLUMNS),
        ([r for r in (lease_row(n, 0) for n in nodes) if r is not None], LEASE_COLUMNS),
    ):
        wide = render_list(rows, columns, OutputFormat.WIDE, kind="L").splitlines()
        at = [c.header for c in columns].index("ITL-MS")
        assert [line.split()[at] for line in wide[1:]] == ["<none>", "14.9"], wide
        data = json.loads(render_list(rows, columns, OutputFormat.JSON, kind="L"))
        assert [i["itl_ms"] for i in data["items"]] == [0.0, 14.9]


def _run(label: str, rows: list[tuple[str, float]], **extra: object) -> RunResult:
    stats = RunStats(released=len(rows), finished=len(rows))
    for i, (path, ttft) in enumerate(rows):
        stats.path_by_request[("s", i)] = path
        stats.ttft_by_request[("s", i)] = ttft
        stats.total_by_request[("s", i)] = ttft + 1000.0
    return RunResult(label, stats=stats, **extra)  # type: ignore[arg-type]


def test_summary_compares_the_two_measured_runs_by_the_gateways_path() -> None:
    """The same requests' TTFT with leases and static, and each path's p50 (the path the
    gateway's X-Crossflow-Path said) next to the same requests' static p50."""
    leases = _run(
        "leases",
        [("borrowed", 300.0), ("normal", 100.0), ("normal", 120.0), ("normal", 500.0)],
        reservations_left=0,
        gateway=GatewayFigures(
            requests={"borrowed": 1.0, "normal": 3.0},
            ttft_sum_s={"borrowed": 0.29},
            ttft_count={"borrowed": 1.0},
            reasons={"borrowed": 1.0, "no_demand": 3.0},
        ),
        engines=EngineTotals(borrowed_prompt_tokens=250.0, transferred_prompt_tokens=750.0),
    )
    static = _run(
        "static",
        [("normal", t) for t in (900.0, 100.0, 110.0, 400.0)],
        gateway=GatewayFigures(requests={"normal": 4.0}),
    )
    data = summary_data(leases, static)
    assert data["ttft_by_path"]["borrowed"] == {
        "requests": 1, "mean": 300.0, "p50": 300.0, "static_mean": 900.0, "static_p50": 900.0
    }  # fmt: skip
    assert data["ttft_by_path"]["normal"]["requests"] == 3
    assert data["compared_requests"] == 4 and data["static"]["borrowed"] == 0
    assert data["lost"] == 0 and data["reservations_left_open"] == 0
    text = summary("t", "1P1D", leases, static, "engines.")
    assert "  p50, borrowed (1)" in text and "-66.7%" in text, text
    assert "TTFT mean (ms)             255" in text, text
    assert "gateway paths: borrowed 1 (TTFT 290 ms), normal 3; static: normal 4" in text, text
    assert "25.0% computed there (borrowed), 75.0% by KV transfer from prefill" in text
    assert "requests lost: 0 (static run 0); reservations left open after the leases run: 0" in (
        text
    )
    assert "admission reasons: borrowed 1, no_demand 3" in text, text


def test_a_request_the_static_run_did_not_finish_is_not_compared() -> None:
    leases = _run("leases", [("normal", 100.0), ("borrowed", 200.0)])
    static = _run("static", [("normal", 300.0)])
    assert summary_data(leases, static)["compared_requests"] == 1
    text = summary("t", "1P1D", leases, None, "engines.")  # no static run
    assert "not run" in text and "requests finished / lost   2 / 0" in text, text


def test_engine_counters_give_where_prompts_were_prefilled_and_itl_over_the_slo() -> None:
    def counts(local: float, hit: float, moved: float, within: float, every: float) -> str:
        return (
            f'vllm:prompt_tokens_by_source_total{{source="local_compute"}} {local}\n'
            f'vllm:prompt_tokens_by_source_total{{source="local_cache_hit"}} {hit}\n'
            f'vllm:prompt_tokens_by_source_total{{source="external_kv_transfer"}} {moved}\n'
            "# TYPE vllm:inter_token_latency_seconds histogram\n"
            f'vllm:inter_token_latency_seconds_bucket{{le="0.045"}} {within}\n'
            f'vllm:inter_token_latency_seconds_bucket{{le="0.05"}} {within}\n'
            f'vllm:inter_token_latency_seconds_bucket{{le="+Inf"}} {every}\n'
            f"vllm:inter_token_latency_seconds_count {every}\n"
            "vllm:inter_token_latency_seconds_sum 1.0\n"
        )

    before = {
        "d1": EngineCounts.read(parse(counts(10, 0, 100, 50, 50))),
        "p1": EngineCounts.read(parse(counts(1000, 500, 0, 5, 5))),
    }
    after = {
        "d1": EngineCounts.read(parse(counts(110, 20, 400, 140, 150))),
        "p1": EngineCounts.read(parse(counts(3000, 900, 0, 5, 9))),
    }
    totals = EngineTotals.of(after, before, ["d1"], slo_ms=50.0)
    assert totals == EngineTotals(
        borrowed_prompt_tokens=100.0,
        decode_cached_prompt_tokens=20.0,
        transferred_prompt_tokens=300.0,
        computed_prompt_tokens=2100.0,
        cached_prompt_tokens=420.0,
        itl_over_slo=10.0,  # the prefill engine's steps are no ITL
        itl_observations=100.0,
    )


def test_gateway_figures_read_the_gateways_own_metrics() -> None:
    text = (
        "# TYPE crossflow_gateway_requests counter\n"
        'crossflow_gateway_requests_total{code="200",path="borrowed"} 3.0\n'
        'crossflow_gateway_requests_total{code="200",path="normal"} 5.0\n'
        'crossflow_gateway_requests_total{code="503",path="normal"} 1.0\n'
        "# TYPE crossflow_gateway_held_seconds histogram\n"
        'crossflow_gateway_held_seconds_bucket{le="+Inf"} 2.0\n'
        "crossflow_gateway_held_seconds_count 2.0\n"
        "crossflow_gateway_held_seconds_sum 0.5\n"
        'crossflow_gateway_admissions_total{decision="borrow",dispatch="borrowed_late",'
        'reason="borrowed"} 2.0\n'
    )
    g = GatewayFigures.read(parse(text))
    assert g.requests == {"borrowed": 3.0, "normal": 6.0}
    assert (g.held_count, g.held_mean_ms) == (2.0, 250.0)
    assert g.reasons == {"borrowed": 2.0} and g.dispatch == {"borrowed_late": 2.0}


def test_leases_are_counted_once_each_from_the_nodes_history() -> None:
    """The summary's "N distinct lease versions" was one lease a poll per node (polls x nodes,
    whatever the agents published); it now counts each (node, epoch, version) the view read in
    the nodes' recent histories, once, and says the SLO and how many leases were over it."""

    def lease(node: str, version: int, itl: float, epoch: int = 1) -> Lease:
        return Lease(
            node_id=node, epoch=epoch, version=version, ttl_ms=1000, itl_ms=itl, itl_slo_ms=50.0
        )

    obs = Observations()
    # two overlapping history reads of d1 (v1-v4, then v3-v6), d2 restarted (new epoch)
    obs.record("d1", [lease("d1", v, 20.0) for v in (4, 3, 2, 1)])
    obs.record("d1", [lease("d1", v, 60.0 if v == 6 else 20.0) for v in (6, 5, 4, 3)])
    obs.record("d2", [lease("d2", 9, 0.0), lease("d2", 8, 55.0), lease("d2", 1, 10.0, epoch=2)])
    assert obs.lease_updates == 6 + 3
    assert obs.itl_over_slo() == {"d1": (1, 6), "d2": (1, 2)}  # an idle lease (0) measured none
    data = summary_data(RunResult("leases", obs=obs), None)
    assert data["lease_versions_seen"] == 9 and data["itl_slo_ms"] == 50.0
    assert data["itl_over_slo"] == {
        "d1": {"over": 1, "samples": 6},
        "d2": {"over": 1, "samples": 2},
    }
    text = summary("t", "1P2D", RunResult("leases", obs=obs), None, "")
    assert "9 distinct lease versions seen from 2 decode nodes;" in text, text
    assert "SLO 50 ms, over it in 2 of 8 leases seen (25.0%; d1 1/6, d2 1/2)" in text, text
    # versions the view never read (v5-v9 of d3) are said, not counted
    obs.record("d3", [lease("d3", 10, 5.0), lease("d3", 4, 5.0)])
    text = summary("t", "1P3D", RunResult("leases", obs=obs), None, "")
    assert "11 distinct lease versions seen from 3 decode nodes (5 more published, not seen)" in (
        text
    )
