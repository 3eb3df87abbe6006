"""``crossflow demo``: a whole Crossflow cluster on loopback, one command.

Starts the broker (embedded store, or ``--redis``), fake engines (SGLang-format /metrics), one
real ``crossflow-agent run`` per engine streaming to the broker over gRPC, then replays a trace
through the Admission API while a live view polls the Admin API. Ends on its own when the trace
is done, or when ``--duration-s`` has passed (cutting the trace there, or keeping the cluster
up after it), or on Ctrl-C/SIGTERM; stops every child and prints a
summary comparing the run with the same trace on static P/D.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from crossflow_ctl.client import AdminClient, AdmissionClient
from crossflow_ctl.demo.model import ModelParams, replay_static
from crossflow_ctl.demo.processes import Children, DemoError, executable
from crossflow_ctl.demo.prometheus import INSTALL_HINT, DemoPrometheus, prometheus_binary
from crossflow_ctl.demo.router import Engine, Router
from crossflow_ctl.demo.trace import Trace
from crossflow_ctl.demo.view import CLEAR, Observations, frame, summary, summary_data
from crossflow_ctl.domain.capacity import (
    MODEL_PRESETS,
    NODE_PRESETS,
    StepShape,
    roofline,
    step_time_s,
)
from crossflow_ctl.domain.errors import Unavailable
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.models import NodeRole, Share

if TYPE_CHECKING:  # the simulator is imported when it runs
    from crossflow_ctl.sim.metrics import Summary

START_TIMEOUT_S = 30.0
BROKER, ENGINES, AGENTS = 0, 1, 2
"""Stages of the children: they stop the other way round, agents first (so each sends its last
zero lease to the broker, not into a refused connection), the broker last."""


@dataclass(frozen=True)
class DemoOptions:
    trace: Trace
    prefill: int = 2
    decode: int = 4
    redis_url: str | None = None
    duration_s: float | None = None
    speed: float = 1.0
    refresh_s: float = 1.0
    live: bool = True
    """Redraw the view in place (a terminal); otherwise print a frame every few refreshes."""
    quiet: bool = False
    model: str = "gpt-oss-120b"
    node: str = "h200"
    prefill_slowdown: float = 1.0
    """Step-time multiplier of the fake prefill engines (1: same hardware as decode)."""
    period_ms: int = 200
    log_dir: Path | None = None
    summary_json: Path | None = None
    simulate: bool = True
    """Also run the project's simulator on the same trace, static and with leases."""
    redis_namespace: str | None = None
    max_hold_ms: int = 300
    """Late binding: how long the router holds a prompt refused for lack of room (0: never)."""
    prometheus: bool = False
    """Also run a real Prometheus scraping the broker and the agents (crossflow_ctl.demo.
    prometheus)."""
    port: int = 0
    """The broker's port on 127.0.0.1 (0: a free one)."""
    connect: Callable[[str], tuple[str, str]] | None = None
    """Called with the broker's address once it serves: (the crossflowctl command to try, a
    note on how it reaches the broker). The CLI writes a crossflowctl context there; without
    it the command names ``--server``."""


PREFILL_CHUNK_TOKENS = LeaseSettings().prefill_chunk_tokens
"""The fake prefill engines' chunk: what the prefill agents model their servers' rate with, and
the router's model prices the normal path at."""


def prefill_rate_tps(opts: DemoOptions, chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> float:
    """What one fake prefill engine processes per second with no cached prefix (same roofline
    as the engine)."""
    dt = step_time_s(
        MODEL_PRESETS[opts.model], NODE_PRESETS[opts.node], StepShape(prefill_tokens=chunk_tokens)
    )
    return chunk_tokens / (dt * opts.prefill_slowdown)


def model_params(opts: DemoOptions) -> ModelParams:
    """The router's model of the cluster: the same split, engines and roofline."""
    return ModelParams(
        prefill_servers=opts.prefill,
        decode_servers=opts.decode,
        prefill_rate_tps=prefill_rate_tps(opts),
        roof=roofline(MODEL_PRESETS[opts.model], NODE_PRESETS[opts.node]),
        prefill_chunk_tokens=PREFILL_CHUNK_TOKENS,
        prefill_slowdown=opts.prefill_slowdown,
    )


async def forget_namespace(redis_url: str, namespace: str) -> None:
    """Delete the demo's own keys (its namespace only; never a flush)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{namespace}*", count=1000)]
        if keys:
            await client.delete(*keys)
    except Exception as exc:  # cleanup must not hide the run's outcome
        print(f"crossflow demo: could not delete keys {namespace}*: {exc}", file=sys.stderr)
    finally:
        await client.aclose()


async def check_redis(redis_url: str, timeout_s: float = 3.0) -> None:
    """Unavailable naming ``--redis`` when that Redis does not answer a PING: without this the
    demo waited out its 30 s start and said only that the cluster was not ready."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(
        redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
    )
    try:
        await client.ping()
    except Exception as exc:
        raise Unavailable(
            f"cannot reach that Redis: {exc} (start it, or leave out --redis for the embedded "
            "store)",
            field="--redis",
        ) from None
    finally:
        await client.aclose()


DEMO_ITL_BUCKETS_MS = (
    *(2, 4, 6, 8, 10, 15, 20, 25, 30, 35, 40),
    *(45, 50),  # the agents' step budget (slo 50 x margin 0.9) and their ITL SLO
    *(60, 80, 100, 200, 400, 600, 800, 1000, 2000, 5000),
)
"""The decode engines' ITL histogram bounds: SGLang's default ``--bucket-inter-token-latency``
with bounds at the agents' step budget and SLO added.

The decode engines size borrowed chunks to the agents' budget (45 ms), as the lease prices
them. The agent reads the window's p99 by interpolating inside a bucket, so on SGLang's bounds
(40, 60 ms) each such step read as up to 60 ms, over the SLO: the ITL guard zeroed the lease,
cleared it after three quiet periods, and zeroed it again, about once a second."""


def demo_log_dir(chosen: Path | None) -> Path:
    """``chosen`` (created if missing) or a new ``crossflow-demo-*`` folder under the system
    temp dir; never deleted by the demo."""
    if chosen is None:
        return Path(tempfile.mkdtemp(prefix="crossflow-demo-"))
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


class Demo:
    def __init__(self, opts: DemoOptions, out: TextIO = sys.stdout) -> None:
        self.opts = opts
        self.out = out
        self.stop = asyncio.Event()
        self.children: Children | None = None
        self.obs = Observations()
        self.interrupted = False
        self.exit_code = 0
        """128 + the signal that stopped the run (130 for Ctrl-C), else 0."""
        self.share: Share = 1.0
        self.hint = ""
        self.namespace = opts.redis_namespace or f"crossflow-demo-{uuid.uuid4().hex[:8]}"
        self.prometheus: DemoPrometheus | None = None

    def _interrupt(self, sig: signal.Signals) -> None:
        """Signal handler: only sets the stop event (the run shuts down in order)."""
        self.interrupted = True
        self.exit_code = self.exit_code or 128 + sig.value
        self.stop.set()

    def _handle_signals(self, on: bool) -> None:
        """SIGINT and SIGTERM set the stop event (on), or are the default again (off: Ctrl-C
        raises KeyboardInterrupt, which a CPU-bound phase such as the simulator needs)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            if on:
                loop.add_signal_handler(sig, self._interrupt, sig)
            else:
                loop.remove_signal_handler(sig)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    async def run(self) -> int:
        """0 when the run ended on its own (or at --duration-s), 128 + the signal (130 for
        Ctrl-C) when one stopped it, after the summary of what ran so far."""
        if self.opts.prometheus and prometheus_binary() is None:
            raise DemoError(f"--prometheus: {INSTALL_HINT}")
        if self.opts.redis_url:
            await check_redis(self.opts.redis_url)
        self._handle_signals(True)
        log_dir = demo_log_dir(self.opts.log_dir)
        if self.opts.prometheus:
            self.prometheus = DemoPrometheus(log_dir)
        self.children = Children(log_dir)
        try:
            return await self._run()
        finally:
            await self.children.stop()
            # kept: the logs are what an operator reads when the demo misbehaved
            if self.opts.redis_url:
                await forget_namespace(self.opts.redis_url, self.namespace)
            self._handle_signals(False)
            self.say(f"logs kept in {log_dir}")

    async def _run(self) -> int:
        assert self.children is not None
        o = self.opts
        split = f"{o.prefill}P{o.decode}D"
        self.say(
            f"crossflow demo: {split} on loopback, trace {o.trace.name} "
            f"({o.trace.requests} requests), logs in {self.children.log_dir}"
        )
        broker = await self._start_broker()
        command, note = (
            o.connect(broker)
            if o.connect is not None
            else (f"crossflowctl --server {broker} get nodes -w", "")
        )
        self.hint = command
        linger = "" if o.duration_s is not None else "--duration-s S keeps the cluster up S s"
        extra = "; ".join(x for x in (note, linger) if x)
        self.say(f"broker on {broker}: try `{command}`" + (f" ({extra})" if extra else ""))
        prefill, decode = await self._start_engines()
        await self._start_agents(broker, prefill, decode)
        if self.prometheus is not None:
            url = await self.prometheus.start(self.children)
            self.say(
                f"prometheus on {url}: try {url}/graph?g0.expr="
                "max%20by%20(state)%20(crossflow_broker_decode_nodes) and its /alerts"
            )
        async with AdminClient(broker, timeout_s=2.0) as admin:
            await self._wait_ready(admin, len(prefill), len(decode))
            self.share = (await admin.get_policy()).policy.shares
            if self.stop.is_set():
                self.say("interrupted before the cluster was ready: nothing was replayed")
                return self.exit_code
            params = model_params(o)
            async with AdmissionClient(broker, timeout_s=1.0, fail_closed=True) as admission:
                router = Router(
                    o.trace,
                    admission,
                    prefill,
                    decode,
                    params,
                    speed=o.speed,
                    max_hold_ms=o.max_hold_ms,
                )
                started = time.monotonic()
                await self._replay(router, admin, started)
                elapsed = time.monotonic() - started
            static = replay_static(o.trace, params, speed=o.speed)
        await self.children.stop()  # the simulator below should not compete with them
        if self.interrupted:
            self.say(f"interrupted after {elapsed:.1f} s: the summary covers what ran so far")
        self.say(summary(o.trace.name, split, elapsed, router.stats, static, self.obs))
        sim = await self._simulate(params, split) if o.simulate and not self.interrupted else None
        if o.summary_json is not None:
            data = summary_data(router.stats, static, self.obs) | {
                "elapsed_s": elapsed,
                "interrupted": self.interrupted,
                "trace": o.trace.name,
                "split": split,
                "simulator": {k: v.model_dump(mode="json") for k, v in (sim or {}).items()},
            }
            o.summary_json.write_text(json.dumps(data, indent=2))
        return self.exit_code

    async def _simulate(self, params: ModelParams, split: str) -> dict[str, Summary] | None:
        """The simulator's static and leases runs of the trace, printed; None when Ctrl-C
        stopped it. It computes without awaiting, so the signal handlers that only set the
        stop event would wait for it to finish: Ctrl-C raises KeyboardInterrupt meanwhile."""
        from crossflow_ctl.demo.simcompare import sim_lines, simulate_both

        o = self.opts
        self._handle_signals(False)
        try:
            sim = await simulate_both(o.trace, params, o.model, o.node, o.speed)
        except KeyboardInterrupt:
            self.interrupted, self.exit_code = True, 128 + signal.SIGINT.value
            self.say("interrupted: simulator comparison skipped")
            return None
        finally:
            self._handle_signals(True)
        self.say(
            "Simulator (crossflow_ctl.sim: real policy, store and lease rules on a modelled "
            "cluster), same trace:\n" + "\n".join(sim_lines(sim, split))
        )
        return sim

    async def _start_broker(self) -> str:
        assert self.children is not None
        argv = [executable("crossflow-broker"), "serve", "--listen", f"127.0.0.1:{self.opts.port}"]
        if self.opts.redis_url:
            argv += ["--redis-url", self.opts.redis_url, "--redis-namespace", self.namespace]
        else:
            argv += ["--embedded-store"]
        if self.prometheus is not None:
            argv += self.prometheus.broker_args()
        child = await self.children.spawn(
            "broker", argv, "listening on ", START_TIMEOUT_S, stage=BROKER
        )
        return child.address

    async def _start_engines(self) -> tuple[list[Engine], list[Engine]]:
        assert self.children is not None
        o = self.opts
        names = [(f"prefill-{i + 1}", NodeRole.PREFILL) for i in range(o.prefill)]
        names += [(f"decode-{i + 1}", NodeRole.DECODE) for i in range(o.decode)]
        argv = [
            executable("crossflow-agent"),
            "fake-engine",
            "--port",
            "0",
            "--model",
            o.model,
            "--node",
            o.node,
        ]
        # Decode engines size borrowed chunks within the agents' ITL budget, as their leases
        # price them; prefill engines run the chunk their agents and the router's model assume.
        by_role = {
            NodeRole.DECODE: [
                *("--itl-budget-ms", f"{LeaseSettings().budget_s * 1000.0:g}"),
                *("--itl-buckets-ms", ",".join(map(str, DEMO_ITL_BUCKETS_MS))),
            ],
            NodeRole.PREFILL: ["--chunk-tokens", str(PREFILL_CHUNK_TOKENS)],
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
            (Engine(name, child.address.removesuffix("/metrics")), role)
            for (name, role), child in zip(names, spawned, strict=True)
        ]
        prefill = [e for e, role in engines if role is NodeRole.PREFILL]
        if o.prefill_slowdown != 1.0:
            import httpx

            async with httpx.AsyncClient(timeout=5.0) as http:
                for e in prefill:
                    resp = await http.post(
                        f"{e.url}/control", json={"slowdown": o.prefill_slowdown}
                    )
                    resp.raise_for_status()
        return prefill, [e for e, role in engines if role is NodeRole.DECODE]

    async def _start_agents(self, broker: str, prefill: list[Engine], decode: list[Engine]) -> None:
        assert self.children is not None
        o = self.opts
        base = [
            executable("crossflow-agent"),
            "run",
            "--broker",
            broker,
            "--source",
            "sglang",
            "--model",
            o.model,
            "--node",
            o.node,
            "--period-ms",
            str(o.period_ms),
            "--log-level",
            "warning",
        ]
        jobs = []
        for role, engines in ((NodeRole.PREFILL, prefill), (NodeRole.DECODE, decode)):
            for e in engines:
                argv = [
                    *base,
                    "--node-id",
                    e.node_id,
                    "--role",
                    role.value,
                    "--metrics-url",
                    f"{e.url}/metrics",
                ]
                if self.prometheus is not None:
                    argv += self.prometheus.agent_args(e.node_id)
                jobs.append(
                    self.children.spawn(
                        f"agent-{e.node_id}", argv, "", START_TIMEOUT_S, stage=AGENTS
                    )
                )
        await asyncio.gather(*jobs)

    async def _wait_ready(self, admin: AdminClient, prefill: int, decode: int) -> None:
        """Until every decode node has a lease and every prefill server reports load."""
        assert self.children is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.stop.is_set():
            dead = self.children.dead()
            if dead:
                raise DemoError(f"{dead[0].name} exited: {dead[0].log_tail()}")
            with contextlib.suppress(Exception):
                nodes = await admin.list_nodes()
                pools = await admin.list_pools()
                leased = sum(
                    1
                    for n in nodes
                    if n.state.info.role is NodeRole.DECODE and n.state.lease is not None
                )
                reporting = sum(len(p.reports) for p in pools)
                if leased >= decode and reporting >= prefill:
                    self.say(
                        f"cluster ready: {leased} decode nodes leasing, "
                        f"{reporting} prefill servers reporting"
                    )
                    return
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the cluster was not ready after {START_TIMEOUT_S:.0f} s "
                    f"(logs in {self.children.log_dir})"
                )
            await asyncio.sleep(0.2)

    async def _replay(self, router: Router, admin: AdminClient, started: float) -> None:
        """Replay the trace with the live view; with ``duration_s``, stop there, or keep the
        cluster up (agents leasing, view refreshing) after a trace that ends sooner."""
        o = self.opts
        replay = asyncio.create_task(router.run(self.stop))
        stopping = asyncio.create_task(self.stop.wait())
        frames = 0
        lingering = False
        try:
            while True:
                running = {t for t in (replay, stopping) if not t.done()}
                # Only tasks still running: a finished replay (the cluster lingering) would
                # return at once every pass, polling the broker without pause.
                await asyncio.wait(
                    running, timeout=o.refresh_s, return_when=asyncio.FIRST_COMPLETED
                )
                elapsed = time.monotonic() - started
                if o.duration_s is not None and elapsed >= o.duration_s:
                    self.stop.set()
                if self.stop.is_set() or (replay.done() and not self._linger(replay)):
                    break
                if replay.done() and not lingering:
                    lingering = True
                    self.say(
                        f"trace done after {elapsed:.0f} s; the cluster stays up until "
                        f"--duration-s {o.duration_s:g} s (Ctrl-C ends it now)"
                    )
                assert self.children is not None
                dead = self.children.dead()
                if dead:
                    self.stop.set()
                    await replay
                    raise DemoError(f"{dead[0].name} exited during the run: {dead[0].log_tail()}")
                await self._tick(router, admin, elapsed, frames)
                frames += 1
        finally:
            self.stop.set()
            stopping.cancel()
            await replay

    def _linger(self, replay: asyncio.Task[None]) -> bool:
        """Whether to keep the cluster up after the replay ended: only when ``duration_s``
        asks for it, and the replay ended without an error."""
        return self.opts.duration_s is not None and replay.exception() is None

    async def _tick(self, router: Router, admin: AdminClient, elapsed: float, frames: int) -> None:
        try:
            reservations = await admin.list_reservations()  # before the leases: see check_grants
            nodes = await admin.list_nodes()
            # Every decode node's recent leases (32 kept: 6 s at the agents' 200 ms), so the
            # summary counts each lease and its ITL once, not one lease a poll.
            decode = {n.state.info.node_id for n in nodes if n.state.info.role is NodeRole.DECODE}
            history = {
                node_id: list((await admin.get_node(node_id)).recent_leases)
                for node_id in sorted(decode | {r.node_id for r in reservations})
            }
            pools = await admin.list_pools()
        except Exception as exc:  # the view must not end the demo
            self.say(f"(live view: admin call failed: {exc})")
            return
        self.obs.check_grants(reservations, history, self.share)
        for node_id in decode:
            self.obs.record(node_id, history[node_id])
        at_ms = int(time.time() * 1000)
        self.obs.observe(nodes, at_ms)
        if self.opts.quiet:
            return
        text = frame(
            "crossflow demo",
            elapsed,
            router.stats,
            nodes,
            pools,
            self.obs,
            self.opts.trace.requests,
            at_ms,
            hint=self.hint,
        )
        if self.opts.live:
            self.out.write(CLEAR + text + "\n")
            self.out.flush()
        elif frames % 3 == 0:
            self.say(text + "\n")
