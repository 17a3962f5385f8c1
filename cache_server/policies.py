"""Admission and eviction policies. A *partition* is a bounded set of cached objects that one
policy manages: one per job with a plan quota, plus the node's shared best-effort partition.

- ``uniform`` (SiloD; CoorDL's "MinIO"): admit while the quota has room, never evict while the
  job runs. Under a fresh random order every epoch the hit ratio is quota / dataset size.
- ``lru`` (Alluxio-like baseline): evict the least recently used object. Under per-epoch random
  order it thrashes: h = k + (1 - k) ln(1 - k) for k = quota / dataset size (0.153 at k = 0.5).
- ``lrfu-cost`` (DLCache): score = recency-weighted frequency x cost to fetch again, evict the
  lowest. Frequency decays with a half-life (each access adds 1 to a value that halves every
  ``half_life_s``); cost is ``size / measured fetch bandwidth + per-request latency`` of the
  object's store. A new object is admitted only if it outranks the objects it would displace.

Pinned objects (leased, being read) are never chosen as victims.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from typing import Any

from cache_server.tiers import Entry

POLICIES = ("uniform", "lru", "lrfu-cost")  # policies of a partition (and of --default-policy)
# "none": pass-through, the baseline without a cache. The job's reads go to the remote store
# (at its planned IO rate) and nothing is admitted for it, nor served to it from the tiers: no
# partition, hit ratio 0. Valid in a plan's cache_policy only.
PASS_THROUGH = "none"
PLAN_POLICIES = (*POLICIES, PASS_THROUGH)


class Partition:
    policy = ""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = int(capacity)
        self.used = 0  # bytes of member entries
        self.reserved = 0  # bytes of admissions being written
        self.entries: dict[int, Entry] = {}

    # -- membership ----------------------------------------------------------------------------

    def add(self, entry: Entry, now: float) -> None:
        entry.partition = self
        self.entries[id(entry)] = entry
        self.used += entry.size

    def remove(self, entry: Entry) -> None:
        if self.entries.pop(id(entry), None) is not None:
            self.used -= entry.size
            entry.partition = None

    def free(self) -> int:
        return self.capacity - self.used - self.reserved

    # -- policy ----------------------------------------------------------------------------------

    def on_hit(self, entry: Entry, now: float) -> None:
        """An access to a member."""

    def plan_admission(self, size: int, cost_s: float, now: float) -> list[Entry] | None:
        """Victims to evict so that an object of ``size`` bytes fits, or None to refuse it."""
        raise NotImplementedError

    def shrink_victims(self) -> list[Entry]:
        """Members to evict (unpinned, in policy order) until ``used <= capacity``."""
        raise NotImplementedError

    def _unpinned_in_order(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.pins == 0]


class UniformPartition(Partition):
    policy = "uniform"

    def plan_admission(self, size: int, cost_s: float, now: float) -> list[Entry] | None:
        return [] if size <= self.free() else None

    def shrink_victims(self) -> list[Entry]:
        # Quota cut by a new plan: give back the most recently admitted objects first.
        victims, excess = [], self.used + self.reserved - self.capacity
        for entry in reversed(self._unpinned_in_order()):
            if excess <= 0:
                break
            victims.append(entry)
            excess -= entry.size
        return victims


class LruPartition(Partition):
    policy = "lru"

    def __init__(self, name: str, capacity: int) -> None:
        super().__init__(name, capacity)
        self._order: OrderedDict[int, Entry] = OrderedDict()

    def add(self, entry: Entry, now: float) -> None:
        super().add(entry, now)
        self._order[id(entry)] = entry

    def remove(self, entry: Entry) -> None:
        super().remove(entry)
        self._order.pop(id(entry), None)

    def on_hit(self, entry: Entry, now: float) -> None:
        if id(entry) in self._order:
            self._order.move_to_end(id(entry))

    def _victims(self, needed: int) -> list[Entry] | None:
        victims: list[Entry] = []
        for entry in self._order.values():
            if needed <= 0:
                break
            if entry.pins == 0:
                victims.append(entry)
                needed -= entry.size
        return victims if needed <= 0 else None

    def plan_admission(self, size: int, cost_s: float, now: float) -> list[Entry] | None:
        if size > self.capacity:
            return None
        return self._victims(size - self.free())

    def shrink_victims(self) -> list[Entry]:
        return self._victims(self.used + self.reserved - self.capacity) or [
            e for e in self._order.values() if e.pins == 0
        ]


class LrfuCostPartition(Partition):
    """Scores live in a heap keyed by a time-invariant rank: with value ``F`` at the last
    access ``t0`` and half-life ``H``, the score at ``t`` is ``F * 2**(-(t - t0)/H) * cost``,
    whose order equals that of ``log2(F * cost) + t0 / H`` for every ``t``."""

    policy = "lrfu-cost"

    def __init__(self, name: str, capacity: int, half_life_s: float = 300.0) -> None:
        super().__init__(name, capacity)
        self.half_life_s = half_life_s
        self._heap: list[tuple[float, int, Entry]] = []
        self._seq = itertools.count()

    def _rank(self, crf: float, cost_s: float, t0: float) -> float:
        return math.log2(max(crf * cost_s, 1e-300)) + t0 / self.half_life_s

    def _push(self, entry: Entry) -> None:
        entry.heap_key = self._rank(entry.crf, entry.cost_s, entry.last_access)
        heapq.heappush(self._heap, (entry.heap_key, next(self._seq), entry))
        if len(self._heap) > 2 * len(self.entries) + 1024:
            self._heap = [(e.heap_key, next(self._seq), e) for e in self.entries.values()]
            heapq.heapify(self._heap)

    def add(self, entry: Entry, now: float) -> None:
        super().add(entry, now)
        if entry.crf <= 0:
            entry.crf, entry.last_access = 1.0, now
        self._push(entry)

    def on_hit(self, entry: Entry, now: float) -> None:
        # No heap work here (hits are the hot path): a hit only raises the rank, so the heap
        # item keeps a lower bound and is re-ranked lazily when it reaches the top.
        decay = 0.5 ** (max(0.0, now - entry.last_access) / self.half_life_s)
        entry.crf = entry.crf * decay + 1.0
        entry.last_access = now

    def _live(self, item: tuple[float, int, Entry]) -> bool:
        key, _, entry = item
        return id(entry) in self.entries and entry.partition is self and entry.heap_key == key

    def _pop_lowest(self) -> tuple[float, int, Entry] | None:
        """The member with the lowest current rank (re-ranking stale items on the way)."""
        while self._heap:
            item = heapq.heappop(self._heap)
            if not self._live(item):
                continue
            entry = item[2]
            current = self._rank(entry.crf, entry.cost_s, entry.last_access)
            if current > item[0]:
                self._push(entry)
                continue
            return item
        return None

    def plan_admission(self, size: int, cost_s: float, now: float) -> list[Entry] | None:
        if size > self.capacity:
            return None
        needed = size - self.free()
        if needed <= 0:
            return []
        candidate = self._rank(1.0, cost_s, now)
        victims: list[Entry] = []
        popped: list[tuple[float, int, Entry]] = []
        admitted = False
        while True:
            item = self._pop_lowest()
            if item is None:
                break
            popped.append(item)
            entry = item[2]
            if entry.pins:
                continue
            if item[0] >= candidate:
                break  # every remaining member is worth more than the newcomer
            victims.append(entry)
            needed -= entry.size
            if needed <= 0:
                admitted = True
                break
        for item in popped:  # victims are removed by the caller; their stale items are skipped later
            heapq.heappush(self._heap, item)
        return victims if admitted else None

    def shrink_victims(self) -> list[Entry]:
        excess = self.used + self.reserved - self.capacity
        ordered = sorted((e for e in self.entries.values() if e.pins == 0),
                         key=lambda e: self._rank(e.crf, e.cost_s, e.last_access))
        victims = []
        for entry in ordered:
            if excess <= 0:
                break
            victims.append(entry)
            excess -= entry.size
        return victims


def make_partition(policy: str, name: str, capacity: int, *, half_life_s: float = 300.0) -> Partition:
    if policy == "uniform":
        return UniformPartition(name, capacity)
    if policy == "lru":
        return LruPartition(name, capacity)
    if policy == "lrfu-cost":
        return LrfuCostPartition(name, capacity, half_life_s)
    raise ValueError(f"unknown cache policy {policy!r}; expected one of {', '.join(POLICIES)}")


def fetch_cost_default() -> tuple[float, float]:
    """(bytes/s, seconds per request) assumed before any fetch was measured."""
    return 100e6, 0.01


class FetchCostModel:
    """Fits ``seconds = latency + bytes / bandwidth`` to the recent fetches of one store."""

    def __init__(self, window: int = 256) -> None:
        self._samples: list[tuple[int, float]] = []
        self._window = window
        self._pos = 0
        self._observed = 0
        self.bandwidth, self.latency = fetch_cost_default()

    def observe(self, nbytes: int, seconds: float) -> None:
        if len(self._samples) < self._window:
            self._samples.append((nbytes, seconds))
        else:
            self._samples[self._pos] = (nbytes, seconds)
            self._pos = (self._pos + 1) % self._window
        self._observed += 1
        # Every 64th fetch (a full window would otherwise be refitted on every fetch: O(window) each).
        if self._observed % 64 == 0 or self._observed < 16:
            self._fit()

    def _fit(self) -> None:
        n = len(self._samples)
        if n < 2:
            return
        sx = sum(s for s, _ in self._samples)
        st = sum(t for _, t in self._samples)
        mx, mt = sx / n, st / n
        vxx = sum((s - mx) ** 2 for s, _ in self._samples)
        if mx > 0 and vxx > (0.05 * mx) ** 2 * n:  # sizes vary enough to separate the two terms
            slope = sum((s - mx) * (t - mt) for s, t in self._samples) / vxx
            latency = mt - slope * mx
            if slope > 0 and latency >= 0:
                self.bandwidth, self.latency = 1.0 / slope, latency
                return
        if sx > 0 and st > 0:
            self.bandwidth, self.latency = sx / st, 0.0

    def cost(self, nbytes: int) -> float:
        return nbytes / self.bandwidth + self.latency

    def describe(self) -> dict[str, Any]:
        return {"bandwidth_bytes_per_s": self.bandwidth, "latency_s": self.latency, "samples": len(self._samples)}
