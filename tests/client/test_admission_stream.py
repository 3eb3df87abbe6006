"""``AdmissionStream`` failing closed: a write that fails because the broker already ended the
stream reports the broker's status, not grpc's internal write error."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from crossflow_ctl.client import AdmissionStream
from crossflow_ctl.domain.admission import Decision, Reason


class EndedCall:
    """An AdmitStream call the broker has ended PERMISSION_DENIED before the first write: the
    write fails as grpc.aio fails it in that race, and the read side has not seen the end yet."""

    def __init__(self) -> None:
        self.cancelled = False

    async def write(self, request: Any) -> None:
        raise RuntimeError('Failed "execute_batch": (SendMessageOperation)')

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.PERMISSION_DENIED

    async def details(self) -> str:
        return "role node may not call AdmitStream"

    def __aiter__(self) -> EndedCall:
        return self

    async def __anext__(self) -> Any:
        await asyncio.Event().wait()  # the read side never sees the end first

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def done_writing(self) -> None:
        return None


class Stub:
    def __init__(self) -> None:
        self.calls: list[EndedCall] = []

    def AdmitStream(self) -> EndedCall:
        self.calls.append(EndedCall())
        return self.calls[-1]


async def test_a_failed_write_reports_the_brokers_status() -> None:
    stream = AdmissionStream("127.0.0.1:1", timeout_s=5)
    stub = Stub()
    stream._stub = stub  # type: ignore[assignment]
    try:
        answer = await stream.admit(uncached_prompt_tokens=1_000)
    finally:
        await stream.close()
    assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.BROKER_UNAVAILABLE)
    assert "PERMISSION_DENIED" in answer.message and "may not" in answer.message
    assert "execute_batch" not in answer.message
    assert stub.calls[0].cancelled
