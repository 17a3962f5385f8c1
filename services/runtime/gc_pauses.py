"""How long the cyclic garbage collector stops a service, and how often it runs.

A profile of the scheduler at 1,000 nodes spent 18 % of its one core in the collector: each
round builds thousands of small objects that live long enough to be promoted, and a collection
of the oldest generation walks every tracked object the process holds (the jobs, nodes and
plans it keeps). prometheus-client counts collections but not their time; this measures it with
``gc.callbacks`` (a clock read at each start and stop, nothing else).

``tune()`` is applied once a service has started (setting ``gc_young_threshold``; 0 skips
it): what start-up created (modules, settings, the state loaded from the store) is frozen out
of every later collection, and the youngest generation is collected after that many net
allocations instead of CPython's 700, which makes the older collections, whose cost grows with
the whole heap, rarer by the same factor. At 1,000 emulated nodes the scheduler's collector
went from 15-21 % of its time to 1.4-3.5 % (docs/sizing.md). Memory still goes back as soon as
the last reference goes (reference counting is not affected); only garbage in reference cycles
waits longer, and a cycle among objects made before the freeze is never collected.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Histogram

PAUSES = Histogram(
    "silod_gc_pause_seconds",
    "Time the cyclic garbage collector held the process, by generation collected",
    ["generation"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)

OLDER_THRESHOLD = 20  # collections of the next younger generation between two of this one

_started: list[float] = []


def _observe(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        PAUSES.labels(generation=str(info.get("generation", "?"))).observe(time.perf_counter() - _started.pop())


def measure() -> None:
    """Observe every collection from now on (idempotent: several servers may share a process)."""
    if _observe not in gc.callbacks:
        gc.callbacks.append(_observe)


def tune(young_threshold: int) -> None:
    """Freeze what exists now and make collections rarer; see the module's docstring."""
    gc.collect()  # start-up's garbage is collected, not frozen
    gc.freeze()
    gc.set_threshold(young_threshold, OLDER_THRESHOLD, OLDER_THRESHOLD)
