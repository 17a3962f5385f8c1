"""The plan in force, as this scheduler last read or committed it, and the per-node views of it
that the agents watch (AllocationService.Watch)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable

import grpc

from scheduler.live import convert
from scheduler.live.clients import Clients
from silod.v1 import common_pb2, metadata_pb2, plan_pb2


class PlanStore:
    def __init__(self, clients: Clients) -> None:
        self.clients = clients
        self.latest: plan_pb2.AllocationPlan | None = None
        self._changed = asyncio.Condition()
        self.specs: dict[str, common_pb2.JobSpec] = {}
        self.agent_addresses: dict[str, str] = {}
        self.cache_addresses: dict[str, str] = {}  # node -> its CacheService (peers of multi-node jobs)
        self._views: dict[str, plan_pb2.NodePlan] = {}  # node -> its part of the plan of _views_version
        self._views_version = -1
        self._cutting = asyncio.Lock()
        self._read_at = -math.inf  # monotonic time the last GetLatestPlan answered
        self._reading: asyncio.Future[plan_pb2.AllocationPlan | None] | None = None
        self._index: dict[str, plan_pb2.JobAllocation] = {}  # job -> its entry in the plan of _index_version
        self._index_version = -1

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

    async def set_latest(self, plan: plan_pb2.AllocationPlan) -> None:
        if self.latest is None or plan.version > self.latest.version:
            convert.remember_placements(plan)
            self.latest = plan
            async with self._changed:
                self._changed.notify_all()

    async def wait_newer(self, version: int, timeout: float) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.latest is not None and self.latest.version > version), timeout
                )
            except asyncio.TimeoutError:
                pass

    @property
    def latest_version(self) -> int:
        return self.latest.version if self.latest is not None else 0

    def allocation(self, job_id: str) -> plan_pb2.JobAllocation | None:
        if self.latest is None:
            return None
        if self._index_version != self.latest.version:  # every report asks: index the plan once
            self._index = {job.job_id: job for job in self.latest.jobs}
            self._index_version = self.latest.version
        return self._index.get(job_id)

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
        if self._views_version != plan.version:
            async with self._cutting:  # the watchers woken by one commit wait for one cut
                if self._views_version != plan.version:
                    await self._learn(plan)
                    self._views = convert.node_plans(plan, self.specs, self.agent_addresses, self.cache_addresses)
                    self._views_version = plan.version
        view = self._views.get(node)
        return view if view is not None else plan_pb2.NodePlan(version=plan.version, node=node, epoch=plan.epoch)

    async def _learn(self, plan: plan_pb2.AllocationPlan) -> None:
        """The specs and addresses a plan's views need that this scheduler has not seen yet."""
        for job in plan.jobs:
            await self.spec_of(job.job_id)
            for name in convert.job_nodes(job):
                if name not in self.agent_addresses or name not in self.cache_addresses:
                    try:
                        n = await self.clients.md.GetNode(metadata_pb2.GetNodeRequest(node=name))
                        self.agent_addresses[name] = n.spec.agent_address
                        self.cache_addresses[name] = n.spec.cache_address
                    except grpc.aio.AioRpcError:
                        pass
