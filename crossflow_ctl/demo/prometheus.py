"""A real Prometheus beside a local cluster (``crossflow demo --prometheus``, and the tests).

It runs Debian's (or any) ``prometheus`` binary as one more child: a config written to the
demo's log folder, its data there too, listening on loopback only, scraping the broker's, each
agent's and the gateway's ``/metrics`` every second with the ``crossflow_component`` label the
chart's ServiceMonitors set, and loading the chart's alert rules when this is a source checkout
(so its ``/alerts`` page shows them). Ports are picked free beforehand: Prometheus cannot report
a port 0 it bound.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from crossflow_ctl.demo.processes import Child, Children, DemoError

HOST = "127.0.0.1"
RULES_FILE = Path(__file__).resolve().parents[2] / "deploy/helm/crossflow/rules/alerts.yaml"
"""The chart's alert rules, found beside the package in a source checkout (absent in a wheel)."""
INSTALL_HINT = (
    "Prometheus is not installed: `apt-get install prometheus` (Debian, Ubuntu) or put a "
    "`prometheus` binary on PATH"
)


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Target:
    """One scrape target: ``host:port`` serving ``/metrics``."""

    address: str
    component: str
    """``broker``, ``agent`` or ``gateway``: the job, and the ``crossflow_component`` label."""
    labels: dict[str, str] = field(default_factory=dict)


def config(
    targets: list[Target], interval_s: float, rule_files: tuple[Path, ...] = ()
) -> dict[str, Any]:
    """Prometheus's configuration: one job per component, each target with its labels."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for t in targets:
        labels = {"crossflow_component": t.component, **t.labels}
        jobs.setdefault(t.component, []).append({"targets": [t.address], "labels": labels})
    interval = f"{max(1, round(interval_s * 1000))}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": f"crossflow-{job}", "static_configs": static}
            for job, static in jobs.items()
        ],
    }


class LocalPrometheus:
    """A Prometheus child of ``children`` scraping ``targets``; :meth:`start` returns its URL."""

    def __init__(
        self,
        workdir: Path,
        targets: list[Target],
        *,
        interval_s: float = 1.0,
        rule_files: tuple[Path, ...] = (),
        port: int | None = None,
    ) -> None:
        self.workdir = workdir
        self.targets = targets
        self.interval_s = interval_s
        self.rule_files = rule_files
        self.port = port or free_port()
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def start(self, children: Children, timeout_s: float = 30.0) -> str:
        binary = prometheus_binary()
        if binary is None:
            raise DemoError(INSTALL_HINT)
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_file = self.workdir / "prometheus.yml"
        text = yaml.safe_dump(config(self.targets, self.interval_s, self.rule_files))
        config_file.write_text(text)
        argv = [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
            "--storage.tsdb.retention.time=1d",
            f"--web.listen-address={HOST}:{self.port}",
        ]
        self.child = await children.spawn("prometheus", argv, "", timeout_s)
        await self._wait_ready(timeout_s)
        return self.url

    async def _wait_ready(self, timeout_s: float) -> None:
        assert self.child is not None
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.child.proc.returncode is not None:
                    raise DemoError(f"prometheus exited: {self.child.log_tail()}")
                try:
                    if (await http.get(f"{self.url}/-/ready")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        raise DemoError(f"prometheus was not ready within {timeout_s:.0f} s")


class DemoPrometheus:
    """What ``crossflow demo --prometheus`` adds: metrics flags for the broker and the agents,
    and a Prometheus scraping them and the gateway, started once they run."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.targets: list[Target] = []

    def _listen(self, component: str, **labels: str) -> str:
        address = f"{HOST}:{free_port()}"
        self.targets.append(Target(address, component, labels))
        return address

    def broker_args(self) -> list[str]:
        """The broker serves /metrics (a settings file: it has no flag for it), its gauges
        refreshed every second."""
        settings = self.log_dir / "broker-metrics.yaml"
        listen = self._listen("broker")
        settings.write_text(yaml.safe_dump({"metrics_listen": listen, "metrics_refresh_ms": 1_000}))
        return ["--config", str(settings)]

    def agent_args(self, node_id: str) -> list[str]:
        return ["--metrics-listen", self._listen("agent", node=node_id)]

    def add_gateway(self, address: str) -> None:
        """The gateway serves /metrics on its own HTTP port (``host:port``)."""
        self.targets.append(Target(address, "gateway"))

    async def start(self, children: Children) -> str:
        rules = (RULES_FILE,) if RULES_FILE.exists() else ()
        return await LocalPrometheus(self.log_dir, self.targets, rule_files=rules).start(children)
