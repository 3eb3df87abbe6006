"""The agent loop and its stream against real brokers (gRPC on loopback) over real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from crossflow_agent import agent as agent_module
from crossflow_agent.agent import Agent
from crossflow_agent.settings import AgentSettings
from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_ctl.api.v1 import common_pb2, lease_pb2, lease_pb2_grpc
from crossflow_ctl.broker.server import BrokerServer, make_store
from crossflow_ctl.client.admin import AdminClient
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.errors import NotFound
from crossflow_ctl.domain.lease_credits import CapacityBreakdown
from crossflow_ctl.domain.leasing import LeaseDecision, decide
from crossflow_ctl.domain.models import Lease, ZeroReason
from crossflow_ctl.domain.telemetry import EngineSnapshot
from crossflow_ctl.service.config import BrokerSettings
from tests.agent.conftest import MetricsServer, fixture_text
from tests.conftest import eventually

pytestmark = pytest.mark.redis

MODEL, NODE = MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"]


class Brokers:
    def __init__(self, redis_url: str, namespace: str) -> None:
        self.redis_url, self.namespace = redis_url, namespace
        self.servers: list[BrokerServer] = []

    async def start(self, port: int = 0) -> str:
        settings = BrokerSettings(
            listen=f"127.0.0.1:{port}",
            redis_url=self.redis_url,
            redis_namespace=self.namespace,
            notice_block_ms=100,
            stream_grace_s=0.5,
        )
        server = BrokerServer(settings, make_store(settings))
        port = await server.start()
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    async def stop(self, server: BrokerServer) -> None:
        if server in self.servers:
            self.servers.remove(server)
            await server.stop(grace_s=0.5)


@pytest.fixture
async def brokers(redis_url: str, redis_namespace: str) -> AsyncIterator[Brokers]:
    b = Brokers(redis_url, redis_namespace)
    try:
        yield b
    finally:
        for server in list(b.servers):
            await b.stop(server)


class Running:
    def __init__(self, agent: Agent, task: asyncio.Task[None], stop: asyncio.Event) -> None:
        self.agent, self.task, self.stop_event = agent, task, stop

    async def stop(self) -> None:
        self.stop_event.set()
        await self.task


@contextlib.asynccontextmanager
async def running_agent(
    metrics_server: MetricsServer, targets: list[str], **kw: Any
) -> AsyncIterator[Running]:
    settings = AgentSettings(
        node_id=kw.pop("node_id", "n1"),
        brokers=targets,
        metrics_url=metrics_server.url,
        period_ms=50,
        backoff_initial_ms=20,
        backoff_max_ms=100,
        shutdown_grace_ms=1000,
    )
    source = PrometheusSource(settings.metrics_url, SGLangReader())
    agent = Agent(settings, source, MODEL, NODE, **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    run = Running(agent, task, stop)
    try:
        yield run
    finally:
        if not task.done():
            await run.stop()
        await source.aclose()


async def stored(admin: AdminClient, node_id: str = "n1") -> Lease | None:
    try:
        view = await admin.get_node(node_id)
    except NotFound:  # the agent has not said hello yet
        return None
    return None if view.node.state.lease is None else view.node.state.lease.lease


async def test_leases_reach_the_broker_and_cordon_zeroes_them(brokers, metrics_server) -> None:
    metrics_server.text = fixture_text("sglang_t0.prom")
    target = await brokers.start()
    async with AdminClient(target) as admin, running_agent(metrics_server, [target]) as run:

        async def live_credit() -> Lease | None:
            with contextlib.suppress(Exception):
                lease = await stored(admin)
                if lease is not None and not lease.credits.is_zero():
                    return lease
            return None

        first = await eventually(live_credit, "a lease with credit")
        assert first.epoch == run.agent.epoch and first.zero_reason is None
        assert first.itl_slo_ms == 50.0 and first.ttl_ms == 300

        await admin.cordon("n1", reason="test")

        async def cordoned_lease() -> Lease | None:
            # the first CORDONED lease may still carry seq 0: the notice can land during the
            # scrape, after the seq was read; later ones carry the cordon notice's seq
            lease = await stored(admin)
            ok = lease and lease.zero_reason is ZeroReason.CORDONED and lease.last_notice_seq
            return lease if ok else None

        zero = await eventually(cordoned_lease, "a CORDONED zero lease after the notice")
        assert zero.credits.is_zero() and zero.version > first.version
        assert run.agent.stream.state.cordoned

        await admin.uncordon("n1")
        again = await eventually(live_credit, "credit after uncordon")
        assert again.version > zero.version

        async def seen_uncordon() -> Lease | None:
            lease = await live_credit()
            return lease if lease and lease.last_notice_seq > zero.last_notice_seq else None

        await eventually(seen_uncordon, "a lease stamped with the uncordon notice")

        await run.stop()
        final = await stored(admin)
        assert final is not None and final.zero_reason is ZeroReason.SHUTTING_DOWN


async def test_scrape_failure_gives_a_zero_lease_at_the_next_period(
    brokers, metrics_server
) -> None:
    metrics_server.text = fixture_text("sglang_t0.prom")
    target = await brokers.start()
    async with AdminClient(target) as admin, running_agent(metrics_server, [target]) as run:
        await eventually(lambda: _has_credit(admin), "a lease with credit")
        sent: list[common_pb2.Lease] = []
        send = run.agent.stream.send

        def recorded(request: lease_pb2.ConnectRequest) -> bool:
            if request.WhichOneof("body") == "lease":
                sent.append(request.lease)
            return send(request)

        run.agent.stream.send = recorded  # type: ignore[method-assign]
        await metrics_server.close()  # the engine's metrics server goes away
        before = run.agent.version

        async def zero() -> Lease | None:
            lease = await stored(admin)
            if lease and lease.zero_reason is ZeroReason.TELEMETRY_MISSING:
                return lease
            return None

        lease = await eventually(zero, "a TELEMETRY_MISSING lease")
        # The first lease computed after the failure is zero, whatever the clock says: one
        # scrape may have been in flight at the close, none after it carries credit. (The
        # stored lease may be a later one on a loaded machine, so the agent's sends are read.)
        zeroed = [m.version for m in sent if m.zero_reason != common_pb2.ZERO_REASON_UNSPECIFIED]
        assert zeroed and min(zeroed) <= before + 2, (before, zeroed)
        assert all(m.version in zeroed for m in sent if m.version >= before + 2)
        # refused, or accepted by the closing socket and never answered
        assert lease.zero_detail.startswith(("unreachable", "timeout"))


async def test_the_agent_logs_when_its_lease_turns_zero_and_lends_again(
    brokers, metrics_server
) -> None:
    """At info an agent said nothing between agent.started and agent.stopped, however long its
    node lent nothing (the zero reason was a debug line per period)."""
    metrics_server.text = fixture_text("sglang_t0.prom")
    target = await brokers.start()
    with capture_logs() as logs:
        async with AdminClient(target) as admin, running_agent(metrics_server, [target]) as run:
            await eventually(lambda: _has_credit(admin), "a lease with credit")
            run.agent.stream.state.cordoned = True  # as a cordon notice sets it
            # a period must pass cordoned (a fixed 0.3 s was none on a loaded machine)
            await eventually(
                lambda: any(e["event"] == "lease.zeroed" and "node_id" not in e for e in logs),
                "the agent saying its lease turned zero",
            )
            run.agent.stream.state.cordoned = False
            await eventually(lambda: _has_credit(admin), "credit again")
    said = [
        (e["event"], e.get("reason") or e.get("was"))
        for e in logs
        if e["event"] in ("lease.lending", "lease.zeroed")
        and "node_id" not in e  # not the broker's
    ]
    assert said[:3] == [
        ("lease.lending", None),
        ("lease.zeroed", "cordoned"),
        ("lease.lending", "cordoned"),
    ], said
    assert all(e["log_level"] == "info" for e in logs if e["event"] != "lease.zero")


async def test_an_agent_with_no_broker_does_not_say_it_lends(brokers, metrics_server) -> None:
    """An agent whose broker was not there logged lease.lending: its leases went nowhere, and
    its node lent nothing. It says lease.unsent (once), and lease.lending once a broker has
    accepted a lease that lends."""
    metrics_server.text = fixture_text("sglang_t0.prom")
    with socket.socket() as s:  # a port nothing listens on, yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with capture_logs() as logs:
        async with running_agent(metrics_server, [f"127.0.0.1:{port}"]) as run:
            state = run.agent.stream.state

            async def several() -> bool:
                return state.attempts >= 3

            await eventually(several, "several failed sessions")
            said = [e["event"] for e in logs if e["event"].startswith("lease.")]
            assert said == ["lease.unsent"], said
            target = await brokers.start(port)
            async with AdminClient(target) as admin:
                await eventually(lambda: _has_credit(admin), "a lease with credit")
                await eventually(
                    lambda: _said(logs, "lease.lending"), "lease.lending once accepted"
                )
    unsent = next(e for e in logs if e["event"] == "lease.unsent")
    assert unsent["would_be"] == "lending" and "no broker connection" in unsent["effect"]
    lending = [e for e in logs if e["event"] == "lease.lending" and "node_id" not in e]
    assert [e["was"] for e in lending] == ["unsent"], lending


async def _said(logs: list[dict[str, Any]], event: str) -> bool:
    return any(e["event"] == event and "node_id" not in e for e in logs)


async def _has_credit(admin: AdminClient) -> bool:
    with contextlib.suppress(Exception):
        lease = await stored(admin)
        return lease is not None and not lease.credits.is_zero()
    return False


async def test_reconnects_to_the_next_broker_and_the_lease_stays_current(
    brokers, metrics_server
) -> None:
    metrics_server.text = fixture_text("sglang_t0.prom")
    first, second = await brokers.start(), await brokers.start()
    async with AdminClient(second) as admin, running_agent(metrics_server, [first, second]) as run:
        await eventually(lambda: _has_credit(admin), "a lease via the first broker")
        assert run.agent.stream.state.endpoint == first
        await brokers.stop(brokers.servers[0])

        async def moved() -> bool:
            return run.agent.stream.state.connected and run.agent.stream.state.endpoint == second

        await eventually(moved, "a session on the second broker")
        version = run.agent.version

        async def newer() -> bool:
            lease = await stored(admin)
            return bool(lease and lease.version > version and not lease.credits.is_zero())

        await eventually(newer, "a newer lease through the second broker")
        assert run.agent.stream.state.sessions == 2


async def test_a_stale_epoch_or_version_is_moved_past(brokers, metrics_server) -> None:
    metrics_server.text = fixture_text("sglang_t0.prom")
    target = await brokers.start()
    async with AdminClient(target) as admin:
        async with running_agent(metrics_server, [target]) as run:
            await eventually(lambda: _has_credit(admin), "a lease")
            epoch = run.agent.epoch
        old = await stored(admin)
        assert old is not None and old.epoch == epoch
        # a process whose clock went back starts with an older epoch: refused as stale,
        # then it moves past the stored epoch rather than stay refused forever
        async with running_agent(metrics_server, [target], epoch=epoch - 10_000) as run:

            async def recovered() -> Lease | None:
                lease = await stored(admin)
                ok = lease and lease.epoch == epoch + 1 and not lease.credits.is_zero()
                return lease if ok else None

            await eventually(recovered, "a lease in epoch + 1")
            assert run.agent.stream.state.refused >= 1
        # the same epoch again (two starts in one millisecond): versions move past the stored one
        held = await stored(admin)
        assert held is not None
        async with running_agent(metrics_server, [target], epoch=held.epoch) as run:

            async def past() -> Lease | None:
                lease = await stored(admin)
                if lease is None or lease.credits.is_zero():
                    return None
                return lease if (lease.epoch, lease.version) > (held.epoch, held.version) else None

            await eventually(past, "a newer version in the same epoch")
            assert run.agent.stream.state.refused >= 1


class SeqBumpingSource:
    """A source during whose scrape a notice arrives (the stream state moves on)."""

    name = "test"

    def __init__(self, agent_ref: list[Agent], snapshot: EngineSnapshot) -> None:
        self.agent_ref, self.snapshot = agent_ref, snapshot

    async def scrape(self) -> EngineSnapshot:
        self.agent_ref[0].stream.state.last_notice_seq += 5
        return self.snapshot.model_copy(update={"taken_at_ms": self.agent_ref[0].clock.now_ms()})

    async def aclose(self) -> None:
        return None


async def test_a_lease_carries_the_notice_seq_seen_before_its_snapshot() -> None:
    settings = AgentSettings(node_id="n1", brokers=["127.0.0.1:1"])
    snapshot = EngineSnapshot(
        taken_at_ms=0,
        running_requests=4,
        kv_used_tokens=1000,
        kv_total_tokens=100_000,
        decode_context_tokens=1000,
    )
    ref: list[Agent] = []
    agent = Agent(settings, SeqBumpingSource(ref, snapshot), MODEL, NODE)
    ref.append(agent)
    agent.stream.state.last_notice_seq = 7
    lease = await agent.tick()
    assert lease is not None and lease.zero_reason is None
    assert lease.last_notice_seq == 7  # not 12: notice 8..12 may postdate the snapshot
    assert agent.stream.state.last_notice_seq == 12
    second = await agent.tick()
    assert second is not None and second.last_notice_seq == 12 and second.version == 2


async def test_each_period_seeds_its_searches_with_the_last_capacity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent hands each decision the last one's capacity (``previous``), as the simulator
    does: the searches start from last period's answers (review rT: the real agent searched
    from scratch every period)."""
    seeds: list[CapacityBreakdown | None] = []

    def recording(*args: Any, **kwargs: Any) -> LeaseDecision:
        seeds.append(kwargs.get("previous"))
        return decide(*args, **kwargs)

    monkeypatch.setattr(agent_module, "decide", recording)
    settings = AgentSettings(node_id="n1", brokers=["127.0.0.1:1"])
    snapshot = EngineSnapshot(taken_at_ms=0, running_requests=4, kv_used_tokens=1000,
                              kv_total_tokens=100_000, decode_context_tokens=1000)  # fmt: skip
    ref: list[Agent] = []
    agent = Agent(settings, SeqBumpingSource(ref, snapshot), MODEL, NODE)
    ref.append(agent)
    first, second = await agent.tick(), await agent.tick()
    assert first is not None and second is not None and second.credits == first.credits
    assert seeds[0] is None and seeds[1] is not None
    assert seeds[1].chunk_tokens > 0  # the first decision's capacity, now the seed


async def test_the_lease_is_sized_over_the_brokers_borrow_horizon() -> None:
    """The broker prices output debits over its own horizon and sizes the commit TTL for it, so
    the lease's compute and output credits follow the horizon its Welcome sends, not a local
    setting that may differ (the local one stands only until a broker sends one)."""
    settings = AgentSettings(node_id="n1", brokers=["127.0.0.1:1"])
    snapshot = EngineSnapshot(taken_at_ms=0, running_requests=4, kv_used_tokens=1000,
                              kv_total_tokens=1_000_000, decode_context_tokens=1000)  # fmt: skip
    ref: list[Agent] = []
    agent = Agent(settings, SeqBumpingSource(ref, snapshot), MODEL, NODE)
    ref.append(agent)
    local = await agent.tick()
    welcome = lease_pb2.Welcome(
        broker_id="b", borrow_horizon_ms=4 * settings.lease.horizon_ms, kv_bytes_per_token=512
    )
    agent.stream._welcome(welcome, "127.0.0.1:1")
    assert agent.stream.state.borrow_horizon_ms == 4 * settings.lease.horizon_ms
    # grants' transfer bytes are read in the broker's unit (see test_lending)
    assert agent.stream.state.open_debits.kv_bytes_per_token == 512
    assert agent.stream.state.open_debits.totals().kv_bytes_per_token == 512
    brokers = await agent.tick()
    assert local is not None and brokers is not None
    assert brokers.credits.compute_tokens >= 4 * local.credits.compute_tokens - 4
    assert brokers.credits.output_tokens >= 4 * local.credits.output_tokens - 4


class NoticeDuringScrapeSource:
    """A borrowed prompt shows in telemetry; a release notice lands while the scrape runs."""

    name = "test"

    def __init__(self, agent_ref: list[Agent], snapshot: EngineSnapshot) -> None:
        self.agent_ref, self.snapshot = agent_ref, snapshot
        self.late: list[lease_pb2.Notice] = []

    async def scrape(self) -> EngineSnapshot:
        for notice in self.late:
            self.agent_ref[0].stream._notice(notice)
        self.late = []
        return self.snapshot.model_copy(update={"taken_at_ms": self.agent_ref[0].clock.now_ms()})

    async def aclose(self) -> None:
        return None


def _notice(
    seq: int, kind: int, rid: str, compute: int = 0, kv: int = 0, output: int = 0
) -> lease_pb2.Notice:
    debit = common_pb2.Credits(compute_tokens=compute, kv_tokens=kv, output_tokens=output)
    return lease_pb2.Notice(seq=seq, kind=kind, reservation_id=rid, debit=debit)  # type: ignore[arg-type]


async def test_borrowed_work_the_broker_debits_is_not_subtracted_again_by_the_lease() -> None:
    """Grant notices tell the agent which borrowed work the broker counts; its lease adds that
    work back (counted once, by the broker's debit). A release that lands during the scrape is
    not applied to that lease: it is stamped with the sequence read before the snapshot."""
    settings = AgentSettings(node_id="n1", brokers=["127.0.0.1:1"])
    base = EngineSnapshot(taken_at_ms=0, running_requests=4, kv_used_tokens=1000,
                          kv_total_tokens=100_000, decode_context_tokens=1000)  # fmt: skip
    busy = base.model_copy(update={"outstanding_uncached_tokens": 3000})
    ref: list[Agent] = []
    idle_agent = Agent(settings, NoticeDuringScrapeSource(ref, base), MODEL, NODE)
    ref.append(idle_agent)
    idle = await idle_agent.tick()

    ref.clear()
    source = NoticeDuringScrapeSource(ref, busy)
    agent = Agent(settings, source, MODEL, NODE)
    ref.append(agent)
    alone = await agent.tick()  # no notices yet: the queued work is the lease's to subtract
    # a grant of 3,000 uncached tokens (its kv debit adds its 1,000 output tokens)
    grant = _notice(1, lease_pb2.NOTICE_KIND_GRANT, "r1", compute=3000, kv=4000, output=1000)
    agent.stream._notice(grant)
    agent.stream._notice(_notice(2, lease_pb2.NOTICE_KIND_COMMIT, "r1"))
    source.late = [_notice(3, lease_pb2.NOTICE_KIND_RELEASE, "r1")]
    covered = await agent.tick()
    assert idle is not None and alone is not None and covered is not None
    # (costed on the safe side: its prefixes are unknown to the agent)
    assert alone.credits.compute_tokens < idle.credits.compute_tokens - 3000
    assert covered.credits.compute_tokens == idle.credits.compute_tokens
    assert covered.last_notice_seq == 2 and agent.stream.state.open_debits.kv == 0
    again = await agent.tick()  # the release is seen now: the work is the lease's again
    assert again is not None and again.last_notice_seq == 3
    assert again.credits.compute_tokens == alone.credits.compute_tokens


async def test_a_prefill_agent_reports_pool_load(brokers, metrics_server) -> None:
    metrics_server.text = fixture_text("sglang_t0.prom")
    target = await brokers.start()
    settings = AgentSettings(
        node_id="p1",
        role="prefill",
        pool="pool-a",
        brokers=[target],
        metrics_url=metrics_server.url,
        period_ms=50,
    )
    source = PrometheusSource(settings.metrics_url, SGLangReader())
    agent = Agent(settings, source, MODEL, NODE)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        async with AdminClient(target) as admin:

            async def reported() -> Any:
                pools = await admin.list_pools()
                return [r for p in pools if p.pool == "pool-a" for r in p.reports]

            [report] = await eventually(reported, "a pool load report")
            assert report.node_id == "p1" and report.queued_requests == 3 + 1 + 1
            assert report.ttl_ms == 300
            view = await admin.get_node("p1")
            assert view.node.state.lease is None  # prefill agents send no leases
    finally:
        stop.set()
        await task
        await source.aclose()


AGENT_TASK_NAMES = {
    "lease-stream",
    "stream-write",
    "stream-read",
    "stream-watchdog",
    "stream-closing",
}


def agent_tasks() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if not t.done()} & AGENT_TASK_NAMES


async def test_itl_over_slo_zeroes_the_lease_and_recovers_with_hysteresis(brokers) -> None:
    from crossflow_agent.sources.synthetic import (
        EngineRequest,
        EngineScript,
        SyntheticEngine,
        SyntheticSource,
    )

    target = await brokers.start()
    engine = SyntheticEngine(MODEL, NODE, EngineScript(kv_total_tokens=2_000_000))
    for _ in range(8):
        engine.submit(EngineRequest(prompt_tokens=500, output_tokens=200_000))
    settings = AgentSettings(node_id="n1", brokers=[target], period_ms=50)
    agent = Agent(settings, SyntheticSource(engine), MODEL, NODE)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        async with AdminClient(target) as admin:

            async def reason_is(reason: ZeroReason | None) -> Lease | None:
                lease = await stored(admin)
                if lease is None or lease.zero_reason is not reason:
                    return None
                return lease if reason is not None or not lease.credits.is_zero() else None

            await eventually(lambda: reason_is(None), "credit at normal speed")
            engine.advance()
            engine.slowdown = 20.0  # ~100 ms steps against a 50 ms SLO

            async def over_slo() -> Lease | None:
                # a window may hold no sample (a step longer than the period): itl_ms 0 then
                lease = await reason_is(ZeroReason.ITL_OVER_SLO)
                return lease if lease and lease.itl_ms >= 50.0 else None

            over = await eventually(over_slo, "an ITL_OVER_SLO zero lease")
            assert "slo 50" in over.zero_detail
            engine.advance()
            engine.slowdown = 1.0
            back = await eventually(lambda: reason_is(None), "credit after recovery")
            assert back.version >= over.version + settings.lease.itl_clear_after
            assert back.itl_ms < 50.0 * settings.lease.itl_clear_ratio
    finally:
        stop.set()
        await task
    assert agent_tasks() == set()  # the loop leaves no task behind


class WelcomeThenFail(lease_pb2_grpc.LeaseServiceServicer):
    """A broker whose store is broken: it welcomes, then ends the stream on the first lease."""

    def __init__(self) -> None:
        self.hellos: list[int] = []

    async def Connect(self, request_iterator, context):
        first = await anext(aiter(request_iterator))
        self.hellos.append(first.hello.last_notice_seq)
        yield lease_pb2.ConnectResponse(welcome=lease_pb2.Welcome(broker_id="broken"))
        yield lease_pb2.ConnectResponse(
            notice=lease_pb2.Notice(seq=len(self.hellos) + 40, kind=lease_pb2.NOTICE_KIND_GRANT)
        )
        await anext(aiter(request_iterator))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "store unavailable")


async def test_failing_sessions_keep_backing_off_and_resume_notices(metrics_server) -> None:
    metrics_server.text = fixture_text("sglang_t0.prom")
    servicer = WelcomeThenFail()
    server = grpc.aio.server()
    lease_pb2_grpc.add_LeaseServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with running_agent(metrics_server, [f"127.0.0.1:{port}"]) as run:
            state = run.agent.stream.state

            async def several() -> bool:
                return state.attempts >= 4

            await eventually(several, "several failed sessions")
            # welcomed but never accepted: the backoff grew instead of resetting each time
            assert state.last_delay_s >= 0.5 * 100 / 1000  # reached the 100 ms cap (x jitter)
            assert state.acked == 0 and state.sessions >= 4
            # each Hello resumed after the highest notice seen so far
            assert servicer.hellos[0] == 0
            assert all(b > a for a, b in pairwise(servicer.hellos[1:]))
            assert servicer.hellos[1] >= 41
    finally:
        await server.stop(None)


async def test_a_broker_that_is_not_there_is_a_warning_not_an_info_line_per_retry(
    metrics_server,
) -> None:
    """It was an info line per retry: at the warning level an agent whose --broker is wrong or
    down said nothing at all, while its node lent nothing. A single failure stays info: the
    demo's agents warned at every shutdown, when the broker ended their streams."""
    metrics_server.text = fixture_text("sglang_t0.prom")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with capture_logs() as logs:
        async with running_agent(metrics_server, [f"127.0.0.1:{port}"]) as run:
            state = run.agent.stream.state

            async def several() -> bool:
                return state.attempts >= 3

            await eventually(several, "several failed sessions")
    failed = [e for e in logs if e["event"] == "stream.session_failed"]
    assert len(failed) >= 3
    # one failure is a routine reconnect; the failed retry is the outage, said once
    first, second, *rest = failed
    assert (first["log_level"], first["failures"]) == ("info", 1)
    assert second["log_level"] == "warning", second
    assert second["endpoint"] == f"127.0.0.1:{port}" and "lends nothing" in second["effect"]
    assert second["failures"] == 2 and second["retry_in_s"] > 0
    assert [e["log_level"] for e in rest] == ["info"] * len(rest)


async def test_a_grant_is_read_in_the_unit_it_carries_not_the_one_the_agent_holds() -> None:
    """A GRANT that carries its pulled prefix tokens (priced by a replica on another policy
    than the one the agent was last told) is counted as it says; one without (an older broker)
    is read in the agent's unit (see test_lending)."""
    settings = AgentSettings(node_id="n1", brokers=["127.0.0.1:1"])
    agent = Agent(settings, SeqBumpingSource([], EngineSnapshot(taken_at_ms=0)), MODEL, NODE)
    agent.stream._welcome(lease_pb2.Welcome(broker_id="b", kv_bytes_per_token=512), "b:1")
    # 1,000 uncached + 4,000 pulled + 100 output, the prefix priced at 256 bytes per token
    debit = common_pb2.Credits(kv_tokens=5_100, kv_transfer_bytes=4_000 * 256, output_tokens=100)
    grant = lease_pb2.Notice(seq=1, kind=lease_pb2.NOTICE_KIND_GRANT, reservation_id="r1",
                             debit=debit, pulled_tokens=4_000)  # fmt: skip
    agent.stream._notice(grant)
    ledger = agent.stream.state.open_debits
    assert ledger.uncached_tokens(MODEL.kv_bytes_per_token) == 1_000
    old = lease_pb2.Notice(seq=2, kind=lease_pb2.NOTICE_KIND_GRANT, reservation_id="r2",
                           debit=debit)  # fmt: skip
    agent.stream._notice(old)
    assert ledger.uncached_tokens(MODEL.kv_bytes_per_token) == 1_000 + 3_000  # 4,000 x 256 / 512
