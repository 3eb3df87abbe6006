"""The shared admission policy: versioned writes, and a durable answer when the store forgets.

Source of truth: the store's versioned policy (``VersionedPolicy``). Every replica keeps the
newest version it has seen. When the store answers with no policy, or with an OLDER version
than one this replica saw (Redis restarted without persistence, or was restored from an old
snapshot), the replica writes back the newest policy it saw, with its version, and logs an
error; the startup policy from settings is only ever written into an empty store by a replica
that has seen nothing newer. Writes are compare-and-set on the version: an operator's
``expected_version`` that is not the stored one is refused with Aborted (ABORTED), and a write
without one retries on a concurrent change, never overwriting what it did not read.

Each replica's streams push the policy-derived settings to their agents when the version this
replica holds changes (:meth:`PolicyKeeper.changed_after`); a write that lowers the horizon is
remembered for as long as leases sized over the old one may still be granted against, and until
then no write may take the commit TTL below it (:func:`~crossflow_ctl.domain.policy.
check_retired_horizons`). That memory is this replica's: one started since such a change, handed
the second write, does not know of it (the operator's two writes would then have to land on
different replicas within seconds of each other and of a restart).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from crossflow_ctl.aio import wait_any
from crossflow_ctl.domain.clock import Clock
from crossflow_ctl.domain.errors import Aborted, CrossflowError, InvalidArgument
from crossflow_ctl.domain.policy import (
    PolicySettings,
    RetiredHorizon,
    VersionedPolicy,
    check_retired_horizons,
    retire_horizon,
)
from crossflow_ctl.store.base import Store

log = structlog.get_logger()

WRITE_TRIES = 3
"""Compare-and-set attempts of an unconditional write that races other writers."""


class PolicyKeeper:
    def __init__(
        self, store: Store, initial: PolicySettings, clock: Clock, refresh_ms: int
    ) -> None:
        self._store = store
        self._initial = initial
        self._clock = clock
        self._refresh_ms = refresh_ms
        self._current = VersionedPolicy(policy=initial, version=0)
        self._changed = asyncio.Event()
        """Set (and replaced by a fresh one) whenever ``current`` takes another version."""
        self._retired: list[RetiredHorizon] = []
        """Horizons lowered by changes this replica has seen, while they may still be in use."""

    @property
    def current(self) -> VersionedPolicy:
        """The newest policy this replica has seen (version 0: only the startup one)."""
        return self._current

    def _adopt(self, policy: VersionedPolicy) -> None:
        """Hold ``policy``: remember a horizon it lowers, and wake :meth:`changed_after`."""
        old = self._current
        if policy == old:
            return
        now = self._clock.now_ms()
        retired = retire_horizon(old.policy, policy.policy, now, self._refresh_ms)
        self._retired = [r for r in self._retired if r.until_ms > now]
        if retired is not None and old.version > 0:
            self._retired.append(retired)
        self._current = policy
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def changed_after(self, version: int) -> VersionedPolicy:
        """The current policy once its version is not ``version`` (at once if it is not now)."""
        while self._current.version == version:
            await self._changed.wait()
        return self._current

    async def load(self) -> VersionedPolicy:
        """Adopt the store's policy; restore the newest seen one if the store lost it."""
        for _ in range(WRITE_TRIES):
            stored = await self._store.get_policy()
            stored_version = stored.version if stored is not None else 0
            if stored is not None and stored.version >= self.current.version:
                if stored.unknown_fields and stored.version != self.current.version:
                    log.warning(
                        "policy.unknown_fields",
                        version=stored.version,
                        fields=list(stored.unknown_fields),
                        detail="a newer replica wrote settings this broker does not know; it "
                        "applies the rest and refuses policy writes until it is upgraded",
                    )
                self._adopt(stored)
                return stored
            seen = self.current
            if seen.unknown_fields:
                # Written back by this replica, the policy would lose the settings it does not
                # know (a newer replica's): leave the restore to a replica that knows them all.
                log.error(
                    "policy.store_lost_it",
                    stored_version=stored_version,
                    detail="not restoring a policy with settings this replica does not know "
                    f"({', '.join(seen.unknown_fields)}): an upgraded replica will",
                )
                return seen
            if seen.version > 0:
                log.error(
                    "policy.store_lost_it",
                    stored_version=stored_version,
                    restoring_version=seen.version,
                    detail="the store holds no policy or an older one; writing back the newest "
                    "seen (not the startup default)",
                )
                write = seen
            else:
                write = VersionedPolicy(policy=self._initial, version=1)
            try:
                await self._store.set_policy(write, expected_version=stored_version)
            except Aborted:
                continue  # another replica wrote meanwhile: read again
            self._adopt(write)
            return write
        return self.current

    async def update(
        self, updates: dict[str, Any], expected_version: int | None = None
    ) -> VersionedPolicy:
        """Apply ``updates`` to the stored policy as a new version (see module docstring)."""
        if not updates:
            raise InvalidArgument("no updates given", field="updates")
        for _ in range(WRITE_TRIES):
            base = await self.load()
            base.check_writable()
            if expected_version is not None and expected_version != base.version:
                raise Aborted(
                    f"policy is at version {base.version}, not {expected_version}",
                    current_version=base.version,
                    field="expected_version",
                )
            policy = base.policy.updated(updates)
            if policy == base.policy:  # nothing to change: no new version, nothing pushed
                log.info("policy.unchanged", updates=sorted(updates), version=base.version)
                return base
            new = VersionedPolicy(policy=policy, version=base.version + 1)
            now = self._clock.now_ms()
            retired = list(self._retired)
            lowered = retire_horizon(base.policy, new.policy, now, self._refresh_ms)
            if lowered is not None:
                retired.append(lowered)
            check_retired_horizons(new.policy, retired, now)
            try:
                await self._store.set_policy(new, expected_version=base.version)
            except Aborted:
                if expected_version is not None:
                    raise
                continue
            self._adopt(new)
            log.info("policy.set", updates=sorted(updates), version=new.version)
            return new
        raise Aborted(
            "policy changed concurrently; retry",
            current_version=self.current.version,
            field="expected_version",
        )


async def refresh_forever(
    load: Callable[[], Awaitable[object]], stop: asyncio.Event, interval_s: float
) -> None:
    """Call ``load`` every ``interval_s`` until ``stop`` is set; failures are logged."""
    while not stop.is_set():
        try:
            await load()
        except CrossflowError as exc:
            log.warning("policy.refresh_failed", error=str(exc))
        except Exception as exc:
            # The loop must outlive any one bad read: keeping the current policy beats a dead
            # refresh loop (this replica stuck on it until restarted).
            log.error("policy.refresh_failed", error=repr(exc))
        await wait_any(stop, timeout_s=interval_s)
