"""Simulator settings: one validated model (the CLI builds it from flags)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from crossflow_ctl.client.holding import QueueConfig
from crossflow_ctl.domain.capacity import (
    MODEL_PRESETS,
    NODE_PRESETS,
    ModelSpec,
    NodeProfile,
    server_profile,
)
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.models import Frozen
from crossflow_ctl.domain.online_calibration import CalibrationSettings
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.sim.prefix_cache import CacheScope


class PolicyKind(StrEnum):
    STATIC = "static"
    """Every prompt takes the normal path: prefill pool, KV transfer, decode pool."""
    THRESHOLD = "threshold"
    """Prefill on a decode node when the uncached prompt is short or the prefill queue is long;
    no reservation, no lease (the heuristic other routers ship)."""
    LEASES = "leases"
    """The broker's admission policy over agents' leases, through the store."""


class SimConfig(Frozen):
    """One simulated cluster and policy. Times in the field names; tokens per node."""

    model: str = "gpt-oss-120b"
    hardware: str = "h200"
    """The servers' hardware: the step model the simulated engines run on (the truth)."""
    agent_hardware: str | None = None
    """The hardware preset the agents price leases with, when not the servers' own: a wrong
    prior (their online calibration, when on, starts from it). None: the servers' own."""
    agent_calibration: CalibrationSettings = CalibrationSettings(enabled=False)
    """The agents' online calibration from their servers' step counters (off by default: the
    agents price with ``agent_hardware``'s profile, or the truth)."""
    gpus_per_server: Annotated[int, Field(ge=1, le=72)] = 1
    """GPUs of ``hardware`` in each server, one model replica across them
    (:func:`~crossflow_ctl.domain.capacity.server_profile`)."""
    prefill_nodes: Annotated[int, Field(ge=1, le=512)] = 2
    decode_nodes: Annotated[int, Field(ge=1, le=512)] = 4
    policy: PolicyKind = PolicyKind.STATIC
    seed: int = 0

    prefill_chunk_tokens: Annotated[int, Field(gt=0, le=1_048_576)] = 8192
    """Chunked prefill on prefill servers: uncached tokens per engine step."""
    kv_capacity_tokens: Annotated[int, Field(gt=0, le=1_000_000_000)] = 1_000_000
    """KV-cache token slots of one decode server (prompt + output are reserved on admission)."""
    borrow_chunk_tokens: Annotated[int, Field(gt=0, le=1_048_576)] = 2048
    """Borrowed prefill tokens a decode server adds to one decode step (its chunk size)."""
    lease_sized_chunks: bool = True
    """Leases policy: decode servers size each borrowed prompt's chunk for its prefix within the
    agents' ITL budget (the lease's per-token cost assumes that rule);
    ``borrow_chunk_tokens`` then applies only to the threshold heuristic."""
    max_batch: Annotated[int, Field(gt=0, le=4096)] = 256
    max_macro_steps: Annotated[int, Field(gt=0, le=100_000)] = 64
    """Decode steps advanced as one event while the batch does not change (see cluster.py)."""

    cache_scope: CacheScope = CacheScope.CLUSTER
    cache_capacity_tokens: Annotated[int, Field(gt=0)] = 16_000_000
    """Prefix cache size (Mooncake traces only), per node or for the whole pool."""

    ttft_slo_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 2000.0
    lease: LeaseSettings = LeaseSettings()
    """The agents' lease settings; its ``itl_slo_ms`` is also the ITL SLO of the metrics."""
    broker_policy: PolicySettings = PolicySettings()
    late_binding: bool = True
    """Leases policy: the router holds prompts that found no room while the prefill pool is
    behind, and re-offers them when room appears (the client library's AdmissionQueue)."""
    queue: QueueConfig = QueueConfig(max_hold_ms=600_000, max_held=100_000)
    """The router's AdmissionQueue settings. A held prompt goes to prefill as soon as prefill
    has room (``prefill_room_ms``), so the hold deadline fires only while prefill has had no
    room that long, i.e. under overload. There it gains nothing (held prompts go to prefill in
    arrival order, so one sent at its deadline starts no sooner than one still held) and costs
    the prompt its chance to borrow: with a 60 s deadline, Mooncake at 16x on GB300 sent 62 %
    of the prompts to a prefill queue 70 s deep, and once releases stopped the decode nodes
    lent nothing for the last 230 s while 35 M queued tokens drained through two prefill
    servers. So the deadline is the queue's longest; the bound is what one router can keep."""
    prefill_room_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 2000.0
    """The router's word that prefill has room for a held prompt: the prefill pool's estimated
    wait (outstanding uncached tokens over its nominal rate) is at most this. The default keeps
    about one borrow horizon of work queued at prefill (so Demand and Benefit see the pool
    behind) and holds the rest for leases."""
    fast_forward_agents: bool = True
    """Agents at a fixed point sleep until their node changes (exact; see sim/agents.py)."""
    direct_control: bool = True
    """Leases policy: the broker's per-prompt calls take the direct path to the same rules
    (sim/direct.py: no service plumbing); False runs the real service path, which
    ``tests/sim/test_direct.py`` holds it to."""
    agent_period_ms: Annotated[int, Field(gt=0, le=60_000)] = 200
    lease_ttl_ms: Annotated[int, Field(gt=0, le=60_000)] = 600

    threshold_short_tokens: Annotated[int, Field(ge=0)] = 2048
    """Threshold heuristic: prompts with fewer uncached tokens go to a decode node."""
    threshold_queue_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1000.0
    """Threshold heuristic: ... or any prompt, when the prefill pool's wait is above this."""

    window_s: Annotated[float, Field(gt=0)] = 60.0
    """Time-series bin, in trace seconds (divided by the load scale in simulated time)."""

    @model_validator(mode="after")
    def _one_horizon(self) -> SimConfig:
        # The agents size compute and output credit over their horizon, the broker prices output
        # debits over its own and sizes the commit TTL for it: in a deployment the agent takes the
        # broker's from its Welcome, so a simulation with two different horizons models nothing.
        if self.lease.horizon_ms != self.broker_policy.borrow_horizon_ms:
            raise ValueError(
                f"lease.horizon_ms ({self.lease.horizon_ms}) must equal "
                f"broker_policy.borrow_horizon_ms ({self.broker_policy.borrow_horizon_ms}): "
                "agents take the broker's horizon"
            )
        return self

    @property
    def model_spec(self) -> ModelSpec:
        try:
            return MODEL_PRESETS[self.model]
        except KeyError:
            raise InvalidArgument(
                f"unknown model {self.model!r}; one of {sorted(MODEL_PRESETS)}", field="model"
            ) from None

    @property
    def node_profile(self) -> NodeProfile:
        try:
            return server_profile(NODE_PRESETS[self.hardware], self.gpus_per_server)
        except KeyError:
            raise InvalidArgument(
                f"unknown hardware {self.hardware!r}; one of {sorted(NODE_PRESETS)}",
                field="hardware",
            ) from None

    @property
    def agent_profile(self) -> NodeProfile:
        """The profile the agents start from (the servers' own unless ``agent_hardware``)."""
        if self.agent_hardware is None:
            return self.node_profile
        try:
            return server_profile(NODE_PRESETS[self.agent_hardware], self.gpus_per_server)
        except KeyError:
            raise InvalidArgument(
                f"unknown hardware {self.agent_hardware!r}; one of {sorted(NODE_PRESETS)}",
                field="agent_hardware",
            ) from None

    @property
    def split(self) -> str:
        return f"{self.prefill_nodes}P{self.decode_nodes}D"

    @property
    def label(self) -> str:
        return f"{self.split}/{self.policy.value}"


_SPLIT = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)


def parse_split(text: str) -> tuple[int, int]:
    """``"2P4D"`` -> (2, 4)."""
    m = _SPLIT.match(text.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise InvalidArgument(f"split {text!r} is not like 2P4D", field="split")
    return int(m.group(1)), int(m.group(2))
