"""How long an event waits for its round: promptly when the scheduler was idle, in proportion
to the last round's duration right after one (longer when only submissions are waiting)."""

from __future__ import annotations

import asyncio
import time

from scheduler.live import rounds as rounds_module
from scheduler.live.core import SchedulerCore


def _core() -> SchedulerCore:
    return SchedulerCore(None, policy="fifo", interval_s=60.0, restart_cost_s=30.0, node_timeout_s=15.0,
                         cache_mode="silod")


def _delay(core: SchedulerCore, *reasons: str, last_round_s: float, ended_s_ago: float) -> float:
    async def measure() -> float:
        core.rounds.last_round_s = last_round_s
        core.rounds.last_round_end = time.monotonic() - ended_s_ago
        for reason in reasons:
            core.trigger(reason)
        started = time.monotonic()
        await core.rounds.wait_for_event_round()
        return time.monotonic() - started

    return asyncio.run(measure())


def test_an_event_after_a_quiet_period_waits_only_to_coalesce() -> None:
    waited = _delay(_core(), "completion", last_round_s=0.4, ended_s_ago=10.0)
    assert rounds_module.EVENT_COALESCE_S * 0.9 <= waited < 0.5


def test_right_after_a_round_events_wait_in_proportion_to_it() -> None:
    completion = _delay(_core(), "completion", last_round_s=0.4, ended_s_ago=0.0)
    assert 0.4 * rounds_module.ROUND_GAP_FACTOR * 0.9 <= completion < 0.4 * rounds_module.ARRIVAL_GAP_FACTOR
    arrival = _delay(_core(), "arrival", last_round_s=0.4, ended_s_ago=0.0)
    assert arrival >= 0.4 * rounds_module.ARRIVAL_GAP_FACTOR * 0.9


def test_a_completion_cuts_short_the_wait_of_submissions() -> None:
    core = _core()

    async def scenario() -> float:
        core.rounds.last_round_s, core.rounds.last_round_end = 0.4, time.monotonic()
        core.trigger("arrival")
        started = time.monotonic()
        waiting = asyncio.create_task(core.rounds.wait_for_event_round())
        await asyncio.sleep(0.1)
        core.trigger("completion")  # now a round is due ROUND_GAP_FACTOR x 0.4 s after the last
        await waiting
        return time.monotonic() - started

    waited = asyncio.run(scenario())
    assert 0.4 * rounds_module.ROUND_GAP_FACTOR * 0.9 <= waited < 0.4 * rounds_module.ARRIVAL_GAP_FACTOR * 0.9
