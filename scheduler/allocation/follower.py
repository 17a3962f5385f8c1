"""The plan in force as an allocation server holds it: fed by the leading scheduler's PlanFeedService,
fenced by epochs, cut into node parts (scheduler.live.plans.PlanStore) for the nodes' watches.

Fencing, wherever plans are served:

* a feed that declares an older leader epoch than the newest one any feed declared is a deposed
  leader's: nothing it sends is taken in (``silod_allocation_plans_refused_total{reason="epoch"}``);
* a plan whose own epoch is older than the newest plan epoch taken in is refused as the nodes
  refuse it (worker_agent/node_protocol.epoch_refusal);
* a plan no newer than the one held is ignored; changes based on another plan than the one held
  end the feed, which is opened again and starts with the whole plan.

The metadata store fences commits by epoch too, so the store's latest plan, read once at start,
is the plan in force: an allocation server started while no scheduler leads serves it at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable

import grpc

from scheduler.allocation import metrics
from scheduler.live.entries import EntryChanges
from scheduler.live.plan_index import applied_in_place
from scheduler.live.plans import PlanStore
from scheduler.plan_changes import PlanChanges
from silod.v1 import allocation_pb2, metadata_pb2, plan_pb2
from worker_agent.node_protocol import epoch_refusal

_log = logging.getLogger("silod.allocation")

SPEC_BATCH = 1000  # job ids per ListJobs when learning a plan's specs (the metadata service's limit)
NODES_REFRESH_S = 5.0  # the nodes' addresses are read again before a plan at most this often


class FeedOutOfStep(RuntimeError):
    """Changes based on another plan than the one held: the feed is opened again (whole plan first)."""


class FeedLeadership:
    """What the nodes' watches (scheduler.live.watch) read as the server's leadership: it serves
    once it holds a plan, and keeps serving it while schedulers come and go (the plan in force
    stays in force); ``epoch`` is the newest leader epoch a feed declared (the watches' heartbeat)."""

    enabled = True

    def __init__(self) -> None:
        self.epoch = 0
        self.serving = False
        self._serving = asyncio.Event()

    @property
    def leading(self) -> bool:
        return self.serving

    def serve(self) -> None:
        if not self.serving:
            self.serving = True
            self._serving.set()

    async def until_leading(self) -> None:
        await self._serving.wait()

    def describe_leader(self) -> str:
        return ("this allocation server holds no plan yet: no scheduler has fed it one (none leads, or none is "
                "reachable)")


class PlanFollower:
    """What ``scheduler.live.watch.watch_node`` calls as its core, and the feed's ``offer``."""

    def __init__(self, plans: PlanStore) -> None:
        self.plans = plans
        self.leadership = FeedLeadership()
        # The leader's, once a feed declared it. Until then a node's heartbeat is not checked
        # against any: a default here refused nodes that the leader's own timeout admits.
        self.node_timeout_s: float | None = None
        self.plan_epoch = 0  # the newest epoch of a plan taken in
        self._nodes_read_at = -math.inf  # monotonic time of the last ListNodes
        self._fed_addresses = False  # a feed sent the nodes' addresses: no ListNodes before a plan

    # ---- read by the watches -----------------------------------------------------------------
    @property
    def latest(self) -> plan_pb2.AllocationPlan | None:
        return self.plans.latest

    @property
    def latest_version(self) -> int:
        return self.plans.latest_version

    async def refresh_latest(self, max_age_s: float = 0.0) -> plan_pb2.AllocationPlan | None:
        return self.plans.latest  # the feed keeps it current; nothing to read

    async def wait_newer(self, version: int, timeout: float, node: str | None = None) -> None:
        await self.plans.wait_newer(version, timeout, node)

    async def node_plan(self, plan: plan_pb2.AllocationPlan, node: str) -> plan_pb2.NodePlan:
        return await self.plans.node_plan(plan, node)

    # ---- fed ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """The store's latest plan and every node's addresses, read once."""
        try:
            await self._read_nodes()
            plan = await self.plans.refresh()
        except grpc.aio.AioRpcError as exc:
            _log.warning("metadata unreachable at start; waiting for a scheduler's feed",
                         extra={"code": exc.code().name, "details": exc.details()})
            return
        if plan is not None:
            await self._take(plan, "store")

    async def offer(self, update: allocation_pb2.PlanFeedUpdate) -> None:
        leadership = self.leadership
        if update.epoch < leadership.epoch:
            metrics.PLANS_REFUSED.labels("epoch").inc()
            _log.warning("feed of a deposed scheduler ignored", extra={"epoch": update.epoch,
                                                                       "newest_epoch": leadership.epoch})
            return
        if update.epoch > leadership.epoch:
            leadership.epoch = update.epoch
            metrics.LEADER_EPOCH.set(update.epoch)
        if update.heartbeat:
            if update.node_timeout_s > 0:
                self.node_timeout_s = update.node_timeout_s
            return
        plan = update.plan
        refusal = epoch_refusal(plan, self.plan_epoch)  # type: ignore[arg-type]  # reads .epoch only
        if refusal:
            metrics.PLANS_REFUSED.labels("epoch").inc()
            _log.warning("plan from an older epoch refused", extra={"version": plan.version, "reason": refusal})
            return
        self._absorb(update)
        if plan.version <= self.latest_version:
            return  # held already (the feed's first plan after a reconnect, or another feed's)
        if update.HasField("changes"):
            held = self.plans.latest
            if held is None or update.changes.base_version != held.version:
                metrics.PLANS_REFUSED.labels("out_of_step").inc()
                raise FeedOutOfStep(f"changes of plan {update.changes.base_version} offered, plan "
                                    f"{held.version if held is not None else 0} held")
            upserts = {job.job_id: job for job in update.changes.jobs}
            removals = tuple(update.changes.removed_job_ids)
            previous = {job_id: entry for job_id in (*upserts, *removals)
                        if (entry := self.plans.allocation(job_id)) is not None}
            built = applied_in_place(self.plans.indexed(), plan, update.changes.jobs, removals)
            if built is None:  # many removals: rebuilt instead
                built = _applied(held, plan, update.changes)
            await self._take(built, "feed", new_jobs=update.changes.jobs,
                             base=held, changes=EntryChanges(upserts, removals, previous, in_place=True))
            for job_id in update.changes.removed_job_ids:  # ended: its spec is not needed again (a job
                self.plans.specs.pop(job_id, None)  # that comes back comes with its spec)
            return
        await self._take(plan, "feed")
        in_plan = {job.job_id for job in plan.jobs}
        for job_id in [j for j in self.plans.specs if j not in in_plan]:  # kept only while in the plan
            del self.plans.specs[job_id]

    def _absorb(self, update: allocation_pb2.PlanFeedUpdate) -> None:
        """What the plan's node parts need that the feed sent with it: the plan is then served
        without a call to the metadata service first."""
        for job_id, spec in update.specs.items():
            self.plans.specs[job_id] = spec
        if update.node_addresses:
            self._fed_addresses = True
            for address in update.node_addresses:
                self.plans.agent_addresses[address.node] = address.agent_address
                self.plans.cache_addresses[address.node] = address.cache_address

    async def _read_nodes(self) -> None:
        nodes = await self.plans.clients.md.ListNodes(metadata_pb2.ListNodesRequest())
        self.plans.remember_nodes(nodes.nodes)
        self._nodes_read_at = time.monotonic()

    async def _take(self, plan: plan_pb2.AllocationPlan, source: str,
                    new_jobs: Iterable[plan_pb2.JobAllocation] | None = None,
                    base: plan_pb2.AllocationPlan | None = None, changes: EntryChanges | None = None) -> None:
        # Whatever the feed did not send is read before the plan is served: the specs of jobs
        # new to this server (``new_jobs``: those of the plan's changes; None: all of them) and,
        # from a scheduler whose feed sends no addresses, the nodes' (a rank's MASTER_ADDR, a
        # peer's cache; an agent restarted elsewhere registers a new one, which the plans after
        # it must carry).
        reads = [self._learn_specs(job.job_id for job in (plan.jobs if new_jobs is None else new_jobs))]
        if not self._fed_addresses and time.monotonic() - self._nodes_read_at >= NODES_REFRESH_S:
            reads.append(self._read_nodes())
        for failed in await asyncio.gather(*reads, return_exceptions=True):  # side by side: the plan waits for one
            if isinstance(failed, grpc.aio.AioRpcError):
                pass  # the addresses known stay; read again at the next plan
            elif isinstance(failed, BaseException):
                raise failed
        if plan.version <= self.latest_version:
            return
        self.plan_epoch = max(self.plan_epoch, plan.epoch)
        # By its changes where they were fed (the nodes' parts are then cut again where they changed only).
        await self.plans.set_latest(plan, base=base, changes=changes)
        metrics.PLAN_VERSION.set(plan.version)
        metrics.PLANS_TAKEN.labels(source).inc()
        self.leadership.serve()

    async def _learn_specs(self, job_ids: Iterable[str]) -> None:
        """The specs of the plan's jobs not known yet, a thousand per ListJobs (the node parts
        need them; one GetJob each would take tens of seconds for a plan of 20,000 jobs)."""
        missing = [j for j in job_ids if j not in self.plans.specs]
        for start in range(0, len(missing), SPEC_BATCH):
            try:
                page = await self.plans.clients.md.ListJobs(metadata_pb2.ListJobsRequest(
                    job_ids=missing[start:start + SPEC_BATCH], page_size=SPEC_BATCH))
            except grpc.aio.AioRpcError:
                return  # the cut asks for each missing one (PlanStore.spec_of)
            for job in page.jobs:
                self.plans.specs[job.id] = job.spec


def _applied(base: plan_pb2.AllocationPlan, header: plan_pb2.AllocationPlan,
             changes: plan_pb2.PlanChanges) -> plan_pb2.AllocationPlan:
    """``header`` with its jobs: ``changes`` applied to ``base``'s (scheduler.plan_changes' rule)."""
    entries = PlanChanges(upserts={j.job_id: j for j in changes.jobs},
                          removals=tuple(changes.removed_job_ids)).apply({j.job_id: j for j in base.jobs})
    plan = plan_pb2.AllocationPlan()
    plan.CopyFrom(header)
    plan.jobs.extend(entries.values())
    return plan
