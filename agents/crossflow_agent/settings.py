"""Agent settings: ONE pydantic-settings model for the agent process (CONVENTIONS.md, Config).

Sources, lowest to highest priority: defaults, a YAML file (``--config FILE``), environment
variables ``CROSSFLOW_AGENT_*`` (nested with ``__``, e.g. ``CROSSFLOW_AGENT_LEASE__ITL_SLO_MS=40``),
then CLI flags (the layering is crossflow_ctl.settings_sources, shared with the broker).
:func:`load_settings` validates once, at start, and raises
:class:`~crossflow_ctl.domain.errors.ConfigError` naming the field at fault.
``AgentSettings.model_json_schema()`` (``crossflow-agent schema``) feeds the Helm chart.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from crossflow_agent.sources.synthetic import EngineScript
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.deadband import DEFAULT_BITS
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.models import ID_PATTERN, MAX_ID_LEN, NodeRole
from crossflow_ctl.domain.online_calibration import CalibrationSettings
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.settings_sources import LayeredSettings, host_port, load_layered


class SourceKind(StrEnum):
    SGLANG = "sglang"
    VLLM = "vllm"
    SYNTHETIC = "synthetic"
    """An in-process synthetic engine (no HTTP); see ``synthetic``."""


class AgentSettings(LayeredSettings):
    """Everything one node agent needs."""

    model_config = SettingsConfigDict(
        env_prefix="CROSSFLOW_AGENT_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    node_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN, pattern=ID_PATTERN)]
    """This server's node id (unique in the fleet)."""
    role: NodeRole = NodeRole.DECODE
    """decode: publish leases; prefill: report the pool's load."""
    pool: Annotated[str, Field(min_length=1, max_length=64, pattern=ID_PATTERN)] = "default"
    labels: dict[str, str] = Field(default_factory=dict)

    source: SourceKind = SourceKind.SGLANG
    metrics_url: str = "http://127.0.0.1:30000/metrics"
    """The engine's Prometheus endpoint (sglang and vllm sources)."""
    scrape_timeout_ms: Annotated[int, Field(ge=10, le=60_000)] = 500
    synthetic: EngineScript = EngineScript()
    """The in-process engine's script (synthetic source only)."""

    model: str = "gpt-oss-120b"
    """Served model, a preset name: see crossflow_ctl.domain.capacity.MODEL_PRESETS."""
    node_preset: str = "h200"
    """Node profile preset, used when no profile file is given."""
    profile_file: Path | None = None
    """A calibrated NodeProfile file (``{"version": 1, "profile": {...}}``)."""
    calibration: CalibrationSettings = CalibrationSettings()
    """Online calibration: the step-time constants are fitted to the engine's own telemetry,
    starting from the preset or profile file (the prior); see
    crossflow_ctl.domain.online_calibration."""

    brokers: Annotated[list[str], Field(min_length=1, max_length=64)] = ["127.0.0.1:50051"]
    """Broker endpoints (host:port), tried in turn with jittered backoff."""
    broker_auth: ClientCredentials = ClientCredentials()
    """TLS to the brokers (CA bundle), this node's certificate and key (mutual TLS: its SPIFFE
    URI must name this node), or a bearer token file."""
    period_ms: Annotated[int, Field(ge=20, le=10_000)] = 200
    """Lease period: one scrape and one lease (or pool load) per period."""
    ttl_periods: Annotated[int, Field(ge=2, le=50)] = 6
    """Lease time-to-live in periods. A steady lease is renewed at half of it (the deadband
    holds back the rest), so 6 sends a steady node's lease every 3 periods; a lease that falls,
    turns zero or stamps a new notice goes at once whatever it says."""
    deadband_bits: Annotated[int, Field(ge=0, le=30)] = DEFAULT_BITS
    """Credits are rounded down to this many significant bits (under 1/16 less at 5) and a
    lease goes only on a change beyond that deadband (``crossflow_ctl.domain.deadband``); 0
    sends every period's lease with its credits as computed."""
    lease: LeaseSettings = LeaseSettings()
    connect_timeout_ms: Annotated[int, Field(ge=50, le=60_000)] = 1_000
    backoff_initial_ms: Annotated[int, Field(ge=10, le=60_000)] = 100
    backoff_max_ms: Annotated[int, Field(ge=10, le=300_000)] = 2_000
    shutdown_grace_ms: Annotated[int, Field(ge=0, le=60_000)] = 1_000
    """Time the final SHUTTING_DOWN lease gets to reach the broker."""
    max_message_bytes: Annotated[int, Field(ge=64 * 1024, le=64 * 1024 * 1024)] = 4 * 1024 * 1024

    metrics_listen: str | None = None
    """host:port of the agent's own Prometheus endpoint (and /healthz); None serves none."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC endpoint for traces; None exports none."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_json: bool = True

    @field_validator("brokers")
    @classmethod
    def _brokers_host_port(cls, value: list[str]) -> list[str]:
        return [host_port(v) for v in value]

    @field_validator("metrics_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http(s) URL, got {value!r}")
        return value

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value not in MODEL_PRESETS:
            raise ValueError(
                f"unknown model {value!r}; presets: {', '.join(sorted(MODEL_PRESETS))}"
            )
        return value

    @field_validator("node_preset")
    @classmethod
    def _known_node(cls, value: str) -> str:
        if value not in NODE_PRESETS:
            raise ValueError(f"unknown node {value!r}; presets: {', '.join(sorted(NODE_PRESETS))}")
        return value

    @model_validator(mode="after")
    def _backoff_order(self) -> AgentSettings:
        if self.backoff_initial_ms > self.backoff_max_ms:
            raise ValueError("backoff_initial_ms must not exceed backoff_max_ms")
        return self

    @property
    def ttl_ms(self) -> int:
        return self.period_ms * self.ttl_periods


def load_settings(
    config_file: Path | None = None, overrides: dict[str, Any] | None = None
) -> AgentSettings:
    """Defaults < YAML file < environment (CROSSFLOW_AGENT_*) < ``overrides`` (CLI flags).

    Validated here, once: a bad value raises ConfigError naming the field.
    """
    return load_layered(AgentSettings, config_file, overrides)


def json_schema() -> dict[str, Any]:
    """The settings' JSON schema (for the Helm chart's values.schema.json)."""
    return AgentSettings.model_json_schema()
