"""BrokerSettings: defaults < YAML < CROSSFLOW_* env < CLI flags; refused values name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossflow_ctl.broker.__main__ import cli, overrides_from, serve
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.service.config import BrokerSettings, load_settings


def _flags(*argv: str) -> tuple[Path | None, dict[str, object]]:
    """What ``crossflow-broker serve ARGV`` parses: the config file and the flag overrides."""
    params = serve.make_context("serve", list(argv)).params
    params.pop("worker_index")  # set by the supervisor for its workers: no setting
    return params.pop("config_file"), overrides_from(**params)


def test_sources_layer_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "b.yaml"
    cfg.write_text(
        "listen: 127.0.0.1:7000\nredis_url: redis://file:6379/0\n"
        "policy:\n  borrow_share: 0.3\n  demand_threshold_ms: 10\n"
    )
    monkeypatch.setenv("CROSSFLOW_POLICY__BORROW_SHARE", "0.4")
    monkeypatch.setenv("CROSSFLOW_REDIS_URL", "redis://env:6379/0")
    s = load_settings(*_flags("--config", str(cfg), "--listen", "127.0.0.1:0"))
    assert s.listen == "127.0.0.1:0"  # flag beats file
    assert s.redis_url == "redis://env:6379/0"  # env beats file
    assert s.policy.borrow_share == 0.4  # nested env beats nested file
    assert s.policy.demand_threshold_ms == 10  # file beats default, merged not replaced
    embedded = load_settings(*_flags("--embedded-store"))
    assert embedded.redis_url is None


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"CROSSFLOW_POLICY__BORROW_SHARE": "2"}, "policy.borrow_share"),
        ({"CROSSFLOW_LISTEN": "nowhere"}, "listen"),
        ({"CROSSFLOW_REDIS_URL": "http://x"}, "redis_url"),
        (
            {"CROSSFLOW_POLICY__COMMIT_TTL_MS": "5", "CROSSFLOW_POLICY__BORROW_HORIZON_MS": "10"},
            "policy",
        ),
        ({"CROSSFLOW_MAX_MESSAGE_BYTES": "-1"}, "max_message_bytes"),
    ],
)
def test_refused_settings_name_the_field(env, field, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert err.value.field is not None and err.value.field.startswith(field), err.value


def test_unreadable_or_unknown_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(tmp_path / "missing.yaml")
    assert err.value.field == "config"
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_setting: 1\n")
    with pytest.raises(ConfigError) as err:
        load_settings(bad)
    assert err.value.field == "no_such_setting"


def test_json_schema_for_helm() -> None:
    schema = BrokerSettings.model_json_schema()
    assert {"listen", "redis_url", "policy", "max_message_bytes"} <= set(schema["properties"])
    policy = schema["$defs"]["PolicySettings"]["properties"]
    assert policy["borrow_share"]["maximum"] == 1.0


def test_cli_refuses_conflicting_flags_and_bad_settings_with_exit_2() -> None:
    runner = CliRunner()
    both = runner.invoke(cli, ["serve", "--redis-url", "redis://x:1/0", "--embedded-store"])
    assert both.exit_code == 2 and "mutually exclusive" in both.output
    bad = runner.invoke(cli, ["serve", "--listen", "nowhere"])
    assert bad.exit_code == 2 and "listen" in bad.output and "invalid configuration" in bad.output
    schema = runner.invoke(cli, ["schema"])
    assert schema.exit_code == 0 and "redis_url" in json.loads(schema.output)["properties"]


def test_redis_cluster_without_a_redis_url_is_refused() -> None:
    """--redis-cluster with the embedded store (or no redis_url) was dropped without a word:
    the replica ran alone on its in-process store, sharing nothing with the others."""
    for args in (["--redis-cluster", "--embedded-store"], ["--redis-cluster"]):
        run = CliRunner().invoke(cli, ["serve", "--listen", "127.0.0.1:0", *args])
        assert run.exit_code == 2, run.output
        assert "redis_cluster needs a redis_url" in run.output, run.output
    assert BrokerSettings(redis_url="redis://r:6379/0", redis_cluster=True).redis_cluster


def test_embedded_store_sets_aside_a_settings_files_redis_cluster(tmp_path: Path) -> None:
    """A production settings file (a Redis Cluster) run with --embedded-store for a local try
    runs on the embedded store, as the flag says; it was refused as a cluster without a URL."""
    config = tmp_path / "broker.yaml"
    config.write_text("redis_url: redis://r:6379/0\nredis_cluster: true\n")
    settings = load_settings(*_flags("--config", str(config), "--embedded-store"))
    assert settings.redis_url is None and not settings.redis_cluster
