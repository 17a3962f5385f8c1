"""A service's event loop lag: a loop held by a long stretch of Python shows as lag."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from services.runtime import loop_lag


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_held_loop_is_recorded_as_lag() -> None:
    async def scenario() -> None:
        probe = asyncio.ensure_future(loop_lag.probe(period_s=0.01))
        await asyncio.sleep(0.05)  # a few probes on an idle loop
        time.sleep(0.3)  # the loop held, as by a long round on it
        await asyncio.sleep(0.05)
        probe.cancel()

    count = _sample("silod_event_loop_lag_seconds_count")
    slow = count - _sample("silod_event_loop_lag_seconds_bucket", le="0.25")
    asyncio.run(scenario())
    assert _sample("silod_event_loop_lag_seconds_count") >= count + 3
    # The probe that was due while the loop was held waited about 0.29 s.
    assert _sample("silod_event_loop_lag_seconds_count") - _sample("silod_event_loop_lag_seconds_bucket", le="0.25") \
        >= slow + 1
