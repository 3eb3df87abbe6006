"""crossflowctl and the demo reach the broker only through the public client library.

The import-linter layers allow the CLI and the demo to import anything below them; this test
narrows that: not the transport, the service, the store or the agent (the simulator's commands
go through ``crossflow_ctl.sim``, which owns its store), and not the gateway: the demo runs
``crossflow-gateway`` as a child process and speaks to it over HTTP, as a user would."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import crossflow_ctl

PACKAGE = Path(crossflow_ctl.__file__).parent
FORBIDDEN = (
    "crossflow_ctl.broker",
    "crossflow_ctl.service",
    "crossflow_ctl.store",
    "crossflow_ctl.gateway",
    "crossflow_agent",
)
OWN = sorted(list((PACKAGE / "cli").glob("*.py")) + list((PACKAGE / "demo").glob("*.py")))


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", OWN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_broker_store_or_agent_internals(path: Path) -> None:
    bad = [n for n in _imports(path) if n.startswith(FORBIDDEN)]
    assert bad == [], (
        f"{path.name} imports {bad}: use crossflow_ctl.client, or a subprocess and HTTP"
    )
