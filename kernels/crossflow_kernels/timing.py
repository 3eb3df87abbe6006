"""A small timing harness: median time of a kernel call, and what that means in FLOP/s and B/s.

On CUDA each call is timed with events and the L2 cache is flushed (a 256 MiB write) before it, so
a memory-bound kernel cannot be served from cache between repetitions. On the CPU it uses
``time.perf_counter``. Never used by tests to assert anything about time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from crossflow_kernels.costs import KernelCost

L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Timing:
    median_s: float
    min_s: float
    repeats: int


@dataclass(frozen=True, slots=True)
class Measurement:
    """One timed kernel call with its analytic cost."""

    name: str
    cost: KernelCost
    timing: Timing

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / self.timing.median_s

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes_moved / self.timing.median_s


def time_call(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 3, repeats: int = 10
) -> Timing:
    """Median and minimum wall time of ``fn()`` on ``device`` over ``repeats`` calls."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        event: Any = torch.cuda.Event  # untyped in torch's stubs
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        for _ in range(repeats):
            flush.zero_()
            start = event(enable_timing=True)
            end = event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return Timing(statistics.median(samples), min(samples), len(samples))


def measure(
    name: str,
    fn: Callable[[], object],
    cost: KernelCost,
    device: torch.device,
    *,
    warmup: int = 3,
    repeats: int = 10,
) -> Measurement:
    return Measurement(name, cost, time_call(fn, device, warmup=warmup, repeats=repeats))
