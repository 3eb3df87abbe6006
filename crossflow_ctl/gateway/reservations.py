"""A borrowed prompt's reservation, from Commit at dispatch to its one Release.

Release is sent when the prompt's prefill is done (the engine's first byte), when the engine
fails, or when the client goes away, exactly once per reservation. Releases run in the
background so the response is never held up by the broker; ``close`` releases whatever is
still open (``cancelled``) and waits for them all. A release the broker cannot take is logged:
the reservation then ends by its own TTL (nothing is held forever).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.errors import CrossflowError
from crossflow_ctl.gateway.metrics import GatewayMetrics

log = structlog.get_logger()


class Reservations:
    def __init__(self, client: AdmissionClient, metrics: GatewayMetrics) -> None:
        self._client = client
        self._metrics = metrics
        self.open: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    def granted(self, reservation_id: str) -> None:
        """A BORROW named this reservation: from now on it is this gateway's to release, even
        if the request goes away before its Commit answers."""
        self.open.add(reservation_id)
        self._metrics.reservations_open.set(len(self.open))

    async def commit(self, reservation_id: str) -> bool:
        """Commit at dispatch; False (the prompt takes the normal path, the reservation is
        released) when the broker refuses or cannot be reached."""
        self.granted(reservation_id)
        try:
            await self._client.commit(reservation_id)
        except CrossflowError as exc:
            log.warning("gateway.commit_failed", reservation_id=reservation_id, error=str(exc))
            self.release(reservation_id, "cancelled")
            return False
        return True

    def release(self, reservation_id: str, outcome: str) -> None:
        """Release once, in the background (a second call for the same id does nothing)."""
        if reservation_id not in self.open:
            return
        self.open.discard(reservation_id)
        self._metrics.reservations_open.set(len(self.open))
        self._metrics.releases.labels(outcome).inc()
        task = asyncio.get_running_loop().create_task(self._release(reservation_id, outcome))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, reservation_id: str, outcome: str) -> None:
        try:
            await self._client.release(reservation_id, outcome)
        except CrossflowError as exc:
            log.warning(
                "gateway.release_failed",
                reservation_id=reservation_id,
                outcome=outcome,
                error=str(exc),
            )

    async def close(self) -> None:
        for reservation_id in list(self.open):
            self.release(reservation_id, "cancelled")
        while self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.gather(*list(self._tasks))
