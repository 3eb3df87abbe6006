"""Child processes of the demo: the broker, fake engines and node agents, on loopback.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the demo, which then
stops them in order), logs to a file in the demo's log folder, and is stopped with SIGTERM, then
SIGKILL after a grace period, a stage at a time: the children of the last stage started (the
agents) are stopped, and waited for, before the next (the engines, then the broker), so an
agent sends its last zero lease to a broker still there rather than finding it gone. The
signals go to the child's process group (its session: it and what it started, such as a vLLM
engine's core and worker processes). Ports are chosen by the children themselves (port 0) and
read back from the line each prints once serving, or given to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from crossflow_ctl.aio import cancel_and_wait
from crossflow_ctl.domain.errors import CrossflowError

STOP_GRACE_S = 5.0


class DemoError(CrossflowError):
    """A part of the local cluster failed to start or went away."""


def executable(name: str) -> str:
    """A console script of this install (next to the interpreter, else on PATH)."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise DemoError(f"{name} is not installed (pip install -e .)")
    return found


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process
    log_path: Path
    address: str = ""
    stage: int = 0
    """Children stop by stage, the highest first (the order they depend on each other)."""
    stopped: bool = False
    """Stopped on purpose (its exit is no failure)."""
    grace_s: float = STOP_GRACE_S
    """How long it gets after SIGTERM before SIGKILL."""

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


@dataclass
class Children:
    """Every child of the demo, stopped in reverse start order."""

    log_dir: Path
    started: list[Child] = field(default_factory=list)
    _drains: set[asyncio.Task[None]] = field(default_factory=set)

    async def spawn(
        self,
        name: str,
        argv: list[str],
        ready_prefix: str,
        timeout_s: float,
        stage: int = 0,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        grace_s: float = STOP_GRACE_S,
    ) -> Child:
        """Start ``argv``; with ``ready_prefix``, wait for the stdout line that starts with it
        (the rest is the child's address). ``env``: its whole environment (None: this one's)."""
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=asyncio.subprocess.PIPE if ready_prefix else log,
                stderr=log if ready_prefix else asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                env=env,
                cwd=cwd,
            )
        child = Child(name, proc, log_path, stage=stage, grace_s=grace_s)
        self.started.append(child)
        if not ready_prefix:
            return child
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = (await proc.stdout.readline()).decode(errors="replace")
                    if not line:
                        raise DemoError(f"{name} exited before serving: {child.log_tail()}")
                    if line.startswith(ready_prefix):
                        child.address = line.removeprefix(ready_prefix).strip()
                        self._drains.add(asyncio.create_task(_drain(proc.stdout, log_path)))
                        return child
        except TimeoutError:
            raise DemoError(f"{name} did not start within {timeout_s:.0f} s") from None

    def dead(self) -> list[Child]:
        """Children that exited without being stopped."""
        return [c for c in self.started if c.proc.returncode is not None and not c.stopped]

    async def stop(self, names: list[str] | None = None) -> None:
        """Stage by stage, the highest first: SIGTERM the stage's children, wait for them,
        SIGKILL what is left after the grace period."""
        targets = [c for c in self.started if names is None or c.name in names]
        for child in targets:
            child.stopped = True
        for stage in sorted({c.stage for c in targets}, reverse=True):
            await _stop_all([c for c in targets if c.stage == stage])
        if names is None:
            await cancel_and_wait(self._drains)
            self._drains.clear()


def _signal_group(child: Child, sig: signal.Signals) -> None:
    """``sig`` to the child's process group (its own session: its pid is the group's id)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)


async def _stop_all(children: list[Child]) -> None:
    for child in children:
        if child.proc.returncode is None:
            _signal_group(child, signal.SIGTERM)
    for child in children:
        try:
            async with asyncio.timeout(child.grace_s):
                await child.proc.wait()
        except TimeoutError:
            _signal_group(child, signal.SIGKILL)
            await child.proc.wait()
        # what it started may outlive it (a worker that ignored SIGTERM)
        _signal_group(child, signal.SIGKILL)


async def _drain(stream: asyncio.StreamReader, log_path: Path) -> None:
    """Copy what a child prints after its ready line to its log, so its pipe never fills."""
    with log_path.open("ab") as log:
        while line := await stream.readline():
            log.write(line)
            log.flush()
