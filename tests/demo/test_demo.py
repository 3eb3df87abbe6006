"""``crossflow demo`` end to end: the real binary starts a broker, fake vLLM engines, agents and
the gateway as processes on loopback, sends a short synthetic trace through the gateway as real
streamed completions, then again through a gateway with no broker, and stops everything it
started."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

pytestmark = pytest.mark.slow

# A small cluster and a short, heavy trace: enough prompt work to queue on one prefill server.
ARGS = [
    "demo",
    "--prefill",
    "1",
    "--decode",
    "2",
    "--sessions",
    "10",
    "--load",
    "3",
    "--view",
    "plain",
]


@pytest.fixture(autouse=True)
def ctl_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """crossflowctl's config file for the demo's context: never the user's."""
    path = tmp_path / "crossflowctl.yaml"
    monkeypatch.setenv("CROSSFLOWCTL_CONFIG", str(path))
    monkeypatch.delenv("CROSSFLOWCTL_SERVER", raising=False)
    monkeypatch.delenv("CROSSFLOWCTL_CONTEXT", raising=False)
    return path


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    ctl = Path(_binary()).with_name("crossflowctl")
    return subprocess.run([str(ctl), *args], capture_output=True, text=True, timeout=60)


def _binary() -> str:
    found = shutil.which("crossflow") or str(Path(sys.executable).with_name("crossflow"))
    if not Path(found).exists():
        pytest.skip("crossflow is not installed (pip install -e .)")
    return found


def _children(pid: int) -> set[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _check_summary(
    path: Path, *, require_checks: bool = True, simulated: bool = True
) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    assert data["decode_nodes_leasing"] == 2
    assert data["lease_versions_seen"] >= 4, "leases flowed from the agents through the broker"
    assert data["reasons"].get("borrowed", 0) > 0, data["reasons"]
    assert data["over_commits"] == []
    if require_checks:
        assert data["over_commit_checks"] > 0, "the check ran on nodes with open grants"
    assert data["lost"] == 0, data["lost_reasons"]
    # The path each request took is the gateway's word: its headers (counted by the client)
    # and its own counters agree, and the decode engines prefilled the borrowed prompts.
    paths = data["gateway"]["requests"]
    assert paths.get("borrowed", 0) == data["borrowed"], paths
    assert sum(paths.values()) == data["finished"], paths
    assert data["decode_prompt_tokens"]["borrowed"] > 0 or data["borrowed"] == 0
    assert data["reservations_left_open"] == 0
    # Every prompt the gateway asked about got one late-binding outcome.
    outcomes = data["late_binding"]["dispatch"]
    assert data["finished"] <= sum(outcomes.values()) <= data["requests"], outcomes
    sim = data["simulator"]
    if not simulated:  # interrupted: the summary of what ran, no simulator runs after it
        assert sim == {}
        return data
    assert sim["leases"]["overcommits"] == 0 and sim["static"]["borrowed_share"] == 0.0
    return data


def test_demo_runs_and_exits_0_on_its_own(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            _binary(),
            *ARGS,
            "--duration-s",
            "10",
            "--summary-json",
            str(summary),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cluster ready: 2 decode nodes leasing, 1 prefill servers reporting" in proc.stdout
    assert "gateway on http://127.0.0.1:" in proc.stdout
    assert "static run: the same trace through http://127.0.0.1:" in proc.stdout
    assert "Summary: synthetic-agentic(seed=7) on 1P2D" in proc.stdout
    assert "over-commits seen: none" in proc.stdout
    assert "late binding: " in proc.stdout
    assert "(each lease's p99 over its agent's period): SLO 50 ms, over it in " in proc.stdout
    data = _check_summary(summary)
    assert data["borrowed"] > 0, data["reasons"]  # and some of them finished by the cut
    assert data["itl_slo_ms"] == 50.0 and set(data["itl_over_slo"]) == {"decode-1", "decode-2"}
    assert not data["interrupted"]
    # The static run: the same trace (cut at the same point) through a gateway that asks no
    # broker, measured on the same engines: nothing borrowed, nothing lost.
    static = data["static"]
    assert static["finished"] > 0 and static["lost"] == 0, static["lost_reasons"]
    assert static["borrowed"] == 0 and set(static["gateway"]["requests"]) == {"normal"}
    assert static["decode_prompt_tokens"]["borrowed"] == 0
    assert data["compared_requests"] > 0
    logs = tmp_path / "logs"
    assert f"logs kept in {logs}" in proc.stdout
    assert (logs / "broker.log").is_file(), sorted(p.name for p in logs.iterdir())
    assert (logs / "gateway.yaml").is_file() and (logs / "gateway-static.log").is_file()
    # Agents stop before the broker: each decode agent's last zero lease reaches it, and no
    # agent warns of a broker gone ("Connection refused") at shutdown.
    broker_log = (logs / "broker.log").read_text()
    assert broker_log.count('"reason": "shutting_down"') == 2, broker_log[-2000:]
    for agent_log in logs.glob("agent-*.log"):
        assert "Connection refused" not in agent_log.read_text(), agent_log.read_text()


def test_demo_on_redis_stops_everything_on_sigint(
    tmp_path: Path, redis_url: str, redis_namespace: str, ctl_config: Path
) -> None:
    """Ctrl-C prints the summary of what ran so far and exits 130. While it runs, crossflowctl
    reaches its broker through the context it wrote (made current: it created the file), on
    the port --port asked for; the context is gone after."""
    summary = tmp_path / "summary.json"
    with socket.socket() as s:  # a free port, for --port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            _binary(),
            *ARGS,
            "--summary-json",
            str(summary),
            "--log-dir",
            str(tmp_path / "logs"),
            "--redis",
            redis_url,
            "--redis-namespace",
            redis_namespace,
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        # Wait for the cluster, then for the first live frame that shows borrowing.
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "demo exited early: " + "".join(lines[-20:])
            lines.append(line)
            if line.startswith("borrowed ") and not line.startswith("borrowed 0 "):
                break
        children = _children(proc.pid)
        assert len(children) == 1 + 3 + 3 + 1  # broker, 3 engines, 3 agents, the gateway
        said = "".join(lines)
        assert f"broker on 127.0.0.1:{port}: try `crossflowctl get nodes -w` (context " in said
        got = _ctl("get", "nodes", "-o", "json")
        assert got.returncode == 0, got.stderr
        assert {n["name"] for n in json.loads(got.stdout)["items"]} >= {"decode-1", "decode-2"}
        assert _ctl("--context", "demo", "get", "leases").returncode == 0
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted after " in out and "Summary:" in out
    assert not ctl_config.exists(), "the context (and the file the demo made for it) is gone"
    # Interrupted right after the first borrowing frame, the run may end before any frame found
    # a grant still open, so only the full run above must have checked over-commit.
    data = _check_summary(summary, require_checks=False, simulated=False)
    assert data["interrupted"] and data["static"] is None  # no static run after Ctrl-C
    assert not [pid for pid in children if _alive(pid)], "every child process was stopped"
    keys = redis.Redis.from_url(redis_url)
    try:
        assert list(keys.scan_iter(match=f"{redis_namespace}*")) == [], "the demo cleans up"
    finally:
        keys.close()


def test_duration_longer_than_the_trace_keeps_the_cluster_up(tmp_path: Path) -> None:
    """``--duration-s`` used to only cut a trace short: the demo still stopped when its trace
    did (~30 s by default), too soon to try crossflowctl against it as the README suggests."""
    summary = tmp_path / "summary.json"
    duration_s = 12.0
    proc = subprocess.run(
        [
            _binary(), "demo", "--prefill", "1", "--decode", "1", "--sessions", "1",
            "--view", "plain", "--no-sim", "--no-static-run", "--duration-s", str(duration_s),
            "--summary-json", str(summary),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the cluster stays up until --duration-s 12 s" in proc.stdout, proc.stdout
    data = json.loads(summary.read_text())
    assert data["elapsed_s"] >= duration_s and not data["interrupted"]
    assert data["finished"] == data["requests"] and data["static"] is None
    # Lingering refreshes once a refresh period (1 s; a plain frame every third): a wait on the
    # finished replay returned at once and printed frames by the thousand.
    frames = proc.stdout.count("crossflow demo, leases run   t=")
    assert frames <= data["elapsed_s"] / 3 + 3, frames


def test_an_unreachable_redis_is_said_at_once_with_exit_4() -> None:
    """The demo started every process, waited out its 30 s start and said only "the cluster
    was not ready after 30 s" (exit 1)."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://:secret@127.0.0.1:{s.getsockname()[1]}/0"
    proc = subprocess.run(
        [_binary(), "demo", "--redis", url, "--no-sim", "--view", "none"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: --redis: cannot reach that Redis: ") and "secret" not in line
    assert "crossflow demo: " not in proc.stdout  # nothing was started


def test_engine_vllm_without_its_venv_says_how_to_install_it(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            _binary(), "demo", "--engine", "vllm", "--vllm-venv", str(tmp_path / "none"),
            "--no-sim", "--view", "none", "--no-context",
        ],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--engine vllm: no real vLLM: " in proc.stderr
    assert "run `bash scripts/install_vllm_cpu.sh`" in proc.stderr
    assert "crossflow demo: " not in proc.stdout  # nothing was started


@pytest.mark.realengine
@pytest.mark.timeout(900)
def test_engine_vllm_runs_the_demo_on_real_engines(tmp_path: Path) -> None:
    """The same demo on real vLLM CPU engines (1 prefill, 2 decode, NixlConnector): every
    request answered through the gateway, the normal path's KV moved by NIXL, nothing lost,
    no reservation left open. Which path a prompt takes depends on the machine's load here,
    so borrowing is not required."""
    from crossflow_ctl.demo.vllm_engines import DEFAULT_VENV

    if not (DEFAULT_VENV / "bin" / "python").exists():
        pytest.skip("no real vLLM: .venv-vllm is missing; run `bash scripts/install_vllm_cpu.sh`")
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            _binary(), "demo", "--engine", "vllm", "--sessions", "2", "--no-sim",
            "--no-static-run", "--view", "none", "--no-context", "--summary-json", str(summary),
            "--log-dir", str(tmp_path / "logs"),
        ],
        capture_output=True, text=True, timeout=850,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "real vLLM 0.32 CPU engines" in proc.stdout
    data = json.loads(summary.read_text())
    assert data["finished"] == data["requests"] > 0 and data["lost"] == 0, data["lost_reasons"]
    assert data["reservations_left_open"] == 0
    assert data["decode_prompt_tokens"]["transferred"] > 0  # KV moved prefill -> decode by NIXL
    assert sum(data["gateway"]["requests"].values()) == data["finished"]
    assert len(list((tmp_path / "logs").glob("engine-*.log"))) == 3
