"""GatewaySettings: bad values are refused naming the field; the CLI's flags override."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.gateway.__main__ import cli
from crossflow_ctl.gateway.settings import load_settings

ENGINES = {
    "prefill": [{"node_id": "prefill-1", "url": "http://127.0.0.1:8100"}],
    "decode": [{"node_id": "decode-1", "url": "http://127.0.0.1:8200"}],
}


def test_a_file_with_engines_loads(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        "protocol: vllm\nprefill:\n  - {node_id: p1, url: 'http://127.0.0.1:1/'}\n"
        "decode:\n  - {node_id: d1, url: 'http://127.0.0.1:2'}\n"
    )
    settings = load_settings(path, {})
    assert settings.prefill[0].url == "http://127.0.0.1:1"
    assert settings.decode[0].node_id == "d1"
    assert settings.broker == "127.0.0.1:50051"


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"prefill": []}, "settings", "prefill: at least 1 engine, or kubernetes"),
        (
            {"kubernetes": {"namespace": "n", "prefill_selector": "a", "decode_selector": "b"}},
            "settings",
            "needs model",
        ),
        ({"decode": [{"node_id": "d1", "url": "ftp://x:1"}]}, "decode.0.url", "http(s)://"),
        ({"decode": [{"node_id": "d1", "url": "http://x"}]}, "decode.0.url", "host:port"),
        ({"decode": [{"node_id": "bad id", "url": "http://x:1"}]}, "decode.0.node_id", "node id"),
        ({"listen": "nope"}, "listen", "host:port"),
        ({"admit_timeout_ms": 0}, "admit_timeout_ms", "greater"),
        ({"protocol": "tgi"}, "protocol", "vllm"),
        (
            {"decode": [{"node_id": "prefill-1", "url": "http://x:1"}]},
            "settings",
            "distinct",
        ),
        ({"protocol": "sglang"}, "settings", "bootstrap_port"),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    overrides: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(None, {**ENGINES, **overrides})
    assert err.value.field == field
    assert words in str(err.value)


def test_the_cli_refuses_a_bad_engine_flag_with_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["serve", "--prefill", "no-url-here", "--decode", "d=x"])
    assert result.exit_code == 2
    assert "ID=URL" in result.output


def test_the_cli_names_the_field_of_a_bad_setting() -> None:
    result = CliRunner().invoke(
        cli, ["serve", "--prefill", "p1=http://127.0.0.1:1", "--decode", "d1=nope"]
    )
    assert result.exit_code == 2
    assert "decode.0.url" in result.output
