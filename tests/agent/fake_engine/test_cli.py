"""``crossflow-agent fake-engine`` as its own process: the new flags reach the server."""

from __future__ import annotations

import asyncio
import signal
import sys

import httpx

from tests.agent.fake_engine.conftest import LIMIT_S


async def test_cli_serves_an_sglang_prefill_engine_with_its_bootstrap_site() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "crossflow_agent",
        "fake-engine",
        "--port",
        "0",
        "--protocol",
        "sglang",
        "--pd-role",
        "prefill",
        "--served-model-name",
        "m1",
        "--max-model-len",
        "1000",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(LIMIT_S):
            serving = (await proc.stdout.readline()).decode()
            boot = (await proc.stdout.readline()).decode()
        assert serving.startswith("fake engine serving http://127.0.0.1:"), serving
        url = serving.split()[-1].removesuffix("/metrics")
        assert boot.startswith("fake engine bootstrap port "), boot
        boot_port = int(boot.split()[-1])
        async with httpx.AsyncClient(trust_env=False, timeout=LIMIT_S) as http:
            models = (await http.get(f"{url}/v1/models")).json()
            assert models["data"][0]["id"] == "m1"
            assert models["data"][0]["max_model_len"] == 1000
            r = await http.get(f"http://127.0.0.1:{boot_port}/health")
            assert r.status_code == 200
            assert "sglang:num_running_reqs" in (await http.get(f"{url}/metrics")).text
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(LIMIT_S):
            await proc.wait()
    assert proc.returncode == 0
