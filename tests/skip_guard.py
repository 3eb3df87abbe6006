"""``CROSSFLOW_FAIL_ON_SKIP=1`` turns every skip into a failure (``.ci/run`` sets it).

Tests skip, saying why, when Redis, helm, buf or torch/triton are missing, so a developer's
partial machine still runs the rest. In CI everything is installed on purpose, so a skip there
means something silently did not run: it fails instead. Tests marked ``@pytest.mark.may_skip``
(e.g. one that only applies when an optional package is absent, or one that needs the full traces
of $CROSSFLOW_TRACES_DIR) keep their skip.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

ENV = "CROSSFLOW_FAIL_ON_SKIP"


def _enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _reason(longrepr: Any) -> str:
    text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[Any]:
    outcome = yield
    report = outcome.get_result()
    if (
        _enabled()
        and report.skipped
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("may_skip") is None
    ):
        report.outcome = "failed"
        report.longrepr = f"{ENV}=1 forbids skips; this test skipped: {_reason(report.longrepr)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[Any]:
    outcome = yield
    report = outcome.get_result()
    if _enabled() and report.outcome == "skipped":
        report.outcome = "failed"
        report.longrepr = f"{ENV}=1 forbids skips; {collector.nodeid} skipped at collection: " + (
            _reason(report.longrepr)
        )
