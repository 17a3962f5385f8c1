"""Cache quotas and remote IO rates on the live scheduler's plans, per cache mode.

What each placed training job gets of the two data resources is decided by
:func:`scheduler.data_grants.grant`, the same code the simulator runs after its policy (the
modes' rules are described there). This module turns the result into the plan's
``JobAllocation.cache_grants`` (one per node the job reads on) and ``cache_policy``, which
the cache servers enforce (NodePlan.cache_quotas). Inference jobs (no dataset) get nothing.

What a job holds now is read from the cache servers (:class:`CachedBytesProbe`): it is the
``cached_bytes`` of the snapshot, with which :func:`co_allocate` gives a cold cache the IO
to fill it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable

import grpc

from scheduler import codesign as co
from scheduler.data_grants import CACHE_MODES, CACHE_POLICY, EpochStarts, grant, problems  # noqa: F401 (the live scheduler's names)
from scheduler.policy import Allocation
from silod.v1 import cache_pb2, cache_pb2_grpc, common_pb2, plan_pb2

_log = logging.getLogger("silod.scheduler")

STATS_TIMEOUT_S = 0.5   # a round must not wait on a slow cache server: its node then reports nothing
STATS_TTL_S = 2.0       # cached bytes change slowly next to a round: one Stats per node per this


def add_grants(entry: plan_pb2.JobAllocation, alloc: Allocation, mode: str, dataset: str, managed: bool) -> None:
    """The plan entry's ``cache_grants`` and ``cache_policy`` for a placed training job.

    A job reading a dataset gets a grant on every node it runs on — quota 0 included: the
    cache server learns the job's policy (pass-through for ``none``) and IO rate from it.
    The IO rate is split over the nodes in proportion to the job's GPUs there (how
    :func:`co_allocate` loads the NICs), rounded down so the plan stays within the budget.
    ``managed`` False (``silod`` with nothing to manage) keeps the entry bare, as before.
    """
    if not dataset or not managed or not alloc.placement:
        return
    entry.cache_policy = CACHE_POLICY[mode]
    shares = co.node_shares(alloc.placement)
    io = alloc.remote_io_bytes_per_s
    for node, _ in alloc.placement:
        entry.cache_grants.add(
            node=node, cache_quota_bytes=int(alloc.cache_bytes.get(node, 0.0)),
            remote_io_bytes_per_s=int(io * shares.get(node, 0.0)) if math.isfinite(io) else 0,
        )


class CachedBytesProbe:
    """Bytes each node's cache server holds per dataset, from its Stats (whole node).

    Answers are kept ``STATS_TTL_S``; a node whose server does not answer within
    ``STATS_TIMEOUT_S`` contributes nothing this round (co_allocate then assumes a cold
    cache, which only grants more IO than needed, never more than the budget).
    """

    def __init__(self, open_channel: Callable[[str], grpc.aio.Channel], clock: Callable[[], float] = time.monotonic) -> None:
        self._open = open_channel
        self._clock = clock
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._answers: dict[str, tuple[float, dict[str, float]]] = {}  # address -> (read at, dataset -> bytes)
        self._failing: set[str] = set()

    async def cached_bytes(self, nodes: Iterable[common_pb2.Node]) -> dict[tuple[str, str], float]:
        targets = [(n.spec.name, n.spec.cache_address) for n in nodes if n.spec.cache_address]
        now = self._clock()
        stale = [(name, addr) for name, addr in targets if now - self._answers.get(addr, (-math.inf, {}))[0] >= STATS_TTL_S]
        await asyncio.gather(*(self._read(name, addr, now) for name, addr in stale))
        out: dict[tuple[str, str], float] = {}
        for name, addr in targets:
            for dataset, held in self._answers.get(addr, (0.0, {}))[1].items():
                out[(name, dataset)] = held
        return out

    async def _read(self, node: str, address: str, now: float) -> None:
        if address not in self._channels:
            self._channels[address] = self._open(address)
        stub = cache_pb2_grpc.CacheServiceStub(self._channels[address])
        try:
            stats = await stub.Stats(cache_pb2.StatsRequest(), timeout=STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if address not in self._failing:
                self._failing.add(address)
                _log.warning("cache server Stats failed; its node's cache counts as cold",
                             extra={"node": node, "address": address, "code": exc.code().name})
            self._answers[address] = (now, {})
            return
        self._failing.discard(address)
        held: dict[str, float] = {}
        for job in stats.jobs:
            # Jobs of one dataset see the same entries (or their quota's part): the largest is the node's.
            if job.dataset:
                held[job.dataset] = max(held.get(job.dataset, 0.0), float(job.cached_bytes))
        self._answers[address] = (now, held)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

