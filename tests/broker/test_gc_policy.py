"""The broker process's collector settings (crossflow_ctl.broker.gc_policy)."""

from __future__ import annotations

import json
import subprocess
import sys

from crossflow_ctl.broker.gc_policy import YOUNG_THRESHOLD

PROBE = """
import gc, json
from crossflow_ctl.broker.gc_policy import tune_for_fleet
before = gc.get_threshold()
tune_for_fleet()
print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count()]))
"""


def test_tuning_enlarges_the_young_generation_and_freezes_the_start_up_heap() -> None:
    # In a child: the settings are process-wide and must not leak into the test process.
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    before, after, frozen = json.loads(out)
    assert after == [YOUNG_THRESHOLD, *before[1:]]
    assert after[0] > before[0]
    assert frozen > 0
