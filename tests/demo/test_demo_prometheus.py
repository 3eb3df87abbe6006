"""``crossflow demo --prometheus``: a real Prometheus beside the demo's cluster, scraping the
broker, every agent and the gateway, with the chart's alert rules loaded; a clear refusal
without one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from crossflow_ctl.demo.prometheus import RULES_FILE, Target, config, prometheus_binary
from tests.promql_catalog import rule_exprs


def _binary() -> str:
    found = shutil.which("crossflow") or str(Path(sys.executable).with_name("crossflow"))
    if not Path(found).exists():
        pytest.skip("crossflow is not installed (pip install -e .)")
    return found


def test_config_scrapes_each_component_with_the_label_the_rules_select() -> None:
    cfg = config(
        [
            Target("127.0.0.1:1", "broker"),
            Target("127.0.0.1:2", "agent", {"node": "decode-1"}),
            Target("127.0.0.1:3", "agent", {"node": "prefill-1"}),
        ],
        interval_s=1.0,
        rule_files=(RULES_FILE,),
    )
    assert cfg["global"]["scrape_interval"] == "1000ms"
    assert cfg["rule_files"] == [str(RULES_FILE)]
    jobs = {j["job_name"]: j["static_configs"] for j in cfg["scrape_configs"]}
    assert jobs["crossflow-broker"] == [
        {"targets": ["127.0.0.1:1"], "labels": {"crossflow_component": "broker"}}
    ]
    assert [s["labels"] for s in jobs["crossflow-agent"]] == [
        {"crossflow_component": "agent", "node": "decode-1"},
        {"crossflow_component": "agent", "node": "prefill-1"},
    ]


def test_without_prometheus_the_demo_says_how_to_get_it_and_starts_nothing(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, PATH=str(tmp_path))  # no prometheus on it
    proc = subprocess.run(
        [_binary(), "demo", "--prometheus", "--no-sim", "--view", "none"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--prometheus: Prometheus is not installed: `apt-get install prometheus`" in proc.stderr
    assert "crossflow demo: " not in proc.stdout  # nothing was started


def _get(url: str, path: str, **params: Any) -> Any:
    response = httpx.get(f"{url}{path}", params=params, timeout=5.0)
    response.raise_for_status()
    return response.json()["data"]


@pytest.mark.slow
@pytest.mark.skipif(
    prometheus_binary() is None,
    reason="prometheus not found: install Debian's prometheus package (.ci/run installs it)",
)
def test_demo_with_prometheus_scrapes_its_processes(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            _binary(), "demo", "--prefill", "1", "--decode", "2", "--sessions", "2",
            "--view", "none", "--no-sim", "--duration-s", "20", "--prometheus",
            "--log-dir", str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = ""
        lines: list[str] = []
        while not url:
            line = proc.stdout.readline()
            assert line, "demo exited early: " + "".join(lines[-20:])
            lines.append(line)
            found = re.match(r"prometheus on (http://127\.0\.0\.1:\d+): ", line)
            url = found.group(1) if found else ""
        deadline = time.monotonic() + 30
        while True:
            up = _get(url, "/api/v1/query", query="up == 1")["result"]
            # Every registered decode node, whatever its lease says at that moment.
            nodes = _get(url, "/api/v1/query", query="sum(crossflow_broker_decode_nodes)")
            counted = [float(r["value"][1]) for r in nodes["result"]]
            if (len(up) == 5 and counted == [2.0]) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        components = sorted(r["metric"]["crossflow_component"] for r in up)
        assert components == ["agent", "agent", "agent", "broker", "gateway"]
        assert {r["metric"].get("node") for r in up} == {"decode-1", "decode-2", "prefill-1", None}
        served = _get(url, "/api/v1/query", query="crossflow_gateway_engine_up")["result"]
        assert {r["metric"]["node"] for r in served} == {"decode-1", "decode-2", "prefill-1"}
        assert counted == [2.0]
        groups = _get(url, "/api/v1/rules")["groups"]
        loaded = {r["name"] for g in groups for r in g["rules"]}
        assert loaded == set(rule_exprs())
        _out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:  # a failed assertion: let the demo stop its children itself
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err[-2000:]
    with pytest.raises(httpx.HTTPError):  # stopped with the rest of the cluster
        httpx.get(f"{url}/-/ready", timeout=2.0)
    assert (tmp_path / "logs" / "prometheus.yml").is_file()
