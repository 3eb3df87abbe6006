"""The shared layering every process's settings use: defaults < YAML < env < overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel, Field, field_validator
from pydantic_settings import SettingsConfigDict

from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.settings_sources import LayeredSettings, host_port, load_layered


class _Inner(BaseModel):
    a_ms: Annotated[int, Field(ge=0)] = 1
    b_ms: int = 2


class _Settings(LayeredSettings):
    model_config = SettingsConfigDict(
        env_prefix="CROSSFLOW_TEST_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    name: str = "default"
    inner: _Inner = _Inner()


def test_layers_in_priority_order_and_nested_values_merge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("name: file\ninner:\n  a_ms: 10\n  b_ms: 20\n")
    assert load_layered(_Settings, cfg).name == "file"
    monkeypatch.setenv("CROSSFLOW_TEST_INNER__A_MS", "30")
    s = load_layered(_Settings, cfg, {"name": "flag"})
    assert (s.name, s.inner.a_ms, s.inner.b_ms) == ("flag", 30, 20)
    # The file applies only inside load_layered; settings built directly never see it.
    assert _Settings().name == "default" and _Settings().inner.a_ms == 30


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("inner:\n  a_ms: -1\n", "inner.a_ms"),
        ("colour: red\n", "colour"),
        ("- a list\n", "config"),
        ("name: [unclosed\n", "config"),
    ],
)
def test_refusals_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_layered(_Settings, cfg)
    assert err.value.field == field


def test_a_file_that_is_not_yaml_is_said_in_one_line_with_its_line(tmp_path: Path) -> None:
    """PyYAML's report spans five lines, quotes the offending one and names the file
    "<unicode string>"; every process printed it as it was."""
    cfg = tmp_path / "s.yaml"
    cfg.write_text("name: ok\ninner: [\n")
    with pytest.raises(ConfigError) as err:
        load_layered(_Settings, cfg)
    text = str(err.value)
    assert "\n" not in text and "<unicode string>" not in text, text
    assert text == (
        f"config: cannot read config file {cfg}: line 3, column 1: while parsing a flow node:"
        " expected the node content, but found '<stream end>'"
    )


def test_missing_file_is_refused_and_an_empty_one_is_defaults(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_layered(_Settings, tmp_path / "missing.yaml")
    assert err.value.field == "config" and "missing.yaml" in str(err.value)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_layered(_Settings, empty) == _Settings()


@pytest.mark.parametrize(
    ("value", "port_zero", "ok"),
    [
        ("127.0.0.1:50051", False, True),
        ("broker.svc:1", False, True),
        ("[::1]:7000", False, True),
        ("127.0.0.1:0", False, False),
        ("127.0.0.1:0", True, True),
        ("127.0.0.1:65536", True, False),
        ("nohost", True, False),
        (":50051", True, False),
        ("host:port", True, False),
    ],
)
def test_host_port(value: str, port_zero: bool, ok: bool) -> None:
    if ok:
        assert host_port(value, port_zero=port_zero) == value
    else:
        with pytest.raises(ValueError, match="host:port"):
            host_port(value, port_zero=port_zero)


def test_refusals_say_the_validator_s_words_and_a_missing_value_plainly() -> None:
    class _Needs(LayeredSettings):
        model_config = SettingsConfigDict(env_prefix="CROSSFLOW_TEST_", extra="forbid")
        listen: str

        @field_validator("listen")
        @classmethod
        def _port(cls, v: str) -> str:
            return host_port(v)

    with pytest.raises(ConfigError) as err:
        load_layered(_Needs)
    assert (err.value.field, err.value.message) == (
        "listen",
        "invalid setting: required, and not set by a flag, the environment or the --config file",
    )
    with pytest.raises(ConfigError) as err:
        load_layered(_Needs, None, {"listen": "nonsense"})
    assert "Value error" not in err.value.message
    assert err.value.message.startswith("invalid setting: must be host:port"), err.value.message
