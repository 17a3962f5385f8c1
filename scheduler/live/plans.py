"""The plan in force, as this scheduler last read or committed it, and the per-node views of it
that the agents watch (AllocationService.Watch)."""

from __future__ import annotations

import asyncio
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

    async def refresh(self) -> plan_pb2.AllocationPlan | None:
        try:
            plan = await self.clients.md.GetLatestPlan(metadata_pb2.GetLatestPlanRequest())
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return self.latest
        await self.set_latest(plan)
        return self.latest

    async def set_latest(self, plan: plan_pb2.AllocationPlan) -> None:
        if self.latest is None or plan.version > self.latest.version:
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
        for job in self.latest.jobs:
            if job.job_id == job_id:
                return job
        return None

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
        return convert.node_plan(plan, node, self.specs, self.agent_addresses, self.cache_addresses)
