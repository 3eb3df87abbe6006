"""``crossflow demo``: a whole Crossflow cluster on loopback, one command, real requests.

Starts the broker (embedded store, or ``--redis``), fake engines that speak vLLM (its OpenAI API,
P/D protocol and /metrics), one real ``crossflow-agent run`` per engine streaming to the broker
over gRPC, and ``crossflow-gateway serve`` in front of the engines (:mod:`.cluster`). The
demo's client then replays a trace through the gateway as real streamed completions
(:mod:`.router`) while a live view polls the Admin API and the gateway's /metrics. Then it
replays the same trace through a gateway with no broker (static P/D) on the same engines, and
prints both runs' measured TTFT side by side (:mod:`.view`).

Ends on its own when both runs are done; ``--duration-s`` cuts the first run there (and the
second at the same point), or keeps the cluster up after a first run that ends sooner. Ctrl-C
or SIGTERM stops every child and prints the summary of what ran so far (exit 130).
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

import aiohttp

from crossflow_ctl.client import AdminClient
from crossflow_ctl.demo.cluster import START_TIMEOUT_S, Cluster, ClusterSpec
from crossflow_ctl.demo.observe import Observations
from crossflow_ctl.demo.processes import Children, DemoError
from crossflow_ctl.demo.prometheus import INSTALL_HINT, DemoPrometheus, prometheus_binary
from crossflow_ctl.demo.router import Router
from crossflow_ctl.demo.scrape import EngineCounts, EngineTotals, GatewayFigures, fetch
from crossflow_ctl.demo.trace import Trace
from crossflow_ctl.demo.view import CLEAR, RunResult, frame, summary, summary_data
from crossflow_ctl.domain.errors import Unavailable
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.models import NodeRole, ReservationState, Share

if TYPE_CHECKING:  # the simulator is imported when it runs
    from crossflow_ctl.sim.metrics import Summary

DEFAULT_MAX_OUTPUT_TOKENS = 128
"""The default cap on a request's ``max_tokens``: the bundled trace's turns ask 40-299 output
tokens, each one an SSE event through engine, gateway and client; capped, the default run
(both replays) stays near 75 s on a shared 2-core machine instead of ~90 s, and the sessions'
closed loops are shorter. TTFT, what the runs compare, does not depend on it."""
DRAIN_S = 5.0
"""How long to wait after a run for the reservations it opened to be released."""


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
    static_run: bool = True
    """Replay the trace a second time through a gateway with no broker (static P/D)."""
    max_output_tokens: int | None = DEFAULT_MAX_OUTPUT_TOKENS
    """Cap on each request's ``max_tokens`` (None: the trace's output tokens)."""
    redis_namespace: str | None = None
    max_hold_ms: int = 300
    """Late binding: how long the gateway holds a prompt refused for lack of room (0: never)."""
    prometheus: bool = False
    """Also run a real Prometheus scraping the broker, the agents and the gateway
    (crossflow_ctl.demo.prometheus)."""
    port: int = 0
    """The broker's port on 127.0.0.1 (0: a free one)."""
    engine: str = "fake"
    """``fake``: crossflow-agent fake-engine speaking vLLM; ``vllm``: real vLLM CPU engines
    (crossflow_ctl.demo.vllm_engines)."""
    vllm_venv: Path | None = None
    itl_slo_ms: float | None = None
    """The agents' ITL SLO (None: their default, 50 ms)."""
    connect: Callable[[str], tuple[str, str]] | None = None
    """Called with the broker's address once it serves: (the crossflowctl command to try, a
    note on how it reaches the broker). The CLI writes a crossflowctl context there; without
    it the command names ``--server``."""


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
        self.cluster: Cluster | None = None
        self.interrupted = False
        self.exit_code = 0
        """128 + the signal that stopped the run (130 for Ctrl-C), else 0."""
        self.share: Share = 1.0
        self.hint = ""
        self.namespace = opts.redis_namespace or f"crossflow-demo-{uuid.uuid4().hex[:8]}"
        self.prometheus: DemoPrometheus | None = None
        self._http: aiohttp.ClientSession | None = None

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
        if self.opts.engine == "vllm":
            from crossflow_ctl.demo.vllm_engines import DEFAULT_VENV, vllm_python

            vllm_python(self.opts.vllm_venv or DEFAULT_VENV)  # says how to install it
        if self.opts.redis_url:
            await check_redis(self.opts.redis_url)
        self._handle_signals(True)
        log_dir = demo_log_dir(self.opts.log_dir)
        if self.opts.prometheus:
            self.prometheus = DemoPrometheus(log_dir)
        self.children = Children(log_dir)
        self._http = aiohttp.ClientSession()
        try:
            return await self._run()
        finally:
            await self.children.stop()
            await self._http.close()
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
        spec = ClusterSpec(
            prefill=o.prefill, decode=o.decode, model=o.model, node=o.node,
            period_ms=o.period_ms, redis_url=o.redis_url, namespace=self.namespace,
            port=o.port, max_hold_ms=o.max_hold_ms, engine=o.engine, vllm_venv=o.vllm_venv,
            itl_slo_ms=o.itl_slo_ms,
        )  # fmt: skip
        cluster = self.cluster = Cluster(spec, self.children, self.prometheus)
        broker = await cluster.start_broker()
        command, note = (
            o.connect(broker)
            if o.connect is not None
            else (f"crossflowctl --server {broker} get nodes -w", "")
        )
        self.hint = command
        linger = "" if o.duration_s is not None else "--duration-s S keeps the cluster up S s"
        extra = "; ".join(x for x in (note, linger) if x)
        self.say(f"broker on {broker}: try `{command}`" + (f" ({extra})" if extra else ""))
        if o.engine == "vllm":
            self.say("starting real vLLM engines (45-90 s on 2 cores; logs engine-*.log)")
        await cluster.start_engines()
        await self._slow_prefill()
        _, gateway = await asyncio.gather(
            cluster.start_agents(), cluster.start_gateway(broker=True)
        )
        self.say(
            f"gateway on {gateway} (asks the broker): try `curl -s {gateway}/v1/completions "
            """-d '{"prompt": "hello there", "max_tokens": 5}'` and its /metrics"""
        )
        if self.prometheus is not None:
            self.prometheus.add_gateway(gateway.removeprefix("http://"))
            url = await self.prometheus.start(self.children)
            self.say(
                f"prometheus on {url}: try {url}/graph?g0.expr="
                "max%20by%20(state)%20(crossflow_broker_decode_nodes) and its /alerts"
            )
        async with AdminClient(broker, timeout_s=2.0) as admin:
            await self._wait_ready(admin)
            self.share = (await admin.get_policy()).policy.shares
            if self.stop.is_set():
                self.say("interrupted before the cluster was ready: nothing was replayed")
                return self.exit_code
            leases = await self._measure("leases", admin, salt="a", linger=True)
            leases.reservations_left = await self._drained(admin)
            await cluster.stop_gateway()
            static: RunResult | None = None
            if o.static_run and not self.stop.is_set():
                # Same port: the URL said above (and Prometheus's target) stays right.
                await cluster.start_gateway(broker=False, port=cluster.gateway_port)
                self.say(f"static run: the same trace through {gateway} with --no-broker")
                static = await self._measure("static", admin, salt="b", linger=False)
                await cluster.stop_gateway()
        await self.children.stop()  # the simulator below should not compete with them
        if self.interrupted:
            ran = leases.elapsed_s + (static.elapsed_s if static is not None else 0.0)
            self.say(f"interrupted after {ran:.1f} s: the summary covers what ran so far")
        capped = (
            f" max_tokens capped at {o.max_output_tokens} (--max-output-tokens)."
            if o.max_output_tokens is not None
            else ""
        )
        if o.engine == "vllm":
            engines = (
                "real vLLM 0.32 CPU engines (a tiny random Llama, NixlConnector between them) "
                f"made the tokens; the agents price leases on the {o.model}/{o.node} preset, "
                f"not a model of this CPU.{capped}"
            )
        else:
            engines = (
                f"the fake engines' step model of {o.model} on {o.node} decides when each "
                f"token comes, in real time.{capped}"
            )
        self.say(summary(o.trace.name, split, leases, static, engines))
        sim = await self._simulate(split) if o.simulate and not self.interrupted else None
        if o.summary_json is not None:
            data = summary_data(leases, static) | {
                "elapsed_s": leases.elapsed_s,
                "interrupted": self.interrupted,
                "trace": o.trace.name,
                "split": split,
                "gateway_url": gateway,
                "simulator": {k: v.model_dump(mode="json") for k, v in (sim or {}).items()},
            }
            o.summary_json.write_text(json.dumps(data, indent=2))
        return self.exit_code

    async def _slow_prefill(self) -> None:
        assert self.cluster is not None and self._http is not None
        if self.opts.prefill_slowdown == 1.0:
            return
        for e in self.cluster.prefill:
            async with self._http.post(
                f"{e.url}/control", json={"slowdown": self.opts.prefill_slowdown}
            ) as resp:
                resp.raise_for_status()

    async def _simulate(self, split: str) -> dict[str, Summary] | None:
        """The simulator's static and leases runs of the trace, printed; None when Ctrl-C
        stopped it. It computes without awaiting, so the signal handlers that only set the
        stop event would wait for it to finish: Ctrl-C raises KeyboardInterrupt meanwhile."""
        from crossflow_ctl.demo.simcompare import sim_lines, simulate_both

        o = self.opts
        self._handle_signals(False)
        try:
            sim = await simulate_both(
                o.trace, o.prefill, o.decode, o.model, o.node, o.speed, o.max_output_tokens
            )
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

    async def _wait_ready(self, admin: AdminClient) -> None:
        """Until every decode node has a lease and every prefill server reports load."""
        assert self.children is not None
        prefill, decode = self.opts.prefill, self.opts.decode
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

    # -- one replay ----------------------------------------------------------------------

    async def _measure(
        self, label: str, admin: AdminClient, *, salt: str, linger: bool
    ) -> RunResult:
        """Replay the trace through the gateway now serving; what it measured."""
        assert self.cluster is not None
        o = self.opts
        router = Router(
            o.trace,
            self.cluster.gateway_url,
            salt=salt,
            speed=o.speed,
            max_output_tokens=o.max_output_tokens,
        )
        result = RunResult(label, stats=router.stats, obs=Observations())
        before = await self._engine_counts()
        started = time.monotonic()
        try:
            await self._replay(router, admin, started, result, linger)
        finally:
            result.elapsed_s = time.monotonic() - started
            with contextlib.suppress(Exception):  # a summary, even of a broken run
                result.gateway = await self._gateway_counted(result.stats.finished)
                after = await self._engine_counts()
                slo = result.obs.itl_slo_ms() or LeaseSettings().itl_slo_ms
                decode = [e.node_id for e in self.cluster.decode]
                result.engines = EngineTotals.of(after, before, decode, slo)
        return result

    async def _engine_counts(self) -> dict[str, EngineCounts]:
        assert self.cluster is not None and self._http is not None
        out = {}
        for e in self.cluster.engines:
            out[e.node_id] = EngineCounts.read(await fetch(self._http, f"{e.url}/metrics"))
        return out

    async def _gateway_figures(self) -> GatewayFigures:
        assert self.cluster is not None and self._http is not None
        return GatewayFigures.read(await fetch(self._http, f"{self.cluster.gateway_url}/metrics"))

    async def _gateway_counted(self, finished: int) -> GatewayFigures:
        """The gateway's figures once they count the ``finished`` requests (it counts one as
        its handler returns, a moment after the client read the last byte), or after 2 s."""
        deadline = time.monotonic() + 2.0
        while True:
            figures = await self._gateway_figures()
            counted = sum(v for k, v in figures.requests.items() if k != "error")
            if counted >= finished or time.monotonic() > deadline:
                return figures
            await asyncio.sleep(0.1)

    async def _drained(self, admin: AdminClient) -> int | None:
        """Reservations still open (held or committed) at the broker once the run's releases
        had time to land (up to DRAIN_S); None when the broker could not be asked. A released
        one is listed until a later lease of its node arrives: it is not open."""
        deadline = time.monotonic() + DRAIN_S
        while True:
            try:
                listed = await admin.list_reservations()
                left = sum(r.state is not ReservationState.RELEASED for r in listed)
            except Exception:
                return None
            if left == 0 or time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.2)

    async def _replay(
        self,
        router: Router,
        admin: AdminClient,
        started: float,
        result: RunResult,
        linger: bool,
    ) -> None:
        """Replay the trace with the live view; with ``duration_s``, stop there, or (``linger``)
        keep the cluster up (agents leasing, view refreshing) after a trace that ends sooner."""
        o = self.opts
        halt = asyncio.Event()
        replay = asyncio.create_task(router.run(halt))
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
                    break
                if self.stop.is_set() or (replay.done() and not self._linger(replay, linger)):
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
                    halt.set()
                    await replay
                    raise DemoError(f"{dead[0].name} exited during the run: {dead[0].log_tail()}")
                await self._tick(router, admin, result, elapsed, frames)
                frames += 1
        finally:
            halt.set()
            stopping.cancel()
            await replay

    def _linger(self, replay: asyncio.Task[None], linger: bool) -> bool:
        """Whether to keep the cluster up after the replay ended: only for a run that may
        (``linger``), when ``duration_s`` asks for it, and the replay ended without an error."""
        return linger and self.opts.duration_s is not None and replay.exception() is None

    async def _tick(
        self, router: Router, admin: AdminClient, result: RunResult, elapsed: float, frames: int
    ) -> None:
        obs = result.obs
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
        obs.check_grants(reservations, history, self.share)
        for node_id in decode:
            obs.record(node_id, history[node_id])
        at_ms = int(time.time() * 1000)
        obs.observe(nodes, at_ms)
        if self.opts.quiet:
            return
        figures = None
        with contextlib.suppress(Exception):
            figures = await self._gateway_figures()
        assert self.cluster is not None
        title = (
            "crossflow demo, leases run"
            if result.label == "leases"
            else "crossflow demo, static run (gateway --no-broker)"
        )
        text = frame(
            title,
            elapsed,
            router.stats,
            nodes,
            pools,
            obs,
            self.opts.trace.requests,
            at_ms,
            hint=self.hint,
            gateway=self.cluster.gateway_url,
            figures=figures,
        )
        if self.opts.live:
            self.out.write(CLEAR + text + "\n")
            self.out.flush()
        elif frames % 3 == 0:
            self.say(text + "\n")
