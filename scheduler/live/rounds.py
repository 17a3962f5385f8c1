"""When rounds run: every interval, and soon after an event (a submission, a completion, a
release, a node change), spaced so that events cannot keep rounds running back to back.

Event-triggered rounds are spaced by at least the last round's duration, so a stream of
submissions cannot keep the scheduler (and the metadata store) busy with back-to-back rounds.
What a round does is not decided here: the pacer runs the round function it was given, one
at a time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

_log = logging.getLogger("silod.scheduler")
R = TypeVar("R")

EVENT_COALESCE_S = 0.05  # an event waits this long before its round, so a burst of events makes one round
ROUND_GAP_FACTOR = 1.0  # an event round waits this many times the last round's duration after it ...
ARRIVAL_GAP_FACTOR = 3.0  # ... or this many when only submissions wait for it (they need no prompt answer)
MAX_ROUND_GAP_S = 5.0


class RoundPacer(Generic[R]):
    """``round(reason)`` runs one round; ``uncounted_s()`` is a running total of seconds a round
    spends that are not its cost (fitting profiles: once per application), left out of the gap."""

    def __init__(self, round: Callable[[str], Awaitable[R]], *, interval_s: float,
                 uncounted_s: Callable[[], float] = lambda: 0.0) -> None:
        self._round = round
        self.interval_s = interval_s
        self._uncounted_s = uncounted_s
        self.last_round_s = 0.0
        self.last_round_end = -math.inf
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._reasons: list[str] = []

    def trigger(self, reason: str) -> None:
        self._reasons.append(reason)
        self._wake.set()

    async def run(self, reason: str = "interval") -> R:
        async with self._lock:
            started, uncounted_before = time.monotonic(), self._uncounted_s()
            try:
                return await self._round(reason)
            finally:
                self.last_round_end = time.monotonic()
                self.last_round_s = self.last_round_end - started - (self._uncounted_s() - uncounted_before)

    async def wait_for_event_round(self) -> None:
        """Hold an event's round back: EVENT_COALESCE_S when the scheduler was idle, so a burst
        of events makes one round; right after a round of d seconds, until ROUND_GAP_FACTOR * d
        has passed since it ended (ARRIVAL_GAP_FACTOR * d when only submissions are waiting),
        so a stream of events cannot keep rounds running back to back."""
        event_at = time.monotonic()
        while True:
            factor = ARRIVAL_GAP_FACTOR if all(r == "arrival" for r in self._reasons) else ROUND_GAP_FACTOR
            gap = min(factor * self.last_round_s, MAX_ROUND_GAP_S, self.interval_s)
            remaining = max(event_at + EVENT_COALESCE_S, self.last_round_end + gap) - time.monotonic()
            if remaining <= 0:
                return
            self._wake.clear()  # a new event re-evaluates: a completion need not wait like an arrival
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
                await self.wait_for_event_round()
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            reasons, self._reasons = self._reasons, []
            reason = ",".join(dict.fromkeys(reasons)) or "interval"
            try:
                await self.run(reason)
            except asyncio.CancelledError:
                raise
            except Exception:
                _log.exception("scheduling round failed")
