"""``Plan.summary``, the message of every Admit answer, word for word on each of its branches
(the borrowed one is built without the pool wait's text, which it does not show)."""

from __future__ import annotations

import pytest

from crossflow_ctl.domain.admission import DemandCheck, NodeCheck, NormalPath, Plan, Reason

NORMAL = NormalPath(wait_ms=80.04, prefill_ms=20.0, kv_transfer_ms=1.25, hold_ms=0.0)
BEST = NodeCheck(node_id="d2", verdict=Reason.BORROWED, queue_wait_ms=3.04, service_ms=9.0)


def demand(**kw: object) -> DemandCheck:
    return DemandCheck(**{"holds": True, "pool_wait_ms": 80.04, "threshold_ms": 50.0, **kw})


@pytest.mark.parametrize(
    ("plan", "text"),
    [
        (
            Plan(reason=Reason.BORROWED, demand=demand(), normal_path=NORMAL, ranked=(BEST,)),
            "borrow on d2: predicted TTFT 12.0 ms < normal path 101.3 ms",
        ),
        (
            Plan(reason=Reason.BORROWED, demand=demand(pending_uncached_tokens=7), ranked=(BEST,)),
            "borrow on d2: predicted TTFT 12.0 ms < normal path 0.0 ms",
        ),
        (
            Plan(reason=Reason.NO_ROOM, demand=demand(), normal_path=NORMAL),
            "no_room: no node passes both benefit and safety",
        ),
        (
            Plan(reason=Reason.NO_DEMAND, demand=demand(holds=False, threshold_ms=100.0)),
            "demand fails: prefill wait 80.0 ms <= threshold 100.0 ms",
        ),
        (
            Plan(
                reason=Reason.NO_DEMAND,
                demand=demand(
                    holds=False,
                    pending_uncached_tokens=300,
                    prefill_node_id="p1",
                    timed=True,
                ),
            ),
            "demand fails: prefill wait 80.0 ms (with 300 tokens sent since its reports) on p1"
            " <= threshold 50.0 ms",
        ),
        (
            Plan(reason=Reason.NO_DEMAND, demand=demand(holds=False, prefill_node_id="p1")),
            "demand fails: prefill wait 80.0 ms <= threshold 50.0 ms",
        ),
        (
            Plan(reason=Reason.POOL_LOAD_MISSING, demand=demand(holds=False, pool_wait_ms=None)),
            "demand fails: no live load report from the prefill pool",
        ),
        (
            Plan(
                reason=Reason.POOL_LOAD_MISSING,
                demand=demand(holds=False, pool_wait_ms=None, prefill_node_id="p3"),
            ),
            "demand fails: no live load report from prefill server p3",
        ),
        (
            Plan(reason=Reason.NO_DEMAND, demand=demand(holds=False, pool_wait_ms=None)),
            "demand fails: prefill wait ? ms <= threshold 50.0 ms",
        ),
    ],
)
def test_each_summary_reads_as_before(plan: Plan, text: str) -> None:
    assert plan.summary() == text
