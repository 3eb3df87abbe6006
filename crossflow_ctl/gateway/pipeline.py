"""One request through the gateway: count, ask, dispatch, relay, release.

1. Count the prompt's tokens with the model's tokenizer (an engine's ``/tokenize``) and estimate
   its cached prefix per engine from what this gateway routed there (:mod:`.prefix`).
2. Ask Admit through the late-binding :class:`~crossflow_ctl.client.AdmissionQueue` (a prompt
   the broker would borrow if a node had room may be held up to ``max_hold_ms`` while the
   prefill pool is behind). The client fails closed: a slow or absent broker answers NORMAL.
3. BORROW: Commit, send the request straight to the granted decode engine (it prefills the
   prompt itself), relay its answer, Release at its first byte (``finished``), on an engine
   failure (``failed``) or when the client goes away (``cancelled``). An engine that fails
   before answering sends the request on the normal path instead.
4. NORMAL: the engines' own P/D protocol (:mod:`.protocols`) on the prefill engine with the
   least work in flight and the decode engine with the longest cached prefix; an engine that
   fails before answering is taken out and the request goes to another. When no prefill engine
   answers at all and decode engines can prefill (vLLM), a decode engine prefills it
   (``fallback``): slower for it, but the request is served.

No request is lost to the control plane: without a broker every request takes step 4. A relayed
answer says how it went in two headers: ``X-Crossflow-Path`` (``borrowed``, ``normal`` or
``fallback``, as ``crossflow_gateway_requests_total{path}`` counts it) and ``X-Crossflow-Node``
(the decode engine that answered).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import structlog
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from crossflow_ctl.client import AdmissionQueue, Dispatch, Outcome, Ticket
from crossflow_ctl.domain.admission import AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.errors import CrossflowError
from crossflow_ctl.domain.models import MAX_TOKENS
from crossflow_ctl.gateway.engines import Engine, EnginePool, candidates
from crossflow_ctl.gateway.metrics import GatewayMetrics
from crossflow_ctl.gateway.prefix import PrefixIndex, block_hashes
from crossflow_ctl.gateway.protocols import ClientError, PDProtocol
from crossflow_ctl.gateway.reservations import Reservations
from crossflow_ctl.gateway.settings import GatewaySettings
from crossflow_ctl.gateway.tokens import tokenize, tokenize_body
from crossflow_ctl.gateway.upstream import EngineFailed, open_call, relay

log = structlog.get_logger()
TRACER_NAME = "crossflow.gateway"
_propagator = TraceContextTextMapPropagator()

Route = Literal["completions", "chat"]
PATHS: dict[Route, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
UNREACHABLE = frozenset({Reason.BROKER_UNAVAILABLE, Reason.TIMEOUT, Reason.STORE_UNAVAILABLE})
PATH_HEADER = "X-Crossflow-Path"
NODE_HEADER = "X-Crossflow-Node"


def openai_error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    return web.json_response(
        {"error": {"message": message, "type": kind.get(status, "APIError"), "param": param,
                   "code": status}},
        status=status,
    )  # fmt: skip


@dataclass
class Job:
    """What the gateway knows of one request."""

    route: Route
    body: dict[str, Any]
    request_id: str
    arrived: float
    tokens: list[int] | None = None
    hashes: list[int] = field(default_factory=list)
    cached: dict[str, int] = field(default_factory=dict)
    held_s: float = 0.0
    path_taken: str = "normal"
    status: int | None = None
    """The HTTP status sent to the client, once the answer's headers went out."""

    @property
    def uncached_tokens(self) -> int:
        best = max(self.cached.values(), default=0)
        return max(0, len(self.tokens or ()) - best)


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        session: aiohttp.ClientSession,
        pool: EnginePool,
        protocol: PDProtocol,
        metrics: GatewayMetrics,
        queue: AdmissionQueue | None,
        reservations: Reservations | None,
        model: str,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        self.settings = settings
        self.session = session
        self.pool = pool
        self.protocol = protocol
        self.metrics = metrics
        self.queue = queue
        self.reservations = reservations
        self.model = model
        self.prefix = PrefixIndex(settings.prefix_block_tokens, settings.prefix_blocks_per_node)
        self._tasks: set[asyncio.Future[None]] = set()

    async def aclose(self) -> None:
        """Wait for the clean-ups of requests whose clients left (they release grants)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- the request ---------------------------------------------------------------------

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        arrived = time.perf_counter()
        try:
            body = await request.json()
        except ValueError as exc:
            return self._done("error", openai_error(400, f"body: not JSON ({exc})", "body"))
        if not isinstance(body, dict):
            return self._done("error", openai_error(400, "body: must be a JSON object", "body"))
        model = body.setdefault("model", self.model)
        if model != self.model:
            return self._done(
                "error", openai_error(404, f"model: {model!r} is not served here", "model")
            )
        job = Job(route, body, uuid.uuid4().hex, arrived)
        ctx = _propagator.extract(dict(request.headers))
        with self.tracer.start_as_current_span(
            "gateway.request", context=ctx, kind=SpanKind.SERVER
        ) as span:
            span.set_attribute("crossflow.request_id", job.request_id)
            try:
                response = await self._serve(request, job)
            except asyncio.CancelledError:
                # The client hung up (aiohttp cancels the handler), perhaps right after the
                # last byte it wanted: count the request with the status it was sent (499,
                # nginx's "client closed request", when nothing was) before unwinding.
                self.metrics.requests.labels(job.path_taken, str(job.status or 499)).inc()
                raise
            span.set_attribute("crossflow.path", job.path_taken)
            span.set_attribute("http.status_code", response.status)
        return self._done(job.path_taken, response)

    def _done(self, path: str, response: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(path, str(response.status)).inc()
        return response

    async def _serve(self, request: web.Request, job: Job) -> web.StreamResponse:
        await self._count(job)
        outcome = await self._admit(job)
        if outcome is not None and outcome.admission.decision is Decision.BORROW:
            response = await self._borrow(request, job, outcome)
            if response is not None:
                return response
        return await self._normal(request, job)

    # -- counting and asking -------------------------------------------------------------

    async def _count(self, job: Job) -> None:
        body = tokenize_body(job.route, job.body, self.model)
        engine = self.pool.pick_prefill() or self.pool.pick_decode({})
        if body is None or engine is None:
            return
        with self.tracer.start_as_current_span("gateway.tokenize"):
            job.tokens = await tokenize(
                self.session, engine, body, timeout_s=self.settings.connect_timeout_s
            )
        if job.tokens is not None:
            job.hashes = block_hashes(job.tokens, self.prefix.block_tokens)
            ids = [e.node_id for e in self.pool.all()]
            job.cached = self.prefix.cached_tokens(job.hashes, ids)

    def _admission_request(self, job: Job) -> AdmissionRequest | None:
        if job.tokens is None or len(job.tokens) > MAX_TOKENS:
            return None
        decode_ids = {e.node_id for e in self.pool.decode}
        node, cached = max(
            ((n, c) for n, c in job.cached.items()), key=lambda nc: nc[1], default=("", 0)
        )
        prefill = self.pool.pick_prefill()
        return AdmissionRequest(
            request_id=job.request_id,
            uncached_prompt_tokens=len(job.tokens) - cached,
            cached_prefix_tokens=cached,
            cached_prefix_node_id=node if cached and node in decode_ids else None,
            expected_output_tokens=min(MAX_TOKENS, _max_tokens(job.body, self.settings)),
            pool=self.settings.pool,
            prefill_node_id=prefill.node_id if prefill is not None else None,
        )

    async def _admit(self, job: Job) -> Outcome | None:
        if self.queue is None:
            return None
        req = self._admission_request(job)
        if req is None:
            return None
        with self.tracer.start_as_current_span("gateway.admit") as span:
            asking = asyncio.ensure_future(self.queue.submit(req))
            try:
                ticket = await asyncio.shield(asking)
                outcome = await ticket
            except CrossflowError as exc:  # refused as invalid: nothing was held
                log.warning("gateway.admit_refused", request_id=job.request_id, error=str(exc))
                return None
            except asyncio.CancelledError:  # the client went away while its prompt was asked
                self._background(self._abandon(asking))  # for or held: no grant is left open
                raise
            admission = outcome.admission
            span.set_attribute("crossflow.decision", admission.decision.value)
            span.set_attribute("crossflow.reason", admission.reason.value)
        if outcome.dispatch is Dispatch.PREFILL_ROOM:
            self.pool.booked_tokens = max(0, self.pool.booked_tokens - req.uncached_prompt_tokens)
        if admission.reason in UNREACHABLE:
            self.metrics.broker_unavailable.inc()
        self.metrics.admissions.labels(
            admission.decision.value, admission.reason.value, outcome.dispatch.value
        ).inc()
        if outcome.held:
            job.held_s = outcome.held_ms / 1000.0
            self.metrics.held.observe(job.held_s)
        return outcome

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abandon(self, asking: asyncio.Future[Ticket]) -> None:
        """The client left while its Admit was in flight or its prompt held: let the ask end,
        stop holding the prompt, and release a grant that came anyway."""
        assert self.queue is not None
        try:
            ticket = await asking
        except CrossflowError:
            return
        await self.queue.withdraw(ticket)
        outcome = ticket.outcome
        if outcome is not None and outcome.borrowed and self.reservations is not None:
            self.reservations.granted(outcome.admission.reservation_id)
            self.reservations.release(outcome.admission.reservation_id, "cancelled")

    # -- the two paths -------------------------------------------------------------------

    def _headers(self, job: Job) -> dict[str, str]:
        headers = {"X-Request-Id": job.request_id}
        _propagator.inject(headers)
        return headers

    def _answer_headers(self, job: Job, engine: Engine) -> dict[str, str]:
        """How the request went, for the client (set once its path is final)."""
        return {PATH_HEADER: job.path_taken, NODE_HEADER: engine.node_id}

    def _sent(self, job: Job) -> None:
        self.metrics.overhead.observe(max(0.0, time.perf_counter() - job.arrived - job.held_s))

    def _first_byte(
        self, job: Job, then: Callable[[], None] | None = None
    ) -> Callable[[int], None]:
        def fire(status: int) -> None:
            job.status = status
            self.metrics.ttft.labels(job.path_taken).observe(time.perf_counter() - job.arrived)
            if then is not None:
                then()

        return fire

    async def _borrow(
        self, request: web.Request, job: Job, outcome: Outcome
    ) -> web.StreamResponse | None:
        """The borrowed path; None when the request must take the normal path instead."""
        admission = outcome.admission
        reservations = self.reservations
        assert reservations is not None
        rid = admission.reservation_id
        engine = self.pool.get(admission.node_id)
        if engine is None or engine.role != "decode" or not engine.healthy:
            log.warning("gateway.borrow_unroutable", node_id=admission.node_id)
            reservations.granted(rid)
            reservations.release(rid, "cancelled")
            return None
        engine.inflight += 1
        try:
            if not await reservations.commit(rid):
                return None
            job.path_taken = "borrowed"
            with self.tracer.start_as_current_span(
                "gateway.borrowed", kind=SpanKind.CLIENT
            ) as span:
                span.set_attribute("crossflow.node_id", engine.node_id)
                self._sent(job)
                upstream = await open_call(
                    self.session, engine, PATHS[job.route], job.body, self._headers(job)
                )
                async with upstream:
                    self.prefix.record(engine.node_id, job.hashes)
                    done = self._first_byte(job, lambda: reservations.release(rid, "finished"))
                    return await relay(
                        request, engine, upstream, done, self._answer_headers(job, engine)
                    )
        except EngineFailed as exc:
            self._engine_failed(exc)
            reservations.release(rid, "failed")
            job.path_taken = "normal"
            self.metrics.failovers.labels("decode").inc()
            return None
        finally:
            engine.inflight -= 1
            reservations.release(rid, "cancelled")  # a no-op once released

    async def _normal(self, request: web.Request, job: Job) -> web.StreamResponse:
        job.path_taken = "normal"
        tried: set[str] = set()
        uncached = job.uncached_tokens
        while True:
            prefill = self._pick_prefill(job, frozenset(tried))
            decode = self.pool.pick_decode(job.cached, frozenset(tried))
            if decode is None or (prefill is None and not self.settings.borrows):
                job.path_taken = "error"
                return openai_error(503, "no prefill or decode engine is up to take the request")
            try:
                if prefill is None:  # every prefill engine failed: the decode engine prefills
                    return await self._local(request, job, decode)
                return await self._two_hops(request, job, prefill, decode, uncached)
            except EngineFailed as exc:
                self._engine_failed(exc)
                tried.add(exc.engine.node_id)
                self.metrics.failovers.labels(exc.engine.role).inc()
            except ClientError as exc:
                return web.json_response(exc.body, status=exc.status)

    async def _local(self, request: web.Request, job: Job, decode: Engine) -> web.StreamResponse:
        """The last resort when no prefill engine answers: the decode engine prefills the
        prompt itself, as a borrowed one, but with no lease behind it (``fallback``)."""
        job.path_taken = "fallback"
        log.warning("gateway.prefill_pool_unavailable", request_id=job.request_id,
                    node_id=decode.node_id)  # fmt: skip
        decode.inflight += 1
        try:
            self._sent(job)
            upstream = await open_call(
                self.session, decode, PATHS[job.route], job.body, self._headers(job)
            )
            async with upstream:
                self.prefix.record(decode.node_id, job.hashes)
                return await relay(
                    request, decode, upstream, self._first_byte(job),
                    self._answer_headers(job, decode),
                )  # fmt: skip
        finally:
            decode.inflight -= 1

    def _pick_prefill(self, job: Job, exclude: frozenset[str]) -> Engine | None:
        """Least prompt work in flight, counting what this prompt would not have to prefill
        there (its cached prefix)."""
        up = candidates(self.pool.prefill, exclude)
        return min(
            up, key=lambda e: (e.prefill_tokens - job.cached.get(e.node_id, 0), e.inflight),
            default=None,
        )  # fmt: skip

    async def _two_hops(
        self, request: web.Request, job: Job, prefill: Engine, decode: Engine, uncached: int
    ) -> web.StreamResponse:
        prefill.prefill_tokens += uncached
        prefill.inflight += 1
        decode.inflight += 1
        released = False

        def prefill_done() -> None:
            nonlocal released
            if not released:
                released = True
                prefill.prefill_tokens -= uncached
                prefill.inflight -= 1

        try:
            with self.tracer.start_as_current_span("gateway.normal", kind=SpanKind.CLIENT) as span:
                span.set_attribute("crossflow.prefill_node_id", prefill.node_id)
                span.set_attribute("crossflow.node_id", decode.node_id)
                self._sent(job)
                upstream = await self.protocol.normal(
                    self.session, prefill, decode, PATHS[job.route], job.body,
                    self._headers(job), prefill_done,
                )  # fmt: skip
                async with upstream:
                    self.prefix.record(prefill.node_id, job.hashes)
                    self.prefix.record(decode.node_id, job.hashes)
                    return await relay(
                        request, decode, upstream, self._first_byte(job),
                        self._answer_headers(job, decode),
                    )  # fmt: skip
        finally:
            prefill_done()
            decode.inflight -= 1

    def _engine_failed(self, exc: EngineFailed) -> None:
        engine = exc.engine
        self.metrics.engine_errors.labels(engine.node_id, engine.role).inc()
        self.pool.mark_failed(engine, exc.detail)
        self.prefix.forget(engine.node_id)
        self.metrics.engine_state(engine)


def _max_tokens(body: dict[str, Any], settings: GatewaySettings) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return settings.default_max_tokens
