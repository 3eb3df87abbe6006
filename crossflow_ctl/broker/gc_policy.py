"""The broker process's garbage collector settings (fleet scale, issue #11).

With thousands of agent streams a replica holds a large, long-lived heap (each stream's task,
relay and gRPC call state; the node caches), while every lease makes short-lived objects. With
CPython's default thresholds (700, 10, 10) most of those objects lived past a young collection
and were promoted, so full collections came often and walked the whole heap each time: at 4,096
streams about a third of the broker's CPU went to the collector, in pauses up to half a second,
which showed as lease ingest and Admit p99. A larger young generation lets a lease's objects die
by reference count before any collection sees them; freezing what exists once the server is up
(modules, classes, settings, the server itself) takes it out of every later full collection.
Cycles still get collected: only the rates change.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000
"""Allocations (net of frees) between young collections (CPython's default is 700)."""


def tune_for_fleet() -> None:
    """Call once the server has started (process-wide: the broker's entry point only)."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
