"""``AdmissionClient`` retries: every attempt shares the call's one deadline, so a fail-closed
Admit answers NORMAL by ``timeout_s`` instead of starting a second full-length attempt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.admission import Decision, Reason


class Hung(admission_pb2_grpc.AdmissionServiceServicer):
    """A broker whose Admit never answers; counts the attempts that reach it."""

    def __init__(self) -> None:
        self.calls = 0

    async def Admit(
        self, request: admission_pb2.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.AdmitResponse:
        self.calls += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.fixture
async def hung() -> AsyncIterator[tuple[str, Hung]]:
    server = grpc.aio.server()
    servicer = Hung()  # type: ignore[abstract]  # only Admit is served
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(0)


async def test_a_deadline_spent_by_the_first_attempt_is_not_retried(
    hung: tuple[str, Hung],
) -> None:
    target, servicer = hung
    async with AdmissionClient(target, timeout_s=1.0, fail_closed=True, retries=1) as client:
        answer = await client.admit(uncached_prompt_tokens=1_000)
    assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.TIMEOUT)
    assert servicer.calls == 1


class Down(admission_pb2_grpc.AdmissionServiceServicer):
    """A broker that answers every Admit UNAVAILABLE; records each attempt's number."""

    def __init__(self) -> None:
        self.attempts: list[tuple[str, int]] = []

    async def Admit(
        self, request: admission_pb2.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.AdmitResponse:
        self.attempts.append((request.request_id, request.attempt))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "down")
        raise AssertionError("unreachable")


@pytest.mark.parametrize("first", [0, 2])
async def test_retries_count_on_from_the_callers_attempt(first: int) -> None:
    """A router that marks its own retry (attempt 2) must not have it sent as a first call
    (attempt 0): the broker replays recorded answers only for retries."""
    server = grpc.aio.server()
    servicer = Down()  # type: ignore[abstract]  # only Admit is served
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AdmissionClient(
            f"127.0.0.1:{port}", timeout_s=30.0, fail_closed=True, retries=1
        ) as client:
            answer = await client.admit(
                request_id="r-1", uncached_prompt_tokens=1_000, attempt=first
            )
    finally:
        await server.stop(0)
    assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.BROKER_UNAVAILABLE)
    assert servicer.attempts == [("r-1", first), ("r-1", first + 1)]
