"""Values built without validation on hot paths (``Frozen.trusted``) are the very values
validation builds: the same fields, equal, of the same types (so a dump, JSON included, is the
same too), and an odd input the caller gave still goes through validation."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from crossflow_ctl.domain.admission import Admission, Reason, check_demand
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.leasing import pool_load
from crossflow_ctl.domain.models import PoolLoad, PoolSnapshot
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.telemetry import EngineSnapshot


def _same_as_validated(model: BaseModel) -> None:
    again = type(model).model_validate(model.model_dump())
    assert again == model
    assert model.model_dump_json() == again.model_dump_json()
    assert [type(v) for v in model.__dict__.values()] == [type(v) for v in again.__dict__.values()]


def _prefill(running: int, queued: int, wait_ms: float | None) -> EngineSnapshot:
    return EngineSnapshot(
        taken_at_ms=1_000,
        running_requests=running,
        queued_requests=queued,
        kv_total_tokens=1_000,
        outstanding_uncached_tokens=queued * 3_000,
        prompt_rate_tps=12_000.0 if running else 0.0,
        prefill_processing_rate_tps=12_000.0 if running else 0.0,
        prefill_queue_wait_ms=wait_ms,
    )


@pytest.mark.parametrize(("running", "queued", "wait"), [(0, 0, None), (1, 4, 812.5), (1, 0, 0.0)])
def test_a_pool_load_is_what_validation_builds(
    running: int, queued: int, wait: float | None
) -> None:
    load = pool_load(
        _prefill(running, queued, wait),
        now_ms=1_000,
        node_id="p0",
        pool="default",
        ttl_ms=600,
        settings=LeaseSettings(),
        modelled_rate_tps=20_000.0,
    )
    assert load is not None
    _same_as_validated(load)


def test_a_pool_load_from_odd_caller_figures_is_still_validated() -> None:
    for ttl_ms, modelled in ((0, 1.0), (600, -1.0)):
        with pytest.raises(ValidationError):
            pool_load(
                _prefill(0, 0, None),
                now_ms=1_000,
                node_id="p0",
                pool="default",
                ttl_ms=ttl_ms,
                settings=LeaseSettings(),
                modelled_rate_tps=modelled,
            )


def test_demand_and_normal_answers_are_what_validation_builds() -> None:
    reports = (
        PoolLoad(node_id="p0", outstanding_uncached_tokens=9_000, processing_rate_tps=10_000.0,
                 ttl_ms=600, queue_wait_ms=700.0),
        PoolLoad(node_id="p1", outstanding_uncached_tokens=0, processing_rate_tps=0.0,
                 ttl_ms=600, queue_wait_ms=0.0),
    )  # fmt: skip
    pool = PoolSnapshot(pool="default", reports=reports, report_seqs=(1, 2))
    for target in (None, "p0", "p1"):
        demand = check_demand(pool, PolicySettings(), 4_000, target, {"p0": 1_000})
        _same_as_validated(demand)
    _same_as_validated(Admission.normal(Reason.NO_DEMAND, "pool keeps up"))
