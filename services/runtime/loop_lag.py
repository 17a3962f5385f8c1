"""How late the event loop runs what is due: a service's responsiveness, as its callers see it.

Every silod service answers its calls on one asyncio event loop. When something holds the loop
(a long stretch of Python on it, a worker thread holding the interpreter lock, a garbage
collection), every call waits, however cheap its handler: the request-duration histogram, which
starts at the handler, does not show it. A probe sleeps ``PERIOD_S`` and records how much later
than asked it woke up.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

PERIOD_S = 0.1

LAG = Histogram(
    "silod_event_loop_lag_seconds",
    "How much later than due the event loop ran a 0.1 s timer: the time every call waited for the loop",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)


async def probe(period_s: float = PERIOD_S) -> None:
    """Record the loop's lag until cancelled."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(period_s)
        LAG.observe(max(0.0, time.perf_counter() - asked - period_s))
