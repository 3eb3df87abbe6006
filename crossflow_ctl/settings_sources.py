"""Layered settings, one implementation for every process (CONVENTIONS.md, Config).

Each process keeps its own pydantic-settings model (``BrokerSettings``, ``AgentSettings``) and
subclasses :class:`LayeredSettings`, whose sources are, lowest to highest priority: defaults, a
YAML file, the environment (the model's ``env_prefix``, nested with ``__``), then ``overrides``
(the CLI flags). Nested mappings merge across sources. :func:`load_layered` validates once, at
start, and raises :class:`~crossflow_ctl.domain.errors.ConfigError` naming the field at fault
(``policy.borrow_share``), or ``config`` when the file cannot be read or holds no mapping.
:func:`host_port` is the one check of the ``host:port`` addresses these models hold.

Usage::

    class BrokerSettings(LayeredSettings):
        model_config = SettingsConfigDict(env_prefix="CROSSFLOW_", env_nested_delimiter="__")
        ...

    settings = load_layered(BrokerSettings, Path("broker.yaml"), {"listen": "127.0.0.1:0"})
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from crossflow_ctl.domain.errors import ConfigError

S = TypeVar("S", bound=BaseSettings)

_config_file: ContextVar[Path | None] = ContextVar("crossflow_config_file", default=None)


def read_error_text(exc: Exception) -> str:
    """Why a file could not be read or parsed, on one line: a YAML error as the file's own
    line and column and the problem (PyYAML's text spans lines, quotes the offending line
    and calls the file "<unicode string>")."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        what = ": ".join(p for p in (exc.context, exc.problem) if p)
        return f"line {mark.line + 1}, column {mark.column + 1}: {what}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


def _read_yaml_mapping(path: Path) -> dict[str, Any]:
    """The mapping a YAML settings file holds (an empty file holds none); ConfigError else."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"cannot read config file {path}: {read_error_text(exc)}", field="config"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping", field="config")
    return data


def host_port(value: str, *, port_zero: bool = False) -> str:
    """``value`` when it is ``host:port`` (port 0, "pick a free one", only where ``port_zero``).

    For field validators: raises ValueError, which pydantic reports under the field's name.
    """
    host, sep, port = value.rpartition(":")
    lowest = 0 if port_zero else 1
    if not sep or not host or not port.isdigit() or not lowest <= int(port) <= 65535:
        raise ValueError(f"must be host:port, got {value!r}")
    return value


class YamlFileSource(PydanticBaseSettingsSource):
    """The YAML file :func:`load_layered` was given; nothing when settings are built directly."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # pragma: no cover - __call__ does the work

    def __call__(self) -> dict[str, Any]:
        path = _config_file.get()
        return {} if path is None else _read_yaml_mapping(path)


class LayeredSettings(BaseSettings):
    """A process's settings model: defaults < YAML file < environment < init kwargs (flags)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first: init kwargs (CLI flags), environment, then the YAML file.
        return (init_settings, env_settings, YamlFileSource(settings_cls))


def load_layered(
    cls: type[S], config_file: Path | None = None, overrides: dict[str, Any] | None = None
) -> S:
    """Build ``cls`` from defaults < ``config_file`` < environment < ``overrides``, validated.

    A refused value raises ConfigError naming the field (dotted for nested ones).
    """
    token = _config_file.set(config_file)
    try:
        return cls(**(overrides or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        raise ConfigError(f"invalid setting: {refusal_text(err)}", field=field) from None
    finally:
        _config_file.reset(token)


def refusal_text(err: ErrorDetails) -> str:
    """pydantic's message without its "Value error, " prefix (our validators' own words), and
    a missing value said as such (pydantic says "Field required")."""
    if err["type"] == "missing":
        return "required, and not set by a flag, the environment or the --config file"
    cause = err.get("ctx", {}).get("error")
    if err["type"] == "value_error" and isinstance(cause, Exception):
        return str(cause)
    return err["msg"]
