"""The demo's outside check of DESIGN.md §5.3: open debits vs the lease they were granted on."""

from __future__ import annotations

from crossflow_ctl.client import NodeView
from crossflow_ctl.demo.view import Observations
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
    from crossflow_ctl.demo.router import RouterStats
    from crossflow_ctl.demo.view import frame

    def view(node_id: str, itl: float) -> NodeView:
        lease = Lease(node_id=node_id, epoch=1, version=1, ttl_ms=1000, itl_ms=itl)
        stored = StoredLease(lease=lease, received_at_ms=0, expires_at_ms=10_000)
        return NodeView(state=NodeState(info=NodeInfo(node_id=node_id), lease=stored))

    nodes = [view("idle", 0.0), view("busy", 14.9)]
    text = frame("t", 1.0, RouterStats(), nodes, [], Observations(), 1, at_ms=0)
    itl = {line.split()[0]: line.split()[-1] for line in text.splitlines()[-2:]}
    assert itl == {"idle": "-", "busy": "14.9"}, text
    for rows, columns in (
        ([node_row(n, 0) for n in nodes], NODE_COLUMNS),
        ([r for r in (lease_row(n, 0) for n in nodes) if r is not None], LEASE_COLUMNS),
    ):
        wide = render_list(rows, columns, OutputFormat.WIDE, kind="L").splitlines()
        at = [c.header for c in columns].index("ITL-MS")
        assert [line.split()[at] for line in wide[1:]] == ["<none>", "14.9"], wide
        data = json.loads(render_list(rows, columns, OutputFormat.JSON, kind="L"))
        assert [i["itl_ms"] for i in data["items"]] == [0.0, 14.9]


def test_summary_splits_ttft_by_the_path_each_request_took() -> None:
    """The TTFT p50 with leases was worse than static in four runs, with nothing to say why:
    the summary now gives each path's p50 next to the same requests' static p50."""
    from crossflow_ctl.demo.model import StaticResult
    from crossflow_ctl.demo.router import RouterStats
    from crossflow_ctl.demo.view import summary, summary_data

    stats = RouterStats(released=4, finished=4, borrowed=1)
    static = StaticResult(requests=4, ttft_ms=[], makespan_s=1.0)
    for i, (path, ttft, base) in enumerate(
        [("borrowed", 300.0, 900.0), ("normal", 100.0, 100.0), ("normal", 120.0, 110.0),
         ("held", 500.0, 400.0)]
    ):  # fmt: skip
        stats.path_by_request[("s", i)] = path
        stats.ttft_by_request[("s", i)] = ttft
        static.ttft_by_request[("s", i)] = base
    by_path = summary_data(stats, static, Observations())["ttft_by_path"]
    assert by_path["borrowed"] == {
        "requests": 1, "mean": 300.0, "p50": 300.0, "static_mean": 900.0, "static_p50": 900.0
    }  # fmt: skip
    assert by_path["normal"]["requests"] == 2 and by_path["held"]["static_p50"] == 400.0
    text = summary("t", "1P1D", 1.0, stats, static, Observations())
    assert "  p50, borrowed (1)" in text and "-66.7%" in text, text
    assert "p50, held, then prefill (1)" in text and "+25.0%" in text, text


def test_leases_are_counted_once_each_from_the_nodes_history() -> None:
    """The summary's "N distinct lease versions" was one lease a poll per node (polls x nodes,
    whatever the agents published); it now counts each (node, epoch, version) the view read in
    the nodes' recent histories, once, and says the SLO and how many leases were over it."""
    from crossflow_ctl.demo.model import StaticResult
    from crossflow_ctl.demo.router import RouterStats
    from crossflow_ctl.demo.view import summary, summary_data

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
    data = summary_data(RouterStats(), StaticResult(0, [], 0.0), obs)
    assert data["lease_versions_seen"] == 9 and data["itl_slo_ms"] == 50.0
    assert data["itl_over_slo"] == {
        "d1": {"over": 1, "samples": 6},
        "d2": {"over": 1, "samples": 2},
    }
    text = summary("t", "1P2D", 1.0, RouterStats(), StaticResult(0, [], 0.0), obs)
    assert "9 distinct lease versions seen from 2 decode nodes;" in text, text
    assert "SLO 50 ms, over it in 2 of 8 leases seen (25.0%; d1 1/6, d2 1/2)" in text, text
    # versions the view never read (v5-v9 of d3) are said, not counted
    obs.record("d3", [lease("d3", 10, 5.0), lease("d3", 4, 5.0)])
    text = summary("t", "1P3D", 1.0, RouterStats(), StaticResult(0, [], 0.0), obs)
    assert "11 distinct lease versions seen from 3 decode nodes (5 more published, not seen)" in (
        text
    )
