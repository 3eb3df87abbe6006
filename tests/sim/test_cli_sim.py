"""``crossflowctl sim`` end to end, as a real process: a report with tables and PNG plots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CTL = "from crossflow_ctl.cli.ctl import main; main()"


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CTL, *args], capture_output=True, text=True, timeout=100
    )


def test_sim_writes_a_report_with_plots(mooncake_sample: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = _ctl(
        "sim",
        "--trace", str(mooncake_sample),
        "--limit", "80",
        "--load", "4",
        "--splits", "2P4D",
        "--borrow-splits", "2P4D",
        "--warmup-s", "0",
        "--jobs", "1",
        "--borrow-kv-share", "0.75",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "simulating" in result.stderr  # the progress bar
    text = (out / "report.md").read_text()
    assert "| mooncake_conversation_trace_head600 | 4x | 2P4D/leases |" in text
    assert "| mooncake_conversation_trace_head600 | 4x | 2P4D/static | 2P4D/threshold |" in text
    assert "Over-commit count over all runs: **0**" in text
    assert "borrow share 0.5 (KV 0.75);" in text
    assert (
        "router queue fifo, hold up to 600,000 ms, fresh-first (smallest) once behind 5,000 ms;"
        in text
    )
    for png in ("timeseries.png", "ttft_cdf.png", "itl_cdf.png", "sweep.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in text


def test_sim_without_a_trace_is_a_usage_error(tmp_path: Path) -> None:
    result = _ctl("sim", "--out", str(tmp_path / "x"))
    assert result.returncode == 2
    assert "--trace" in result.stderr
    assert not (tmp_path / "x").exists()


def test_sim_refuses_a_malformed_session_file(tmp_path: Path) -> None:
    bad = tmp_path / "s.jsonl"
    bad.write_text(
        '{"session_id": "a", "seq": 0, "parent_session_id": null, "offset_s": null,'
        ' "think_time_s": 0, "input_length": 5, "cached_prefix_tokens": 9,'
        ' "output_length": 1}\n'
    )
    result = _ctl("sim", "--trace", str(bad), "--out", str(tmp_path / "x"))
    assert result.returncode != 0
    assert "line 1" in result.stderr and "cached_prefix_tokens" in result.stderr


def test_sim_refuses_a_negative_hold_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "s.jsonl"
    bad.write_text(
        '{"session_id": "a", "seq": 0, "parent_session_id": null, "offset_s": null,'
        ' "think_time_s": 0, "input_length": 5, "cached_prefix_tokens": 1,'
        ' "output_length": 1}\n'
    )
    result = _ctl("sim", "--trace", str(bad), "--max-hold-ms", "-5", "--out", str(tmp_path / "x"))
    assert result.returncode == 2, result.stderr
    assert "--max-hold-ms" in result.stderr
    assert not (tmp_path / "x").exists()


def test_sim_refuses_an_unknown_fresh_order_naming_the_flag(tmp_path: Path) -> None:
    result = _ctl("sim", "--synthetic", "--fresh-order", "oldest", "--out", str(tmp_path / "x"))
    assert result.returncode == 2, result.stderr
    assert "--fresh-order" in result.stderr
    assert not (tmp_path / "x").exists()


def test_the_report_says_how_the_router_queue_orders_held_prompts() -> None:
    from crossflow_ctl.client.holding import QueueConfig
    from crossflow_ctl.sim.config import SimConfig
    from crossflow_ctl.sim.report import queue_words

    def words(**queue: object) -> str:
        return queue_words(SimConfig(queue=QueueConfig(max_held=1_000, **queue)))  # type: ignore[arg-type]

    assert words(max_hold_ms=600_000, fresh_first_ms=None) == "fifo, hold up to 600,000 ms"
    assert words(max_hold_ms=2_000) == "fifo, hold up to 2,000 ms"  # never behind: off
    assert words(max_hold_ms=60_000, order="shortest", fresh_order="newest") == (
        "shortest, hold up to 60,000 ms, fresh-first (newest) once behind 5,000 ms"
    )
    assert queue_words(SimConfig(late_binding=False)) == "off (no late binding)"


def test_the_sim_runs_agents_and_broker_on_one_horizon() -> None:
    """Deployed agents take the broker's horizon from its Welcome; a simulation must too, and the
    CLI's default is the product's."""
    import pytest
    from pydantic import ValidationError

    from crossflow_ctl.cli.sim_cmds import sim
    from crossflow_ctl.domain.lease_credits import LeaseSettings
    from crossflow_ctl.domain.policy import PolicySettings
    from crossflow_ctl.sim.config import SimConfig

    default = PolicySettings().borrow_horizon_ms
    assert SimConfig().lease.horizon_ms == SimConfig().broker_policy.borrow_horizon_ms == default
    with pytest.raises(ValidationError, match="horizon"):
        SimConfig(lease=LeaseSettings(horizon_ms=default + 1_000))
    option = next(p for p in sim.params if p.name == "horizon_ms")
    assert option.default == default


def test_sim_with_every_request_in_the_warmup_says_what_to_change(
    mooncake_sample: Path, tmp_path: Path
) -> None:
    """``--limit 300`` keeps the first 300 requests of a trace (its first minute), all inside the
    default 300 s warm-up: the sweep measured nothing, and the report used to die on
    ``min() arg is an empty sequence`` (exit 1)."""
    result = _ctl(
        "sim",
        "--trace", str(mooncake_sample),
        "--limit", "40",
        "--load", "1",
        "--splits", "2P4D",
        "--policies", "static",
        "--jobs", "1",
        "--out", str(tmp_path / "x"),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--warmup-s" in result.stderr and "nothing was measured" in result.stderr
    assert "min()" not in result.stderr
    assert not (tmp_path / "x").exists()


def test_sim_refuses_a_limit_or_jobs_below_one(tmp_path: Path) -> None:
    for flag in ("--limit", "--jobs"):
        for value in ("0", "-5"):
            result = _ctl("sim", "--synthetic", flag, value, "--out", str(tmp_path / "x"))
            assert result.returncode == 2, (flag, value, result.stderr)
            assert flag in result.stderr
    result = _ctl("sim", "--synthetic", "--warmup-s", "-3", "--out", str(tmp_path / "x"))
    assert result.returncode == 2 and "--warmup-s" in result.stderr


def test_plan_refuses_a_zero_window_and_a_one_node_fleet_naming_the_flag(
    mooncake_sample: Path,
) -> None:
    """--window-s 0 died on "float floor division by zero" (exit 1); --fleet 0 was named
    fleet_nodes, not the flag."""
    trace = str(mooncake_sample)
    zero = _ctl("plan", "--trace", trace, "--window-s", "0")
    assert zero.returncode == 2 and "--window-s" in zero.stderr, zero.stderr
    one = _ctl("plan", "--r-p5", "1", "--r-p50", "2", "--r-p95", "3", "--fleet", "1")
    assert one.returncode == 2 and "--fleet" in one.stderr, one.stderr
    helped = _ctl("plan", "--help").stdout
    assert "R at its median" in helped and "seconds of trace per R sample" in helped


def test_plan_refusals_name_the_flag_and_trace_excludes_the_percentiles(
    sessions_sample: Path,
) -> None:
    """Refusals named sizing's fields ("rho: rho must be ...", "r: R must be ...",
    "r_p50: need ..."); --r-p5/--r-p50/--r-p95 beside --trace were silently ignored."""
    r = ("--r-p5", "5", "--r-p50", "10", "--r-p95", "20")
    for args, flag in (
        (("--rho", "-1", *r), "--rho: "),
        (("--rho", "0.1", "--r-p5", "-5", "--r-p50", "10", "--r-p95", "20"), "--r-p5/--r-p50/"),
        (("--rho", "0.1", "--r-p5", "20", "--r-p50", "10", "--r-p95", "5"), "--r-p5/--r-p50/"),
    ):
        res = _ctl("plan", *args)
        assert res.returncode == 2 and f"error: {flag}" in res.stderr, (args, res.stderr)
    trace = str(sessions_sample)
    both = _ctl("plan", "--rho", "0.1", "--trace", trace, "--r-p50", "10")
    assert both.returncode == 2 and "drop --r-p50" in both.stderr, both.stderr


def test_sim_refuses_out_of_range_settings_naming_the_flag(tmp_path: Path) -> None:
    """These reached the models unchecked and printed pydantic's multi-line report (exit 1);
    a negative --session-rate was accepted."""
    for flag, value in (
        ("--borrow-share", "5"),
        ("--borrow-kv-share", "2"),
        ("--horizon-ms", "0"),
        ("--kv-capacity-tokens", "0"),
        ("--itl-slo-ms", "0"),
        ("--session-rate", "-1"),
    ):
        result = _ctl("sim", "--synthetic", flag, value, "--out", str(tmp_path / "x"))
        assert result.returncode == 2, (flag, result.stderr)
        assert flag in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


def test_sim_refusals_name_the_flag_and_flags_are_checked_before_traces(tmp_path: Path) -> None:
    """Refusals said the inner field ("load: give positive numbers", "split: split '9X' ...",
    "json: t.jsonl line 1: not valid JSON", "policies: ..."), and a bad --load was found only
    after every trace had been read (minutes for a large one) and refused as the trace's."""
    bad = tmp_path / "t.jsonl"
    bad.write_text("garbage\n")
    cases = [
        (("--synthetic", "--load", "0"), "error: --load: give positive numbers"),
        (("--synthetic", "--splits", "9X"), "error: --splits: split '9X'"),
        (("--synthetic", "--borrow-splits", "9X"), "error: --borrow-splits: split '9X'"),
        (("--synthetic", "--policies", "foo"), "error: --policies: policies are"),
        (("--trace", str(bad)), "error: --trace: t.jsonl line 1: not valid JSON"),
        (("--trace", str(bad), "--load", "0"), "error: --load: "),
    ]
    for args, said in cases:
        result = _ctl("sim", *args, "--jobs", "1", "--out", str(tmp_path / "x"))
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith(said), (args, result.stderr)
    assert not (tmp_path / "x").exists()


def test_sim_exits_1_when_a_sweep_check_fails_after_writing_the_report(
    mooncake_sample: Path, tmp_path: Path
) -> None:
    """Issue 33: a leases run past the ITL SLO fails the sweep loudly. With a 1 ms SLO no
    decode step can keep it, so the leases run breaks it; ``--no-check`` writes the same report
    and exits 0."""
    args = (
        "sim", "--trace", str(mooncake_sample), "--limit", "40", "--load", "4",
        "--splits", "2P4D", "--borrow-splits", "2P4D", "--policies", "static,leases",
        "--warmup-s", "0", "--jobs", "1", "--itl-slo-ms", "1",
    )  # fmt: skip
    failed = _ctl(*args, "--out", str(tmp_path / "a"))
    assert failed.returncode == 1, failed.stderr
    assert "sweep check(s) failed" in failed.stderr
    assert "2P4D/leases: ITL p99" in failed.stderr and "past the 1 ms SLO" in failed.stderr
    report = (tmp_path / "a" / "report.md").read_text()
    assert "FAILED" in report
    # --kv-capacity-tokens auto (the default): sized from the h200's HBM and GPT-OSS-120B
    assert "decode KV 1,646,621 tokens per server" in report
    passed = _ctl(*args, "--no-check", "--out", str(tmp_path / "b"))
    assert passed.returncode == 0, passed.stderr
    assert "FAILED" in (tmp_path / "b" / "report.md").read_text()
