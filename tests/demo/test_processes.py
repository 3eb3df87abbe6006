"""The demo's children stop a stage at a time, the last started first, with real processes."""

from __future__ import annotations

import sys
from pathlib import Path

from crossflow_ctl.demo.processes import Children

CHILD = """
import signal, sys, time
name, journal = sys.argv[1], sys.argv[2]

def say(what):
    with open(journal, "a") as f:
        f.write(f"{name} {what}\\n")

def stop(signum, frame):
    say("term")
    time.sleep(0.2)  # a shutdown that takes a moment (an agent's last lease)
    say("exit")
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


async def test_agents_stop_before_the_broker(tmp_path: Path) -> None:
    """The broker got its SIGTERM with the agents': it often went first, and the agents then
    logged "Connection refused" instead of sending their last zero lease to it."""
    journal = tmp_path / "journal"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    children = Children(tmp_path)
    for name, stage in (("broker", 0), ("engine", 1), ("agent-1", 2), ("agent-2", 2)):
        argv = [sys.executable, str(script), name, str(journal)]
        await children.spawn(name, argv, "ready", timeout_s=60, stage=stage)
    await children.stop()
    said = journal.read_text().splitlines()
    assert sorted(said[:4]) == ["agent-1 exit", "agent-1 term", "agent-2 exit", "agent-2 term"]
    assert said[4:] == ["engine term", "engine exit", "broker term", "broker exit"], said
    assert all(c.proc.returncode == 0 for c in children.started)


async def test_a_child_stopped_on_purpose_is_not_dead(tmp_path: Path) -> None:
    """The demo stops the leases run's gateway before the static run: that exit is no failure
    (the run loop ends the demo when a child is dead)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    children = Children(tmp_path)
    for name in ("gateway", "broker"):
        argv = [sys.executable, str(script), name, str(tmp_path / "journal")]
        await children.spawn(name, argv, "ready", timeout_s=60)
    await children.stop(["gateway"])
    assert children.started[0].proc.returncode == 0 and children.dead() == []
    children.started[1].proc.kill()
    await children.started[1].proc.wait()
    assert [c.name for c in children.dead()] == ["broker"]
    await children.stop()
