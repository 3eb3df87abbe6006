"""The gateway's one settings model: defaults < YAML file < env ``CROSSFLOW_GATEWAY_*`` < flags.

A YAML file is the usual way to give the engines::

    listen: 0.0.0.0:8000
    broker: crossflow-broker:50051      # omit (null) for a plain static P/D router
    protocol: vllm                      # or sglang
    prefill:
      - {node_id: prefill-1, url: http://10.0.0.1:8100}
    decode:
      - {node_id: decode-1, url: http://10.0.1.1:8200}   # node_id = the node's agent's id

A decode engine's ``node_id`` must be the id its agent leases under: a BORROW names the node,
and the gateway sends the prompt to the engine with that id. An SGLang prefill engine also
names its ``bootstrap_port`` (SGLang's ``--disaggregation-bootstrap-port``, default 8998).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from crossflow_ctl.domain.models import PoolName, is_node_id
from crossflow_ctl.gateway.discovery import KubernetesEngines
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.settings_sources import LayeredSettings, host_port, load_layered

Protocol = Literal["vllm", "sglang"]


class EngineEndpoint(BaseModel):
    """One engine the gateway sends requests to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_id: str
    """The node's id: for a decode engine, the id its agent leases under."""
    url: str
    """Base URL of the engine's OpenAI server, e.g. ``http://10.0.1.1:8000``."""
    bootstrap_port: Annotated[int | None, Field(ge=1, le=65535)] = None
    """SGLang prefill engines: the KV bootstrap port the decode engine connects to."""

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, value: str) -> str:
        if not is_node_id(value):
            raise ValueError(f"not a valid node id: {value!r}")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"must be http(s)://host:port, got {value!r}")
        return value.rstrip("/")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""


class GatewaySettings(LayeredSettings):
    model_config = SettingsConfigDict(
        env_prefix="CROSSFLOW_GATEWAY_", env_nested_delimiter="__", extra="forbid"
    )

    listen: str = "127.0.0.1:8000"
    """Where the OpenAI-compatible HTTP server listens (port 0 picks a free one)."""
    broker: str | None = "127.0.0.1:50051"
    """The lease broker (host:port). None: no admission at all, plain static P/D."""
    broker_auth: ClientCredentials = ClientCredentials()
    """How the gateway proves itself to the broker (TLS, mutual TLS, a bearer token), as the
    agents do; its identity needs the router role (Admit, Commit, Release, WatchRoom)."""
    pool: PoolName = "default"
    protocol: Protocol = "vllm"
    """The engines' own P/D protocol for the normal path: vLLM's ``kv_transfer_params``
    two-hop, or SGLang's bootstrap host/port/room."""
    borrow: bool | None = None
    """Whether prompts may be borrowed (sent to a decode engine that prefills them itself).
    None: the protocol's default. vLLM: yes (its decode engines run a ``kv_both`` connector,
    which prefills a request that brings no ``kv_transfer_params``). SGLang: no, since a stock
    ``--disaggregation-mode decode`` server refuses a request without a bootstrap room
    (sgl-project/sglang#14284); set true only for decode servers built to prefill locally.
    With borrowing off the gateway asks no broker: it is a static P/D router."""
    model: str | None = None
    """The served model's name; None: the first model a prefill engine's /v1/models lists."""
    prefill: list[EngineEndpoint] = []
    decode: list[EngineEndpoint] = []
    """The engines, listed here, or found in a cluster by ``kubernetes`` (then these lists are
    ignored)."""
    kubernetes: KubernetesEngines | None = None

    admit_timeout_ms: Annotated[int, Field(ge=1, le=10_000)] = 50
    """Deadline of one Admit (retry included); past it the request takes the normal path."""
    max_hold_ms: Annotated[int, Field(ge=0, le=60_000)] = 300
    """Late binding: longest a prompt is held for room while the prefill pool is behind (0:
    never held)."""
    prefill_room_tokens: Annotated[int, Field(ge=1, le=100_000_000)] = 8192
    """A held prompt goes to prefill once the least-loaded prefill engine has fewer uncached
    prompt tokens in flight from this gateway than this."""
    default_max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    """Expected output tokens told to Admit when a request sets no max_tokens."""
    prefix_block_tokens: Annotated[int, Field(ge=1, le=4096)] = 16
    """Block size of the cached-prefix estimate (the engines' KV block size)."""
    prefix_blocks_per_node: Annotated[int, Field(ge=1, le=10_000_000)] = 65_536
    """Block hashes remembered per engine (LRU): bounds the gateway's memory."""
    health_period_s: Annotated[float, Field(gt=0, le=3600)] = 2.0
    """How often every engine's /health is checked; a failing engine is out until it passes."""
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    request_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 600.0
    """Longest one engine request may take, end to end."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC endpoint for the request spans (e.g. http://otel-collector:4317); None: none."""
    log_json: bool = False
    log_level: str = "info"

    @property
    def borrows(self) -> bool:
        if self.borrow is not None:
            return self.borrow
        return self.protocol == "vllm"

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        return host_port(value, port_zero=True)

    @field_validator("broker")
    @classmethod
    def _broker(cls, value: str | None) -> str | None:
        return None if value is None else host_port(value)

    @model_validator(mode="after")
    def _engines(self) -> GatewaySettings:
        if self.kubernetes is not None:
            if self.model is None:
                raise ValueError("kubernetes discovery needs model set (engines come and go)")
            return self
        for role, engines in (("prefill", self.prefill), ("decode", self.decode)):
            if not engines:
                raise ValueError(f"{role}: at least 1 engine, or kubernetes discovery")
        return self

    @model_validator(mode="after")
    def _distinct_ids(self) -> GatewaySettings:
        ids = [e.node_id for e in (*self.prefill, *self.decode)]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"engine node ids must be distinct: {dup[0]!r} appears twice")
        if self.protocol == "sglang":
            missing = [e.node_id for e in self.prefill if e.bootstrap_port is None]
            if missing:
                raise ValueError(
                    f"protocol sglang: prefill engine {missing[0]} needs bootstrap_port"
                )
        return self


def load_settings(config_file: Path | None, overrides: dict[str, Any]) -> GatewaySettings:
    return load_layered(GatewaySettings, config_file, overrides)
