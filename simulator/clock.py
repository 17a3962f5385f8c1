"""The simulated clock: the only notion of time inside the engine.

The engine never reads wall time. It owns a :class:`SimClock` and moves it forward from one
event to the next; policies read the time from the snapshot (``snapshot.time_s``), which the
engine fills from this clock. Tests inject their own clock to start at any time.
"""

from __future__ import annotations

import math


class SimClock:
    """Seconds on a simulated timeline; only ever moves forward."""

    __slots__ = ("_now",)

    def __init__(self, start_s: float = 0.0):
        if not math.isfinite(start_s):
            raise ValueError(f"clock start must be finite, got {start_s}")
        self._now = float(start_s)

    def now(self) -> float:
        return self._now

    def advance_to(self, time_s: float) -> None:
        """Move to ``time_s``; moving backwards is a bug in the caller."""
        if not time_s >= self._now:  # also rejects NaN
            raise ValueError(f"simulated clock cannot go back from {self._now} to {time_s}")
        self._now = float(time_s)

    def __repr__(self) -> str:
        return f"SimClock(now={self._now})"
