"""The demo's local cluster as child processes: broker, engines, agents, gateway.

The fake engines (``crossflow-agent fake-engine``) speak vLLM: its OpenAI API, its P/D protocol
(``kv_transfer_params``, a prefill engine exporting the KV a decode engine pulls) and its
``/metrics``, which one ``crossflow-agent run --source vllm`` per engine scrapes. Decode engines
serve under their agents' node ids. ``crossflow-gateway serve`` stands in front of them, asking
the broker (late binding on) or, for the static comparison, no one (``--no-broker``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import yaml

from crossflow_ctl.demo.processes import Children, executable
from crossflow_ctl.demo.prometheus import DemoPrometheus
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, StepShape, step_time_s
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.models import NodeRole

START_TIMEOUT_S = 30.0
BROKER, ENGINES, AGENTS, GATEWAY = 0, 1, 2, 3
"""Stages of the children: they stop the other way round: the gateway first (it releases what
it holds at a broker still there), then the agents (each sends its last zero lease to the
broker, not into a refused connection), the broker last."""

PREFILL_CHUNK_TOKENS = LeaseSettings().prefill_chunk_tokens
"""The fake prefill engines' chunk: what the prefill agents model their servers' rate with."""
MAX_MODEL_LEN = 1_000_000
"""The fake engines' bound on prompt + output tokens (an agentic context grows past 32k)."""
KV_TRANSFER_GB_S = 25.0
"""How fast the normal path's KV moves from a prefill to a decode engine (an RDMA link's
order): a decode engine waits the prompt's KV bytes over this before it decodes."""

VLLM_SCRAPE_TIMEOUT_MS = 3_000
"""The agents' scrape timeout with real vLLM engines (the default 500 ms timed out every few
seconds with three engines on 2 shared cores)."""

DEMO_ITL_BUCKETS_MS = (
    *(2, 4, 6, 8, 10, 15, 20, 25, 30, 35, 40),
    *(45, 50),  # the agents' step budget (slo 50 x margin 0.9) and their ITL SLO
    *(60, 80, 100, 200, 400, 600, 800, 1000, 2000, 5000),
)
"""The decode engines' ITL histogram bounds: the engines' default bounds with bounds at the
agents' step budget and SLO added.

The decode engines size borrowed chunks to the agents' budget (45 ms), as the lease prices
them. The agent reads the window's p99 by interpolating inside a bucket, so on the default
bounds (40, 60 ms) each such step read as up to 60 ms, over the SLO: the ITL guard zeroed the
lease, cleared it after three quiet periods, and zeroed it again, about once a second."""


@dataclass(frozen=True)
class Engine:
    node_id: str
    url: str
    role: NodeRole


def prefill_rate_tps(model: str, node: str, slowdown: float = 1.0) -> float:
    """What one fake prefill engine processes per second with no cached prefix (same roofline
    as the engine)."""
    chunk = PREFILL_CHUNK_TOKENS
    dt = step_time_s(MODEL_PRESETS[model], NODE_PRESETS[node], StepShape(prefill_tokens=chunk))
    return chunk / (dt * slowdown)


@dataclass
class ClusterSpec:
    prefill: int
    decode: int
    model: str
    node: str
    period_ms: int
    redis_url: str | None
    namespace: str
    port: int
    max_hold_ms: int
    engine: str = "fake"
    """``fake`` (crossflow-agent fake-engine) or ``vllm`` (real vLLM CPU engines)."""
    vllm_venv: Path | None = None
    itl_slo_ms: float | None = None
    """The agents' ITL SLO (None: their default)."""


class Cluster:
    """Starts the children, in order, into ``children``; remembers where each serves."""

    def __init__(
        self, spec: ClusterSpec, children: Children, prometheus: DemoPrometheus | None = None
    ) -> None:
        self.spec = spec
        self.children = children
        self.prometheus = prometheus
        self.broker = ""
        self.prefill: list[Engine] = []
        self.decode: list[Engine] = []
        self.gateway_url = ""
        self._gateway_name = ""

    @property
    def engines(self) -> list[Engine]:
        return [*self.prefill, *self.decode]

    async def start_broker(self) -> str:
        s = self.spec
        argv = [executable("crossflow-broker"), "serve", "--listen", f"127.0.0.1:{s.port}"]
        if s.redis_url:
            argv += ["--redis-url", s.redis_url, "--redis-namespace", s.namespace]
        else:
            argv += ["--embedded-store"]
        if self.prometheus is not None:
            argv += self.prometheus.broker_args()
        child = await self.children.spawn(
            "broker", argv, "listening on ", START_TIMEOUT_S, stage=BROKER
        )
        self.broker = child.address
        return self.broker

    async def start_engines(self) -> None:
        if self.spec.engine == "vllm":
            await self._start_vllm()
            return
        s = self.spec
        names = [(f"prefill-{i + 1}", NodeRole.PREFILL) for i in range(s.prefill)]
        names += [(f"decode-{i + 1}", NodeRole.DECODE) for i in range(s.decode)]
        argv = [
            executable("crossflow-agent"), "fake-engine", "--port", "0", "--protocol", "vllm",
            "--model", s.model, "--node", s.node, "--max-model-len", str(MAX_MODEL_LEN),
        ]  # fmt: skip
        # Decode engines size borrowed chunks within the agents' ITL budget, as their leases
        # price them; prefill engines run the chunk their agents assume.
        by_role = {
            NodeRole.DECODE: [
                *("--pd-role", "decode"),
                *("--itl-budget-ms", f"{LeaseSettings().budget_s * 1000.0:g}"),
                *("--itl-buckets-ms", ",".join(map(str, DEMO_ITL_BUCKETS_MS))),
                *("--kv-transfer-gb-s", f"{KV_TRANSFER_GB_S:g}"),
            ],
            NodeRole.PREFILL: [
                *("--pd-role", "prefill"),
                *("--chunk-tokens", str(PREFILL_CHUNK_TOKENS)),
            ],
        }
        spawned = await asyncio.gather(
            *(
                self.children.spawn(
                    f"engine-{name}",
                    [*argv, "--model-name", name, *by_role[role]],
                    "fake engine serving ",
                    START_TIMEOUT_S,
                    stage=ENGINES,
                )
                for name, role in names
            )
        )
        engines = [
            Engine(name, child.address.removesuffix("/metrics"), role)
            for (name, role), child in zip(names, spawned, strict=True)
        ]
        self.prefill = [e for e in engines if e.role is NodeRole.PREFILL]
        self.decode = [e for e in engines if e.role is NodeRole.DECODE]

    async def _start_vllm(self) -> None:
        from crossflow_ctl.demo import vllm_engines

        s = self.spec
        names = [f"prefill-{i + 1}" for i in range(s.prefill)]
        names += [f"decode-{i + 1}" for i in range(s.decode)]
        urls = await vllm_engines.start_engines(
            self.children, names, s.vllm_venv or vllm_engines.DEFAULT_VENV, ENGINES
        )
        self.prefill = [Engine(n, urls[n], NodeRole.PREFILL) for n in names[: s.prefill]]
        self.decode = [Engine(n, urls[n], NodeRole.DECODE) for n in names[s.prefill :]]
        for p in self.prefill:
            await asyncio.gather(*(vllm_engines.warm_up(p.url, d.url) for d in self.decode))

    async def start_agents(self) -> None:
        s = self.spec
        base = [
            executable("crossflow-agent"), "run", "--broker", self.broker, "--source", "vllm",
            "--model", s.model, "--node", s.node, "--period-ms", str(s.period_ms),
            "--log-level", "warning",
        ]  # fmt: skip
        if s.itl_slo_ms is not None:
            base += ["--slo-ms", f"{s.itl_slo_ms:g}"]
        if s.engine == "vllm":
            # a busy real engine answers /metrics in seconds at times, not in 0.5 s
            config = self.children.log_dir / "agent.yaml"
            config.write_text(yaml.safe_dump({"scrape_timeout_ms": VLLM_SCRAPE_TIMEOUT_MS}))
            base += ["--config", str(config)]
        jobs = []
        for e in self.engines:
            argv = [
                *base,
                *("--node-id", e.node_id, "--role", e.role.value),
                *("--metrics-url", f"{e.url}/metrics"),
            ]
            if self.prometheus is not None:
                argv += self.prometheus.agent_args(e.node_id)
            jobs.append(
                self.children.spawn(f"agent-{e.node_id}", argv, "", START_TIMEOUT_S, stage=AGENTS)
            )
        await asyncio.gather(*jobs)

    def gateway_config(self, broker: bool, port: int) -> dict[str, object]:
        s = self.spec
        return {
            "listen": f"127.0.0.1:{port}",
            "broker": self.broker if broker else None,
            "protocol": "vllm",
            "prefill": [{"node_id": e.node_id, "url": e.url} for e in self.prefill],
            "decode": [{"node_id": e.node_id, "url": e.url} for e in self.decode],
            "max_hold_ms": s.max_hold_ms,
            "log_level": "warning",
        }

    async def start_gateway(self, *, broker: bool, port: int = 0) -> str:
        """``crossflow-gateway serve`` in front of the engines, asking the broker or not
        (static P/D); on ``port`` (0: a free one). Returns its URL."""
        name = "gateway" if broker else "gateway-static"
        config = self.children.log_dir / f"{name}.yaml"
        config.write_text(yaml.safe_dump(self.gateway_config(broker, port), sort_keys=False))
        argv = [executable("crossflow-gateway"), "serve", "--config", str(config)]
        child = await self.children.spawn(
            name, argv, "listening on ", START_TIMEOUT_S, stage=GATEWAY
        )
        self._gateway_name = name
        self.gateway_url = f"http://{child.address}"
        return self.gateway_url

    async def stop_gateway(self) -> None:
        if self._gateway_name:
            await self.children.stop([self._gateway_name])
            self._gateway_name = ""

    @property
    def gateway_port(self) -> int:
        return int(self.gateway_url.rpartition(":")[2]) if self.gateway_url else 0

    def log(self, name: str) -> Path:
        return self.children.log_dir / f"{name}.log"
