"""Broker settings: ONE pydantic-settings model per process (CONVENTIONS.md, Config).

Sources, lowest to highest priority: defaults, a YAML file (``--config FILE``), environment
variables ``CROSSFLOW_*`` (nested with ``__``, e.g. ``CROSSFLOW_POLICY__BORROW_SHARE=0.3``),
then CLI flags (the layering is crossflow_ctl.settings_sources, shared with the agent).
:func:`load_settings` validates once, at start, and raises
:class:`~crossflow_ctl.domain.errors.ConfigError` naming the field at fault.
``BrokerSettings.model_json_schema()`` feeds the Helm chart's ``values.schema.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.security import AuthSettings
from crossflow_ctl.settings_sources import LayeredSettings, host_port, load_layered

MiB = 1024 * 1024


class RoomWatchSettings(BaseModel):
    """How this replica serves ``WatchRoom`` streams (late binding)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    poll_ms: Annotated[int, Field(ge=10, le=10_000)] = 100
    """The replica re-reads the store's admission view for each watched (pool, candidates) at
    least this often, so room changed through another replica (or by expiry) is seen within it;
    this replica's own lease ingest, releases and cordons trigger a read at once."""
    min_read_ms: Annotated[int, Field(ge=1, le=10_000)] = 20
    """Least time between two reads for one (pool, candidates), however often it is woken."""
    max_updates_per_s: Annotated[float, Field(gt=0.0, le=1_000.0, allow_inf_nan=False)] = 10.0
    """Default and ceiling of a watch's update rate; bursts in between are coalesced."""
    heartbeat_ms: Annotated[int, Field(ge=100, le=60_000)] = 1_000
    """Default heartbeat interval of a watch (a watcher may ask for another)."""
    max_nodes: Annotated[int, Field(ge=1, le=1_024)] = 64
    """Lenders sampled per read when the watcher names no candidates."""
    min_change: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.1
    """A node's spare compute or KV must move by more than this fraction to be news."""


class StoreBreakerSettings(BaseModel):
    """Admission's circuit breaker over the store (:mod:`crossflow_ctl.domain.breaker`): after
    consecutive store failures or timeouts, Admit answers NORMAL (reason store_unavailable) at
    once, without calling the store, while one probe checks it, until a store call answers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    """Off: every Admit waits for the store up to the policy's ``admit_timeout_ms``."""
    failures_to_open: Annotated[int, Field(ge=1, le=1_000)] = 3
    """Consecutive admission store calls that fail or time out before the breaker opens (each
    waits at most ``admit_timeout_ms``; admission decides one batch at a time)."""
    probe_interval_ms: Annotated[int, Field(ge=10, le=60_000)] = 100
    """While open, the store is pinged this long after it opened or after the last failed
    ping; the first ping (or store call) that answers closes the breaker."""
    probe_timeout_ms: Annotated[int, Field(ge=1, le=10_000)] = 100
    """Longest wait for one probe's answer."""


class BrokerSettings(LayeredSettings):
    """Everything one broker replica needs; the policy here is only the initial one."""

    model_config = SettingsConfigDict(
        env_prefix="CROSSFLOW_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    listen: str = "127.0.0.1:50051"
    """gRPC listen address, host:port (port 0 picks a free one). Loopback by default: beyond
    it the broker must authenticate callers (``auth``), or be told ``auth.insecure``."""
    redis_url: str | None = None
    """Redis URL of the shared store; None runs the embedded in-process store (one replica)."""
    redis_username: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Redis ACL user (or put it in the URL)."""
    redis_password_file: Path | None = None
    """File holding the Redis password (a mounted Secret); wins over a password in the URL."""
    redis_ca_file: Path | None = None
    """PEM CA bundle the Redis server's certificate must chain to (``rediss://`` URLs)."""
    redis_namespace: Annotated[str, Field(min_length=1, max_length=64)] = "crossflow"
    """Key prefix of every Redis key this control plane writes."""
    broker_id: Annotated[str, Field(max_length=128)] = ""
    """Name of this replica in Welcome messages and logs; empty picks host:pid."""
    auth: AuthSettings = AuthSettings()
    """TLS, caller identities (mTLS, bearer tokens) and what each may call."""
    policy: PolicySettings = PolicySettings()
    """Initial policy, written to the store only when the store holds none."""
    policy_refresh_ms: Annotated[int, Field(ge=50, le=60_000)] = 1_000
    """How often a replica re-reads the shared policy from the store."""
    max_message_bytes: Annotated[int, Field(ge=64 * 1024, le=64 * MiB)] = 4 * MiB
    """Largest gRPC message accepted or sent."""
    stream_grace_s: Annotated[float, Field(ge=0.0, le=300.0)] = 5.0
    """Time agent streams get to finish on shutdown before they are cancelled."""
    notice_block_ms: Annotated[int, Field(ge=10, le=300_000)] = 30_000
    """How long one relay read of the node's notices waits for a wake before it looks again.
    Wakes are pushed (one pub/sub subscription per replica), so a long wait costs nothing;
    a short one makes every idle agent stream wake the replica that often."""
    notice_batch: Annotated[int, Field(ge=1, le=10_000)] = 256
    """Most notices relayed per read."""
    notice_linger_ms: Annotated[int, Field(ge=0, le=1_000)] = 5
    """After relaying notices, wait this long before the next read, so that notices written
    meanwhile go in one read (and, to an agent that takes batches, one message) instead of
    one each; the first notice after a quiet spell is relayed at once. Agents use notices to
    count open debits between leases (every 200 ms by default): a few ms of delay is harmless,
    while a busy node's admissions stop costing a read and a write per grant."""
    admin_timeout_ms: Annotated[int, Field(ge=10, le=60_000)] = 2_000
    """Store deadline for admin, commit and release calls (StoreUnavailable after). Lease
    ingest is bounded by the store itself, per batch (RedisStore: its op timeout)."""
    redis_cluster: bool = False
    """``redis_url`` names a node of a Redis Cluster (keys spread over its masters)."""
    redis_max_connections: Annotated[int, Field(ge=2, le=10_000)] = 16
    """Most Redis connections this replica opens (per Cluster node), whatever the number of
    agents it serves; callers wait for a free one. The pool opens a connection whenever all
    are busy, so without a small bound a burst of agents (a registration storm: a Hello's
    script and its relay's first read each) grew it towards one per concurrent agent; the hot
    paths need few (the debit holds one, ingest pipelines two, the wake subscription one)."""
    node_expiry_s: Annotated[float, Field(ge=0.0, le=30 * 86_400)] = 3_600.0
    """A node not heard of for this long (no lease, no pool load, no registration) and with no
    open reservation is removed from the store; 0 keeps nodes until deleted by hand."""
    node_sweep_s: Annotated[float, Field(gt=0.0, le=86_400)] = 60.0
    """How often a replica looks for expired nodes (when ``node_expiry_s`` > 0)."""
    workers: Annotated[int, Field(ge=1, le=256)] | None = None
    """Broker worker processes sharing ``listen`` (SO_REUSEPORT), each a replica of its own;
    None: the pod's CPUs (its cgroup CPU quota rounded up, else the CPUs it may run on), and
    one on the embedded store, which lives in one process (more is refused). See
    ``crossflow_ctl/broker/workers.py`` for restarts and how /metrics merges the workers'."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_json: bool = True
    metrics_listen: str | None = None
    """host:port of the replica's Prometheus /metrics endpoint (port 0 picks one); None: none."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC endpoint for traces (needs opentelemetry-exporter-otlp-proto-grpc); None: none."""
    metrics_refresh_ms: Annotated[int, Field(ge=50, le=300_000)] = 5_000
    """How often the state gauges (open reservations, node credit) are re-read from the store."""
    room: RoomWatchSettings = RoomWatchSettings()
    """WatchRoom streams: store polling, rate limits and heartbeats."""
    store_breaker: StoreBreakerSettings = StoreBreakerSettings()
    """Admission's fail-fast while the store does not answer (a hung Redis)."""

    @field_validator("listen")
    @classmethod
    def _listen_has_port(cls, value: str) -> str:
        return host_port(value, port_zero=True)

    @model_validator(mode="after")
    def _redis_tls(self) -> BrokerSettings:
        if self.redis_ca_file is not None and not (self.redis_url or "").startswith("rediss://"):
            raise ValueError("redis_ca_file needs a rediss:// redis_url")
        if self.redis_cluster and not self.redis_url:
            # it was dropped without a word: the replica ran on its embedded store
            raise ValueError("redis_cluster needs a redis_url (a node of the Redis Cluster)")
        return self

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://: {value!r}")
        return value


def load_settings(
    config_file: Path | None = None, overrides: dict[str, Any] | None = None
) -> BrokerSettings:
    """Defaults < YAML file < environment (CROSSFLOW_*) < ``overrides`` (CLI flags).

    Validated here, once: a bad value raises ConfigError naming the field.
    """
    return load_layered(BrokerSettings, config_file, overrides)
