"""``crossflow-agent inspect --calibration-windows`` and ``calibrate --from-telemetry`` against a
fake vLLM engine (served on its own event loop in a thread, real HTTP) whose true step model is
not the prior: the fitted constants are shown beside the prior's, the lease is priced with them,
and the profile file written round-trips. Counts windows, never time."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossflow_agent.cli import cli
from crossflow_agent.fake_engine import FakeEngineServer
from crossflow_agent.profile import load_profile
from crossflow_agent.sources.synthetic import EngineRequest, EngineScript, SyntheticEngine
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from tests.agent.test_calibration_e2e import TRUTH

MODEL = MODEL_PRESETS["gpt-oss-120b"]
PRIOR = NODE_PRESETS["h200"]


@pytest.fixture
def engine_url() -> Iterator[str]:
    """A busy fake vLLM engine (steady background arrivals) on a loop of its own."""
    script = EngineScript(
        chunk_tokens=1024,
        background_rps=6.0,
        background=EngineRequest(prompt_tokens=400, output_tokens=120),
    )
    loop = asyncio.new_event_loop()
    server = FakeEngineServer(SyntheticEngine(MODEL, TRUTH, script), protocol="vllm")
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(server.close())

    thread = threading.Thread(target=serve, name="fake-engine", daemon=True)
    thread.start()
    assert ready.wait(30)
    time.sleep(2.0)  # the engine's own clock: its batch fills before the windows are watched
    try:
        yield server.url
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.mark.timeout(180)
def test_inspect_shows_the_fit_beside_the_prior_and_prices_the_lease_with_it(
    engine_url: str,
) -> None:
    args = ["inspect", "--source", "vllm", "--metrics-url", f"{engine_url}/metrics",
            "--node", "h200", "--slo-ms", "500", "--window-ms", "1000",
            "--calibration-windows", "5"]  # fmt: skip
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    cal = report["calibration"]
    assert cal["status"] == "fitted", cal
    assert cal["windows"] >= 3
    assert cal["error"] < cal["prior_error"]
    assert report["prior"]["name"] == "h200"
    assert report["node"]["name"] == "h200+telemetry"  # the lease is priced with the fit
    flops = cal["constants"]["flops_per_s"]
    assert flops["prior"] == PRIOR.flops_per_s
    assert report["node"]["flops_per_s"] == flops["fitted"]
    for o in cal["observations"]:
        assert abs(o["fitted_step_ms"] - o["measured_step_ms"]) < abs(
            o["prior_step_ms"] - o["measured_step_ms"]
        )
    text = CliRunner().invoke(cli, args).output
    assert "step-time fit from" in text and "fitted constants" in text
    assert "flops_per_s" in text and "prior" in text


@pytest.mark.timeout(180)
def test_calibrate_from_telemetry_writes_a_profile_the_agent_reads(
    engine_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "fitted.json"
    result = CliRunner().invoke(
        cli,
        ["calibrate", "--from-telemetry", "--metrics-url", f"{engine_url}/metrics",
         "--source", "vllm", "--window-s", "1.0", "--windows", "5", "--prior", "h200",
         "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "step-time fit from" in result.output and f"wrote {out}" in result.output
    profile = load_profile(out)
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and doc["calibration"]["method"] == "telemetry"
    assert doc["calibration"]["model"] == "gpt-oss-120b"
    assert doc["fit"]["status"] == "fitted" and doc["fit"]["error"] < doc["fit"]["prior_error"]
    assert profile.name == "h200+telemetry"
    assert profile.overlap_penalty == PRIOR.overlap_penalty  # not fitted: the prior's
    # the file is a prior too: the agent's settings read it
    run = CliRunner().invoke(
        cli, ["inspect", "--source", "synthetic", "--window-ms", "0", "--profile", str(out),
              "--json"],
    )  # fmt: skip
    assert run.exit_code == 0, run.output
    assert json.loads(run.output)["node"]["name"] == "h200+telemetry"


def test_calibrate_from_an_idle_engine_writes_nothing(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    server = FakeEngineServer(SyntheticEngine(MODEL, TRUTH), protocol="vllm")
    loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    out = tmp_path / "never.json"
    try:
        result = CliRunner().invoke(
            cli,
            ["calibrate", "--from-telemetry", "--metrics-url", f"{server.url}/metrics",
             "--window-s", "0.1", "--windows", "3", "--out", str(out)],
        )  # fmt: skip
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.run_until_complete(server.close())
        loop.close()
    assert result.exit_code == 1
    assert "too_few_windows" in result.output and not out.exists()


def test_no_calibrate_keeps_the_prior_for_every_lease() -> None:
    """Calibration is on by default; --no-calibrate (or calibration.enabled: false) turns it
    off, and the agent then prices every lease with the preset or profile file."""
    from crossflow_agent.agent import Agent
    from crossflow_agent.settings import load_settings
    from crossflow_agent.sources.synthetic import SyntheticSource

    on = load_settings(None, {"node_id": "n1"})
    off = load_settings(None, {"node_id": "n1", "calibration": {"enabled": False}})
    assert on.calibration.enabled and not off.calibration.enabled
    source = SyntheticSource(SyntheticEngine(MODEL, PRIOR))
    assert Agent(on, source, MODEL, PRIOR).calibration is not None
    agent = Agent(off, source, MODEL, PRIOR)
    assert agent.calibration is None and agent.profile is PRIOR
    result = CliRunner().invoke(
        cli, ["inspect", "--source", "synthetic", "--window-ms", "0", "--no-calibrate", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["settings"]["source"] == "synthetic"
