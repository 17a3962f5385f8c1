"""The plan in force, as this scheduler last read or committed it, and the per-node views of it
that the agents watch (AllocationService.Watch)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from typing import TypeVar

import grpc

from scheduler.live import convert
from scheduler.live.clients import Clients
from scheduler.live.entries import EntryChanges
from scheduler.live.node_views import Addresses, NodeViews
from scheduler.live.plan_index import PlanIndex
from silod.v1 import common_pb2, metadata_pb2, plan_pb2

T = TypeVar("T")


class PlanStore:
    def __init__(self, clients: Clients) -> None:
        self.clients = clients
        self.latest: plan_pb2.AllocationPlan | None = None
        # One future per waiting watcher, all resolved when a newer plan is set: every watcher
        # wakes in the same turn of the event loop. (An asyncio.Condition hands its lock from
        # waiter to waiter, one turn each: behind a busy loop, 1,000 watchers took most of a
        # second. A set, not callbacks on one shared future: removing a callback, as
        # asyncio.shield and wait_for do when a wait ends, costs O(waiters) each.)
        self._waiters: set[asyncio.Future[None]] = set()
        # The same, for the watchers of one node each: a plan known by its changes wakes those
        # of the nodes whose part it may change only (5,000 watchers woken cost 0.1 s of CPU).
        self._node_waiters: dict[str, set[asyncio.Future[None]]] = {}
        self.specs: dict[str, common_pb2.JobSpec] = {}
        self.agent_addresses = Addresses()
        self.cache_addresses = Addresses()  # node -> its CacheService (peers of multi-node jobs)
        self.node_views = NodeViews()
        self._views: dict[str, plan_pb2.NodePlan] = {}  # node -> its part of the plan of _views_version
        self._views_version = -1
        self._cuts: dict[int, asyncio.Future[dict[str, plan_pb2.NodePlan]]] = {}  # version -> its cut in flight
        self._read_at = -math.inf  # monotonic time the last GetLatestPlan answered
        self._reading: asyncio.Future[plan_pb2.AllocationPlan | None] | None = None
        self._index = PlanIndex()  # job -> its entry in the plan in force (and where it sits)
        # (plan before the one in force, the plan in force, what it changed): see changes_from
        self._changes: tuple[plan_pb2.AllocationPlan | None, plan_pb2.AllocationPlan, EntryChanges | None] | None = None

    async def refresh(self, max_age_s: float = 0.0) -> plan_pb2.AllocationPlan | None:
        """Read the plan in force from the metadata store. ``max_age_s`` > 0 (the watchers'
        periodic check): a read finished less than that ago is good enough, and callers arriving
        while one is in flight share it, so N watchers cost one GetLatestPlan, not N."""
        if max_age_s <= 0:
            return await self._read()
        if time.monotonic() - self._read_at < max_age_s:
            return self.latest
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
            self._reading.add_done_callback(lambda _: setattr(self, "_reading", None))
        return await asyncio.shield(self._reading)

    async def _read(self) -> plan_pb2.AllocationPlan | None:
        known = self.latest_version
        try:
            # The plan held here, if still the latest, comes back as its header: 5,000 entries
            # not copied, sent and parsed again every round.
            plan = await self.clients.md.GetLatestPlan(metadata_pb2.GetLatestPlanRequest(known_version=known))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self._read_at = time.monotonic()
            return self.latest
        self._read_at = time.monotonic()
        if not (known and plan.version == known and not plan.jobs):
            await self.set_latest(plan)
        return self.latest

    async def set_latest(self, plan: plan_pb2.AllocationPlan, *, base: plan_pb2.AllocationPlan | None = None,
                         changes: EntryChanges | None = None) -> None:
        """``plan`` is in force; ``changes``: what it changes of ``base``, the plan in force before
        it, where known (this scheduler's own commits), so that what follows the plan in force
        can follow it by its changes (``changes_from``)."""
        if self.latest is None or plan.version > self.latest.version:
            known = changes is not None and base is not None and base is self.latest
            convert.remember_placements(plan, only=changes.upserts.values() if known and changes.in_place else None)
            changed = self.node_views.follow(plan, base if known else None, changes if known else None)
            if known and self._index.plan is base:
                self._index.follow(base, plan, changes)  # type: ignore[arg-type]  # known: not None
            self._changes = (base, plan, changes) if known else None
            self.latest = plan
            if (changed is not None and not self.agent_addresses.pending() and not self.cache_addresses.pending()
                    and not self.node_views.parts_wait_on_news()):
                woken = [waiters for node in changed if (waiters := self._node_waiters.pop(node, None))]
            else:  # any node's part may differ
                woken, self._node_waiters = list(self._node_waiters.values()), {}
            woken.append(self._waiters)
            self._waiters = set()
            for waiters in woken:
                for waiter in waiters:
                    _resolve(waiter)

    async def wait_newer(self, version: int, timeout: float, node: str | None = None) -> None:
        """Return once a plan newer than ``version`` is in force, or after ``timeout`` seconds.
        ``node``: a watcher of that node's part, which a newer plan that leaves the part as it
        was need not wake (it may sleep through it until its timeout)."""
        if self.latest is not None and self.latest.version > version:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        waiters = self._waiters if node is None else self._node_waiters.setdefault(node, set())
        waiters.add(waiter)
        timer = loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            waiters.discard(waiter)
            if node is not None and not waiters and self._node_waiters.get(node) is waiters:
                del self._node_waiters[node]

    def changes_from(self, plan: plan_pb2.AllocationPlan | None) -> EntryChanges | None:
        """What the plan in force changes of ``plan``, when ``plan`` is the one it replaced and
        the change is known; else None (work it out from the whole plan)."""
        known = self._changes
        if known is None or plan is None or known[0] is not plan or known[1] is not self.latest:
            return None
        return known[2]

    @property
    def latest_version(self) -> int:
        return self.latest.version if self.latest is not None else 0

    def allocation(self, job_id: str) -> plan_pb2.JobAllocation | None:
        found = self.indexed().get(job_id)
        return found[1] if found is not None else None

    def indexed(self) -> PlanIndex:
        """The plan in force by job (every report asks, each cut, and the allocation service's
        patching of the next plan): followed by a plan's changes where they are known, else
        indexed once per plan (scheduler.live.plan_index). Empty while no plan is in force."""
        if self.latest is not None and self._index.plan is not self.latest:
            self._index.index_whole(self.latest)
        return self._index

    def remember_nodes(self, nodes: Iterable[common_pb2.Node]) -> None:
        for n in nodes:
            self.agent_addresses[n.spec.name] = n.spec.agent_address
            self.cache_addresses[n.spec.name] = n.spec.cache_address

    async def spec_of(self, job_id: str) -> common_pb2.JobSpec | None:
        if job_id not in self.specs:
            try:
                job = await self.clients.md.GetJob(metadata_pb2.GetJobRequest(job_id=job_id))
            except grpc.aio.AioRpcError:
                return None
            self.specs[job_id] = job.spec
        return self.specs[job_id]

    async def node_plan(self, plan: plan_pb2.AllocationPlan, node: str) -> plan_pb2.NodePlan:
        """``node``'s part of ``plan``. Every node's part is cut in one pass the first time a
        watcher asks for a version and kept for the others: with N nodes watching, a plan of J
        jobs costs O(J + N) to hand out, not O(J x N)."""
        views = self._views if self._views_version == plan.version else await self._views_of(plan)
        view = views.get(node)
        return view if view is not None else plan_pb2.NodePlan(version=plan.version, node=node, epoch=plan.epoch)

    async def _views_of(self, plan: plan_pb2.AllocationPlan) -> dict[str, plan_pb2.NodePlan]:
        """The watchers woken by one commit share one cut, and all wake when it is done (a lock
        would let them through one turn of the event loop at a time)."""
        cut = self._cuts.get(plan.version)
        if cut is None:
            cut = self._cuts[plan.version] = asyncio.ensure_future(self._cut(plan))
            cut.add_done_callback(lambda _, version=plan.version: self._cuts.pop(version, None))
        return await _outcome_of(cut)

    async def _cut(self, plan: plan_pb2.AllocationPlan) -> dict[str, plan_pb2.NodePlan]:
        entries = None
        if plan is self.latest:
            index = self.indexed()
            entries = self.node_views.entries_to_cut(plan, index, self._addresses_changed(), self.specs)
        await self._learn(plan, entries)
        # Nodes new to it, read just now (left for the next cut if a newer plan came meanwhile).
        if entries is not None and plan is self.latest and (learned := self._addresses_changed()):
            entries = self.node_views.entries_to_cut(plan, index, learned, self.specs)
        views = self.node_views.cut(plan, entries, self.specs, self.agent_addresses, self.cache_addresses)
        if plan.version >= self._views_version:  # an older plan's cut that ends late is not kept
            self._views, self._views_version = views, plan.version
        return views

    def _addresses_changed(self) -> set[str]:
        return self.agent_addresses.take_changed() | self.cache_addresses.take_changed()

    async def _learn(self, plan: plan_pb2.AllocationPlan, entries: Iterable[plan_pb2.JobAllocation] | None) -> None:
        """The specs and addresses the views of ``entries`` of ``plan`` (None: all of them) need
        that this scheduler has not seen yet."""
        for job in plan.jobs if entries is None else entries:
            await self.spec_of(job.job_id)
            for name in convert.job_nodes(job):
                if name not in self.agent_addresses or name not in self.cache_addresses:
                    try:
                        n = await self.clients.md.GetNode(metadata_pb2.GetNodeRequest(node=name))
                        self.agent_addresses[name] = n.spec.agent_address
                        self.cache_addresses[name] = n.spec.cache_address
                    except grpc.aio.AioRpcError:
                        pass


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _outcome_of(shared: asyncio.Future[T]) -> asyncio.Future[T]:
    """A future of ``shared``'s outcome that its awaiter may cancel alone (as asyncio.shield
    gives, without removing a callback from ``shared`` for each of its thousand awaiters)."""
    mine: asyncio.Future[T] = shared.get_loop().create_future()

    def copy(done: asyncio.Future[T]) -> None:
        if mine.done():
            return
        if done.cancelled():
            mine.cancel()
        elif done.exception() is not None:
            mine.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            mine.set_result(done.result())

    shared.add_done_callback(copy)
    return mine
