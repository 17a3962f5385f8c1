"""Per-job remote-IO rate: a token bucket that paces fetches, and a meter of the recent rate."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable


class TokenBucket:
    """Paces byte transfers to ``rate`` bytes/s with ``burst_s`` seconds of burst.

    Virtual-scheduling form (GCRA): each acquisition reserves ``n / rate`` seconds of the
    link, starting no earlier than ``burst_s`` before "now" is used up. An object larger than
    the burst is admitted whole and the debt delays the next one, so over any long interval
    the bytes moved are at most ``rate * t + rate * burst_s + one object``.
    ``rate`` may be changed at any time (a new plan); waiters pick it up on their next acquire.
    """

    def __init__(self, rate: float, burst_s: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        self.rate = float(rate)
        self.burst_s = burst_s
        self._clock = clock
        self._next_free = clock()
        self._idle_turn: asyncio.Lock | None = None  # created on first use, inside a running loop

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes``; return the seconds to wait before transferring them."""
        now = self._clock()
        start = max(self._next_free, now - self.burst_s)
        self._next_free = start + nbytes / self.rate
        return max(0.0, start - now)

    def refund(self, nbytes: int) -> None:
        """Give back a reservation whose bytes were never transferred (another reader's fetch
        served them). Never earlier than the burst allows: the refund buys no extra burst."""
        self._next_free = max(self._next_free - nbytes / self.rate, self._clock() - self.burst_s)

    async def acquire(self, nbytes: int) -> None:
        delay = self.reserve(nbytes)
        if delay > 0:
            await asyncio.sleep(delay)

    async def acquire_when_idle(self, nbytes: int) -> None:
        """Book ``nbytes`` only once the bucket is idle (nothing booked beyond now), one such
        caller at a time: background transfers (prefetch) take the rate a reader leaves
        unused, and a reader's ``acquire`` never queues behind more than the one background
        transfer booked last. Over time they get the same rate as ``acquire`` would."""
        if self._idle_turn is None:
            self._idle_turn = asyncio.Lock()
        async with self._idle_turn:
            while (wait := self._next_free - self._clock()) > 0:
                await asyncio.sleep(wait)  # a reader may book meanwhile: look again
            self.reserve(nbytes)


class RateMeter:
    """Bytes/s over the last ``window_s`` seconds (events older than that are forgotten)."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0
        self._started = clock()

    def add(self, nbytes: int) -> None:
        now = self._clock()
        self._events.append((now, nbytes))
        self._total += nbytes
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._total -= self._events.popleft()[1]

    def rate(self) -> float:
        now = self._clock()
        self._trim(now)
        span = min(self.window_s, max(now - self._started, 1e-3))
        return self._total / span


class EventRate:
    """Events/s, exponentially smoothed over ``half_life_s`` (consumption speed of a job)."""

    def __init__(self, half_life_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s = half_life_s
        self._clock = clock
        self._last = clock()
        self._rate = 0.0
        self._pending = 0

    def add(self, count: int) -> None:
        self._pending += count
        self._fold()

    def _fold(self) -> None:
        now = self._clock()
        dt = now - self._last
        if dt < 0.05:
            return
        decay = 0.5 ** (dt / self.half_life_s)
        self._rate = decay * self._rate + (1 - decay) * (self._pending / dt)
        self._pending = 0
        self._last = now

    def rate(self) -> float:
        self._fold()
        return self._rate
