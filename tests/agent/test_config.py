"""Agent settings (defaults < YAML < env < flags), profile files, and the CLI's offline commands."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossflow_agent.cli import cli
from crossflow_agent.profile import load_profile, profile_document, save_profile
from crossflow_agent.settings import AgentSettings, SourceKind, json_schema, load_settings
from crossflow_ctl.domain.capacity import NODE_PRESETS, NodeProfile
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.domain.models import NodeRole


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("CROSSFLOW_AGENT_"):
            monkeypatch.delenv(key)


def test_sources_in_priority_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml_file = tmp_path / "agent.yaml"
    yaml_file.write_text(
        "node_id: from-yaml\nrole: prefill\nperiod_ms: 150\n"
        "lease:\n  itl_slo_ms: 30\n  horizon_ms: 3000\nbrokers: ['a:1', 'b:2']\n"
    )
    s = load_settings(yaml_file)
    assert (s.node_id, s.role, s.period_ms, s.brokers) == (
        "from-yaml",
        NodeRole.PREFILL,
        150,
        ["a:1", "b:2"],
    )
    assert s.lease.itl_slo_ms == 30 and s.lease.horizon_ms == 3000 and s.ttl_ms == 900
    monkeypatch.setenv("CROSSFLOW_AGENT_PERIOD_MS", "120")
    monkeypatch.setenv("CROSSFLOW_AGENT_LEASE__ITL_SLO_MS", "40")
    s = load_settings(yaml_file)
    assert s.period_ms == 120 and s.lease.itl_slo_ms == 40
    assert s.lease.horizon_ms == 3000  # nested values merge across sources
    s = load_settings(yaml_file, {"period_ms": 100, "lease": {"itl_slo_ms": 25.0}})
    assert s.period_ms == 100 and s.lease.itl_slo_ms == 25 and s.lease.horizon_ms == 3000


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({}, "node_id"),
        ({"node_id": "bad id!"}, "node_id"),
        ({"node_id": "n", "brokers": ["nohost"]}, "brokers"),
        ({"node_id": "n", "brokers": []}, "brokers"),
        ({"node_id": "n", "model": "gpt-9"}, "model"),
        ({"node_id": "n", "period_ms": 1}, "period_ms"),
        ({"node_id": "n", "metrics_url": "ftp://x"}, "metrics_url"),
        ({"node_id": "n", "lease": {"itl_slo_ms": -1}}, "lease.itl_slo_ms"),
        ({"node_id": "n", "colour": "red"}, "colour"),
    ],
)
def test_bad_settings_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, overrides)
    assert info.value.field == field


def test_unreadable_yaml_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("node_id: [unclosed\n")
    with pytest.raises(ConfigError):
        load_settings(bad)
    with pytest.raises(ConfigError) as info:
        load_settings(tmp_path / "missing.yaml")
    assert info.value.field == "config"


def test_json_schema_describes_every_setting() -> None:
    schema = json_schema()
    assert "node_id" in schema["required"]
    for name in ("brokers", "period_ms", "lease", "source", "profile_file"):
        assert name in schema["properties"]
    assert schema == AgentSettings.model_json_schema()


def test_profile_round_trip_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    calibrated = NODE_PRESETS["h200"].model_copy(
        update={"name": "h200-fit", "overlap_penalty": 0.4}
    )
    save_profile(path, calibrated, device="H200", residual=0.02)
    assert load_profile(path) == calibrated
    assert json.loads(path.read_text())["device"] == "H200"

    doc = profile_document(calibrated)
    doc["version"] = 2
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="version 2"):
        load_profile(path)
    doc = profile_document(calibrated)
    doc["profile"]["flops_per_s"] = -1
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"profile\.flops_per_s"):
        load_profile(path)
    with pytest.raises(ConfigError):
        load_profile(tmp_path / "none.json")


def test_cli_inspect_shows_snapshot_predictions_and_lease(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        cli, ["inspect", "--source", "synthetic", "--window-ms", "0", "--slo-ms", "60", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["settings"]["source"] == SourceKind.SYNTHETIC.value
    assert report["snapshot"]["kv_total_tokens"] == 400_000
    assert [p["prefill_tokens"] for p in report["predictions"]] == [0, 512, 2048, 8192]
    assert report["lease"]["itl_slo_ms"] == 60.0
    assert report["lease"]["credits"]["compute_tokens"] > 0
    assert any(line.startswith("budget = slo 60") for line in report["arithmetic"])

    text = runner.invoke(cli, ["inspect", "--source", "synthetic", "--window-ms", "0"])
    assert text.exit_code == 0 and "arithmetic:" in text.output and "compute_tokens" in text.output

    profile = tmp_path / "p.json"
    save_profile(profile, NodeProfile(name="mine", flops_per_s=1e15, hbm_bytes_per_s=4e12))
    with_profile = runner.invoke(
        cli,
        [
            "inspect",
            "--source",
            "synthetic",
            "--window-ms",
            "0",
            "--profile",
            str(profile),
            "--json",
        ],
    )
    assert with_profile.exit_code == 0 and json.loads(with_profile.output)["node"]["name"] == "mine"


def test_cli_refuses_bad_flags_naming_the_field() -> None:
    result = CliRunner().invoke(cli, ["run", "--node-id", "n1", "--broker", "nohost"])
    assert result.exit_code == 2 and "brokers" in result.output
    schema = CliRunner().invoke(cli, ["schema"])
    assert schema.exit_code == 0 and "node_id" in json.loads(schema.output)["properties"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--node-id", "n1", "--slo-ms", "-5"], "lease.itl_slo_ms (--slo-ms or "),
        (["--node-id", "n1", "--broker", "nohost"], "brokers (--broker or CROSSFLOW_AGENT_"),
        (["--node-id", "n1", "--metrics-url", "x"], "must be an http(s) URL, got 'x'"),
        (["--role", "decode"], "node_id (--node-id or CROSSFLOW_AGENT_NODE_ID): invalid setting"),
    ],
)  # fmt: skip
def test_cli_refusals_name_the_flag_and_drop_pydantic_noise(args: list[str], said: str) -> None:
    """They said "lease.itl_slo_ms: ... " for --slo-ms, "Value error, must be ..." and "Field
    required" for a missing --node-id."""
    result = CliRunner().invoke(cli, ["run", *args])
    assert result.exit_code == 2, result.output
    assert said in result.output, result.output
    assert "Value error" not in result.output and "Field required" not in result.output


def test_cli_inspect_of_an_engine_it_cannot_scrape_exits_1() -> None:
    """It printed the zero lease and exited 0, so a script checking a node's setup passed."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
    result = CliRunner().invoke(cli, ["inspect", "--metrics-url", url, "--window-ms", "0"])
    assert result.exit_code == 1, result.output
    assert "scrape failed: unreachable" in result.output and "lease: ZERO" in result.output


def test_run_help_says_each_settings_default() -> None:
    """No flag of run said its default (is --broker needed? which --role, --source?)."""
    out = " ".join(CliRunner().invoke(cli, ["run", "--help"]).output.split())
    defaults = AgentSettings.model_construct()
    for said in (
        f"[{defaults.role.value}]",
        f"[{defaults.source.value}]",
        f"[{defaults.metrics_url}]",
        f"[{','.join(defaults.brokers)}]",
        f"[{defaults.period_ms}]",
        f"[{defaults.log_level}]",  # --log-level and --log-json had no help at all
        "JSON log lines, or console text. [json]",
        "/healthz. [none served]",
    ):
        assert said in out, said
