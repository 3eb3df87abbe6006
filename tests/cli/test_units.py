"""Pure pieces of crossflowctl: rendering, selectors, the contexts file, exit-code mapping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from crossflow_ctl.cli.cmd_admit import admission_data, admission_text, conditions
from crossflow_ctl.cli.config import Context, CtlConfig, load_config, save_config
from crossflow_ctl.cli.exit_codes import CliError, ExitCode, exit_code_for, one_line
from crossflow_ctl.cli.output import Column, OutputFormat, render_list, table
from crossflow_ctl.cli.views import POOL_COLUMNS, age, pool_row
from crossflow_ctl.client import NodeView
from crossflow_ctl.domain.admission import (
    Admission,
    Decision,
    DemandCheck,
    NodeCheck,
    NormalPath,
    Plan,
    Reason,
)
from crossflow_ctl.domain.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StoreUnavailable,
)
from crossflow_ctl.domain.models import NodeInfo, NodeRole, NodeState, PoolLoad, PoolSnapshot
from crossflow_ctl.domain.policy import PolicySettings

COLUMNS = [Column("NAME", "name"), Column("SLOTS", "slots"), Column("POOL", "pool", wide=True)]
ROWS = [{"name": "decode-1", "slots": 4, "pool": "a"}, {"name": "d2", "slots": 0, "pool": ""}]


def test_table_is_aligned_and_wide_adds_columns() -> None:
    assert table(ROWS, COLUMNS, wide=False).splitlines() == [
        "NAME       SLOTS",
        "decode-1   4",
        "d2         0",
    ]
    assert table(ROWS, COLUMNS, wide=True).splitlines()[2] == "d2         0       <none>"


def test_json_and_yaml_wrap_lists_kubectl_style() -> None:
    as_json = json.loads(render_list(ROWS, COLUMNS, OutputFormat.JSON, kind="NodeList"))
    as_yaml = yaml.safe_load(render_list(ROWS, COLUMNS, OutputFormat.YAML, kind="NodeList"))
    assert as_json == as_yaml == {"kind": "NodeList", "items": ROWS}
    assert render_list([], COLUMNS, OutputFormat.TABLE, kind="NodeList") == "No resources found."


def test_age_is_kubectl_like() -> None:
    assert [age(1_000, 6_000), age(1_000, 181_000), age(1, 7_300_000), age(0, 5)] == [
        "5s",
        "3m",
        "2h",
        "<none>",
    ]


def test_contexts_file_round_trips_and_refuses_bad_values(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "config.yaml"
    assert load_config(path) == CtlConfig()  # no file: the built-in default context
    cfg = CtlConfig(current_context="prod", contexts={"prod": Context(server="broker:443")})
    save_config(path, cfg)
    assert load_config(path) == cfg
    assert "current-context: prod" in path.read_text()
    with pytest.raises(ConfigError, match="no context named 'dev'"):
        cfg.context("dev")
    path.write_text("contexts: {x: {server: a:1, defaults: {output: xml}}}\n")
    with pytest.raises(ConfigError, match=r"contexts\.x\.defaults\.output"):
        load_config(path)
    path.write_text("contexts: {x: {server: localhost}}\n")
    with pytest.raises(ConfigError) as refused:  # said "Value error, must be host:port, ..."
        load_config(path)
    assert str(refused.value) == f"{path}: contexts.x.server: must be host:port, got 'localhost'"
    path.write_text("contexts: [oops\n")
    with pytest.raises(ConfigError, match="cannot read") as err:
        load_config(path)
    assert str(err.value) == (  # one line, the file's own line (was PyYAML's 5-line report)
        f"cannot read {path}: line 2, column 1: while parsing a flow sequence:"
        " expected ',' or ']', but got '<stream end>'"
    )


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NotFound("unknown node 'x'", field="node_id"), ExitCode.NOT_FOUND),
        (InvalidArgument("bad", field="borrow_share"), ExitCode.USAGE),
        (ConfigError("bad file"), ExitCode.USAGE),
        (StoreUnavailable("down"), ExitCode.UNAVAILABLE),
        (FailedPrecondition("released"), ExitCode.ERROR),
        (CliError("late", ExitCode.TIMEOUT), ExitCode.TIMEOUT),
        (RuntimeError("boom"), ExitCode.ERROR),
    ],
)
def test_every_error_has_its_documented_exit_code(error: Exception, code: ExitCode) -> None:
    assert exit_code_for(error) == code


def test_a_model_refusal_is_a_usage_error_in_one_line() -> None:
    """A pydantic ValidationError that reached the CLI (sim --borrow-share 5 did) printed its
    whole multi-line report with a docs URL and exited 1."""
    with pytest.raises(ValidationError) as refused:
        PolicySettings(borrow_share=5)
    assert exit_code_for(refused.value) == ExitCode.USAGE
    assert one_line(refused.value) == (
        "error: borrow_share: Input should be less than or equal to 1"
    )


def test_errors_print_as_one_line() -> None:
    assert one_line(InvalidArgument("must be\n  <= 1", field="borrow_share")) == (
        "error: borrow_share: must be <= 1"
    )
    assert one_line(RuntimeError()) == "error: RuntimeError"


def test_pool_wait_says_no_rate_instead_of_a_sentinel() -> None:
    stalled = PoolSnapshot(
        pool="default",
        reports=(
            PoolLoad(
                node_id="prefill-1",
                outstanding_uncached_tokens=5_000,
                processing_rate_tps=0.0,
                ttl_ms=1_000,
            ),
        ),
    )
    row = pool_row(stalled)
    assert row["no_rate"] is True and row["estimated_wait_ms"] is None
    text = render_list([row], POOL_COLUMNS, OutputFormat.TABLE, kind="PoolList")
    assert "no rate" in text and "86400000" not in text
    assert (
        json.loads(render_list([row], POOL_COLUMNS, OutputFormat.JSON, kind="PoolList"))["items"][
            0
        ]["estimated_wait_ms"]
        is None
    )


def test_prefill_status_says_whether_its_load_report_is_live() -> None:
    def view(role: NodeRole, cordoned: bool = False) -> NodeView:
        return NodeView(state=NodeState(info=NodeInfo(node_id="n", role=role, cordoned=cordoned)))

    assert view(NodeRole.PREFILL).status(0, frozenset({("default", "n")})) == "Reporting"
    assert view(NodeRole.PREFILL).status(0, frozenset({("default", "other")})) == "NoReport"
    # a report left in the pool it moved from does not count for it
    assert view(NodeRole.PREFILL).status(0, frozenset({("old-pool", "n")})) == "NoReport"
    cordoned = view(NodeRole.PREFILL, cordoned=True)
    assert cordoned.status(0, frozenset({("default", "n")})) == "Cordoned"
    assert view(NodeRole.DECODE).status(0, frozenset({("default", "n")})) == "NoLease"


def test_lazy_command_table_matches_the_commands() -> None:
    import click

    from crossflow_ctl.cli.ctl import COMMANDS, SHORT_HELP_LIMIT, cli

    ctx = click.Context(cli)
    for name, (_, short) in COMMANDS.items():
        command = cli.get_command(ctx, name)
        assert command is not None and command.name == name
        assert short == command.get_short_help_str(limit=SHORT_HELP_LIMIT), name


def test_help_does_not_import_the_simulator() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from crossflow_ctl.cli.ctl import cli; from click.testing import CliRunner; "
        "r = CliRunner().invoke(cli, ['--help']); assert r.exit_code == 0, r.output; "
        "print(sorted(m for m in sys.modules if m.startswith(('crossflow_ctl.sim', "
        "'crossflow_ctl.service', 'crossflow_ctl.store', 'crossflow_ctl.client'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_admit_explain_shows_the_tokens_sent_since_the_pools_reports() -> None:
    demand = DemandCheck(
        holds=True,
        pool_wait_ms=150.0,
        threshold_ms=100.0,
        outstanding_uncached_tokens=500,
        processing_rate_tps=10_000.0,
        reporting_nodes=1,
        pending_uncached_tokens=1_000,
    )
    line = conditions(Plan(reason=Reason.NO_LEASES, demand=demand))[0]
    assert line == (
        "1. Demand   holds  prefill wait 150.0 ms > threshold 100.0 ms (500 outstanding tokens"
        " + 1000 sent since the reports / 10000 tokens/s, 1 reporting)"
    )


def test_admit_explain_names_the_prefill_server_whose_wait_demand_used() -> None:
    demand = DemandCheck(
        holds=True,
        pool_wait_ms=30_050.0,
        threshold_ms=100.0,
        outstanding_uncached_tokens=500,
        processing_rate_tps=20_000.0,
        reporting_nodes=2,
        pending_uncached_tokens=1_000,
        prefill_node_id="prefill-0",
        timed=True,
    )
    line = conditions(Plan(reason=Reason.NO_LEASES, demand=demand))[0]
    assert line == (
        "1. Demand   holds  prefill wait 30050.0 ms > threshold 100.0 ms (reported wait of"
        " prefill-0 + 1000 sent since the reports at 20000 tokens/s, 2 reporting)"
    )
    pooled = demand.model_copy(update={"prefill_node_id": None})
    assert (
        "(reported wait of the least-loaded server"
        in conditions(Plan(reason=Reason.NO_LEASES, demand=pooled))[0]
    )
    missing = conditions(
        Plan(
            reason=Reason.POOL_LOAD_MISSING, demand=demand.model_copy(update={"pool_wait_ms": None})
        )
    )[0]
    assert missing == "1. Demand   fails  no live load report from the prefill server prefill-0"


def _check(node_id: str, **fields: object) -> NodeCheck:
    return NodeCheck.model_validate({"node_id": node_id, **fields})


_DEMAND = DemandCheck(
    holds=True,
    pool_wait_ms=5000.0,
    threshold_ms=10.0,
    outstanding_uncached_tokens=50_000,
    processing_rate_tps=10_000.0,
    reporting_nodes=1,
)


def test_admit_explain_safety_names_credits_not_benefit_details() -> None:
    """With no node beating the normal path, the Safety line used to list each node's Benefit
    detail as what it was 'short on' ("decode-1 short on predicted 327.5 ms >= normal 5.3 ms")
    and say it fails although every node had room."""
    plan = Plan(
        reason=Reason.NO_BENEFIT,
        demand=_DEMAND,
        normal_path=NormalPath(wait_ms=0.0, prefill_ms=5.0, kv_transfer_ms=0.3),
        nodes=(
            _check("decode-1", verdict="no_benefit", detail="predicted 327.5 ms >= normal 5.3 ms",
                   queue_wait_ms=319.0, service_ms=8.5, safe=True),
            _check("decode-2", verdict="no_benefit", detail="predicted 400.0 ms >= normal 5.3 ms",
                   queue_wait_ms=390.0, service_ms=10.0, safe=False,
                   short_credits=("kv_tokens",)),
        ),
    )  # fmt: skip
    safety = conditions(plan)[2]
    assert safety.startswith("3. Safety   holds  decode-1 has room on every credit"), safety
    no_lease = _check("p-1", verdict="no_leases", detail="no lease")
    plan = plan.model_copy(update={"nodes": (plan.nodes[1], no_lease)})
    assert conditions(plan)[2] == "3. Safety   fails  decode-2 short on kv_tokens; p-1: no lease"


def test_admit_explain_names_candidate_nodes_the_broker_does_not_know() -> None:
    plan = Plan(reason=Reason.NO_LEASES, demand=_DEMAND)
    benefit = conditions(plan, asked=("nosuch", "nosuch"))[1]
    assert "no candidate node has a live lease (unknown nodes, not planned: nosuch);" in benefit


def test_admit_reason_is_printed_once_and_only_the_used_node_is_borrowed() -> None:
    plan = Plan(
        reason=Reason.BORROWED,
        demand=_DEMAND,
        nodes=(_check("decode-3", verdict="borrowed"), _check("decode-4", verdict="borrowed")),
    )
    refused = Admission.normal(
        Reason.NO_ROOM, "no_room: no node passes both benefit and safety", plan
    )
    text = admission_text(refused, explain=False)
    assert "Reason:" in text and "no_room: no_room" not in text
    assert "no_room: no node passes both benefit and safety" in text
    granted = Admission(
        decision=Decision.BORROW, reason=Reason.BORROWED, message="borrow on decode-3",
        node_id="decode-3", plan=plan,
    )  # fmt: skip
    rows = {
        line.split()[0]: line.split()[1]
        for line in admission_text(granted, explain=True).splitlines()
        if line.strip().startswith("decode-")
    }
    assert rows == {"decode-3": "borrowed", "decode-4": "eligible"}


def test_admit_explain_never_prices_a_node_without_a_live_lease() -> None:
    """A named candidate that is cordoned (or has no, an expired or a zero lease) was shown
    with a predicted TTFT of 0.0 ms and picked as the 'best' node of a Benefit that failed
    ("best decode-1 predicted 0.0 ms ... vs normal 92.7 ms")."""
    normal = NormalPath(wait_ms=0.0, prefill_ms=80.9, kv_transfer_ms=11.8)
    cordoned = _check("decode-1", verdict="no_leases", detail="cordoned")
    priced = _check("decode-2", verdict="no_benefit", detail="predicted 196.5 ms >= normal 92.7 ms",
                    service_ms=196.5, safe=True)  # fmt: skip
    plan = Plan(reason=Reason.NO_BENEFIT, demand=_DEMAND, normal_path=normal,
                nodes=(cordoned, priced))  # fmt: skip
    benefit = conditions(plan)[1]
    assert "best decode-2 predicted 196.5 ms" in benefit, benefit
    alone = Plan(reason=Reason.NO_LEASES, demand=_DEMAND, normal_path=normal, nodes=(cordoned,))
    lines = conditions(alone)
    assert lines[1].startswith("2. Benefit  fails  no candidate node has a live lease;"), lines
    assert lines[2] == "3. Safety   fails  decode-1: cordoned"
    text = admission_text(Admission.normal(Reason.NO_LEASES, "no leases", alone), explain=True)
    row = next(line for line in text.splitlines() if line.strip().startswith("decode-1"))
    assert row.split()[1:3] == ["no_leases", "<none>"], row


def test_watch_help_says_it_reprints_on_a_timer() -> None:
    """-w said "Keep printing as things change"; it prints every --interval seconds whether
    anything changed or not (kubectl's -w prints changes only)."""
    from click.testing import CliRunner

    from crossflow_ctl.cli.ctl import cli

    for resource in ("nodes", "leases", "reservations", "pools"):
        out = " ".join(CliRunner().invoke(cli, ["get", resource, "--help"]).output.split())
        assert "every --interval seconds, changed or not" in out, (resource, out)


def test_a_node_without_a_lease_has_no_lease_age_in_json() -> None:
    """-o json/yaml said "lease_age": "<none>" (the table's empty mark, a string where every
    other missing value of the row is null)."""
    from crossflow_ctl.cli.views import NODE_COLUMNS, node_row

    view = NodeView(state=NodeState(info=NodeInfo(node_id="p", role=NodeRole.PREFILL)))
    row = node_row(view, at_ms=1_000, reporting=frozenset({"p"}))
    item = json.loads(render_list([row], NODE_COLUMNS, OutputFormat.JSON, kind="NodeList"))
    assert item["items"][0]["lease_age_s"] is None and item["items"][0]["lease_version"] is None
    # the lease's epoch is named as reservations name it
    assert "epoch" not in item["items"][0] and item["items"][0]["lease_epoch"] is None
    assert table([row], NODE_COLUMNS, wide=False).splitlines()[1].split()[-1] == "<none>"


def test_wide_byte_columns_say_their_unit() -> None:
    """Every wide column with a unit says it (ITL-MS, RATE-TPS); KV-XFER showed 11825897472
    with no unit (bytes)."""
    from crossflow_ctl.cli.views import LEASE_COLUMNS, NODE_COLUMNS

    for columns, header in (
        (NODE_COLUMNS, "AVAIL-KV-XFER-BYTES"),
        (LEASE_COLUMNS, "KV-XFER-BYTES"),
    ):
        headers = {c.key: c.header for c in columns}
        assert headers["kv_transfer_bytes"] == header


def test_an_answer_without_a_plan_has_no_normal_path_ttft() -> None:
    """With borrowing disabled (or the store down) the answer carries normal_ttft_ms 0, which
    was printed as "Normal-path TTFT: 0.0 ms"."""
    text = admission_text(
        Admission.normal(Reason.BORROWING_DISABLED, "borrowing is disabled"), explain=True
    )
    assert "Normal-path TTFT: <none> (not estimated)" in text, text
    normal = NormalPath(wait_ms=1.0, prefill_ms=2.0, kv_transfer_ms=0.5)
    planned = Plan(reason=Reason.NO_DEMAND, demand=_DEMAND, normal_path=normal)
    text = admission_text(Admission.normal(Reason.NO_DEMAND, "no demand", planned), explain=False)
    assert "Normal-path TTFT: 3.5 ms" in text, text


def test_reservations_say_which_router_owns_them() -> None:
    """With auth only the owning router (or an admin) may commit or release a reservation,
    but neither -o wide nor -o json said who that was."""
    from crossflow_ctl.cli.views import RESERVATION_COLUMNS, reservation_row
    from crossflow_ctl.domain.models import Credits, Reservation, ReservationState

    res = Reservation(
        reservation_id="r@d1", node_id="d1", state=ReservationState.HELD, debit=Credits(),
        lease_epoch=1, lease_version=2, created_at_ms=0, expires_at_ms=10, grant_seq=1,
        owner="router/r1",
    )  # fmt: skip
    row = reservation_row(res, at_ms=0)
    assert row["owner"] == "router/r1"
    assert table([row], RESERVATION_COLUMNS, wide=True).splitlines()[1].split()[-1] == "router/r1"


def test_json_and_yaml_carry_numbers_where_the_table_shows_text(tmp_path: Path) -> None:
    """-o json/yaml carried the table's display strings: a lease version "v7", ages "3m",
    "expires_in": "537ms", the pool's "wait": "0" next to its number, a reservation's lease
    "1/2", and the current context as "*" (or ""). They now carry numbers and booleans; only
    the table formats them."""
    from click.testing import CliRunner

    from crossflow_ctl.cli.ctl import cli
    from crossflow_ctl.cli.views import (
        LEASE_COLUMNS,
        NODE_COLUMNS,
        RESERVATION_COLUMNS,
        lease_row,
        node_row,
        reservation_row,
    )
    from crossflow_ctl.domain.models import (
        Credits,
        Lease,
        Reservation,
        ReservationState,
        StoredLease,
    )

    at = 200_000
    lease = Lease(node_id="d1", epoch=5, version=7, ttl_ms=1_000)
    stored = StoredLease(lease=lease, received_at_ms=at - 180_000, expires_at_ms=at + 250)
    info = NodeInfo(node_id="d1", registered_at_ms=at - 185_000)
    view = NodeView(state=NodeState(info=info, lease=stored))
    res = Reservation(
        reservation_id="r@d1", node_id="d1", state=ReservationState.HELD, debit=Credits(),
        lease_epoch=1, lease_version=2, created_at_ms=at - 5_000, expires_at_ms=at - 1,
        grant_seq=1,
    )  # fmt: skip
    pool = PoolSnapshot(
        pool="default",
        reports=(PoolLoad(node_id="p1", outstanding_uncached_tokens=1_000,
                          processing_rate_tps=10_000.0, ttl_ms=1_000),),
    )  # fmt: skip
    cases = [
        (
            node_row(view, at),
            NODE_COLUMNS,
            {"lease_version": 7, "lease_age_s": 180, "age_s": 185},
            "v7",
        ),
        (lease_row(view, at), LEASE_COLUMNS, {"version": 7, "expires_in_ms": 250}, "250ms"),
        (
            reservation_row(res, at),
            RESERVATION_COLUMNS,
            {"lease_epoch": 1, "lease_version": 2, "age_s": 5, "expires_in_ms": -1},
            "expired",
        ),
        (pool_row(pool), POOL_COLUMNS, {"estimated_wait_ms": 100.0, "no_rate": False}, "100"),
    ]
    for row, columns, numbers, shown in cases:
        assert row is not None
        for fmt, load in ((OutputFormat.JSON, json.loads), (OutputFormat.YAML, yaml.safe_load)):
            item = load(render_list([row], columns, fmt, kind="L"))["items"][0]
            assert {k: item[k] for k in numbers} == numbers, (fmt, item)
            texts = [k for k, v in item.items() if isinstance(v, str) and v[:1].isdigit()]
            assert texts == [], f"display strings in {fmt}: {texts}"
        assert shown in table([row], columns, wide=True).split(), (shown, row)
    assert "3m" in table([cases[0][0]], NODE_COLUMNS, wide=False).split()

    config = tmp_path / "config.yaml"
    save_config(config, CtlConfig(current_context="b", contexts={"a": Context(), "b": Context()}))
    run = CliRunner().invoke(cli, ["--config", str(config), "config", "get-contexts", "-o", "json"])
    assert run.exit_code == 0, run.output
    current = {i["name"]: i["current"] for i in json.loads(run.output)["items"]}
    assert current == {"a": False, "b": True}
    run = CliRunner().invoke(cli, ["--config", str(config), "config", "get-contexts"])
    assert [line.split()[0] for line in run.output.splitlines()[1:]] == ["a", "*"], run.output


def test_set_context_refusals_name_the_flag(tmp_path: Path) -> None:
    """config set-context --server nohost said "error: server: must be host:port ..." (the
    model's field) and --pool of 70 characters "error: pool: ..."; they name the flag, exit 2,
    and the file is not written."""
    from click.testing import CliRunner

    from crossflow_ctl.cli.ctl import cli

    config = tmp_path / "config.yaml"
    for args, said in (
        (("--server", "nohost"), "--server: must be host:port, got 'nohost'"),
        (("--pool", "x" * 70), "--pool: String should have at most 64 characters"),
    ):
        run = CliRunner().invoke(
            cli, ["--config", str(config), "config", "set-context", "c", *args]
        )
        assert isinstance(run.exception, CliError), run.output
        assert (run.exception.message, run.exception.code) == (said, ExitCode.USAGE)
    assert not config.exists()


@pytest.mark.parametrize("argv", [["crossflowctl"], ["crossflowctl", "get"]])
def test_a_group_without_a_command_prints_its_help(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`crossflowctl` and `crossflowctl get` printed their whole help as an error:
    "error: Usage: crossflowctl [OPTIONS] ...", 30 lines, "... (see 'crossflowctl --help')"."""
    from crossflow_ctl.cli.common import run_cli
    from crossflow_ctl.cli.ctl import cli

    monkeypatch.setattr("sys.argv", argv)
    assert run_cli(cli, prog_name="crossflowctl") == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"Usage: {' '.join(argv)} [OPTIONS] COMMAND"), err
    assert "error:" not in err and "(see '" not in err, err


def test_a_refused_identity_is_named_and_a_missing_one_asked_for() -> None:
    from pathlib import Path

    from crossflow_ctl.cli.api import Target, _identity_hint
    from crossflow_ctl.security.settings import ClientCredentials

    bare = Target(server="b:50051", credentials=ClientCredentials())
    assert "authenticates callers: give --token-file FILE" in _identity_hint(bare)
    token = Target(server="b:50051", credentials=ClientCredentials(token_file=Path("/t")))
    assert "refused the identity given (--token-file /t)" in _identity_hint(token)


def test_admit_shows_node_texts_the_policy_leaves_to_the_numbers() -> None:
    """The policy no longer writes a passing (or Benefit- or Safety-failing) node's text per
    Admit; ``admit --explain`` and ``-o json`` still show it, made from the check's numbers."""
    normal = NormalPath(wait_ms=50.0, prefill_ms=40.0, kv_transfer_ms=2.5)
    plan = Plan(
        reason=Reason.BORROWED,
        demand=_DEMAND,
        normal_path=normal,
        nodes=(
            _check("decode-1", verdict="borrowed", queue_wait_ms=3.0, service_ms=9.5, safe=True,
                   benefit=True),
            _check("decode-2", verdict="no_benefit", queue_wait_ms=90.0, service_ms=9.0),
            _check("decode-3", verdict="no_room", benefit=True, short_credits=("kv_tokens",)),
            _check("decode-4", verdict="no_leases", detail="cordoned"),
        ),
    )  # fmt: skip
    granted = Admission(
        decision=Decision.BORROW, reason=Reason.BORROWED, node_id="decode-1", plan=plan
    )
    want = ["predicted 12.5 ms", "predicted 99.0 ms >= normal 92.5 ms", "short on kv_tokens",
            "cordoned"]  # fmt: skip
    data = admission_data(granted)
    assert [n["detail"] for n in data["plan"]["nodes"]] == want
    assert [c.detail for c in plan.nodes] == ["", "", "", "cordoned"]  # the model keeps none
    text = admission_text(granted, explain=True)
    for line in want:
        assert line in text, text
