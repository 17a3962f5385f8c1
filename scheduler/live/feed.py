"""PlanFeedService: the leading scheduler's side of the allocation servers (``silod allocation``, see
scheduler/allocation/), which serve the nodes' Watch, Ack and ReportTasks apart from the rounds.

* ``WatchPlans``: each committed plan once per allocation server. A standby holds the stream until it
  leads (as a node's held Watch); the leader declares its epoch and node timeout first (a
  heartbeat), then sends the plan in force whole (its header alone when the follower holds it),
  then each newer plan as what it changes of the plan sent before it (``PlanChanges``, the same
  rule as the commits'). With each plan go what its node parts need that the follower may lack:
  the specs of the jobs new to the stream and the nodes' addresses not yet sent (or changed), so
  that the follower serves the plan without asking the metadata service first. A leader that
  loses the lease ends the stream at its next wake.
* ``Relay``: the acks and task reports of many nodes in one call, taken in as Ack and ReportTasks
  would be (releases, the acked-version metric, the reports' state moves). The acked versions are
  written to the store by the allocation server, not here. A scheduler that is not leading, or
  leads at an older epoch than the caller has seen, takes in nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import grpc

from scheduler.live import metrics
from scheduler.live.node_requests import check_report_tasks, counts_as_node_ack
from scheduler.live.watch import WATCH_REFRESH_AGE_S, require_leader
from scheduler.plan_changes import changes_between
from services.runtime import downstream
from services.runtime.errors import FailedPrecondition, ServiceError
from silod.v1 import allocation_pb2, allocation_pb2_grpc, common_pb2, plan_pb2

_log = logging.getLogger("silod.scheduler")

FEED_REFRESH_S = 5.0  # how often a quiet feed checks the store for plans committed by someone else


class PlanFeedService(allocation_pb2_grpc.PlanFeedServiceServicer):
    def __init__(self, core: Any, *, node_timeout_s: float, refresh_s: float = FEED_REFRESH_S) -> None:
        self.core = core
        self.node_timeout_s = node_timeout_s
        self.refresh_s = refresh_s
        # (base version, version) -> the changes between them and the specs of the jobs they add:
        # the followers share one diff a plan.
        self._changes: dict[tuple[int, int], tuple[plan_pb2.PlanChanges, dict[str, common_pb2.JobSpec]]] = {}

    def _epoch(self) -> int:
        leadership = getattr(self.core, "leadership", None)
        return leadership.epoch if leadership is not None and leadership.enabled else 0

    async def WatchPlans(self, request, context):  # noqa: N802
        leadership = getattr(self.core, "leadership", None)
        if leadership is not None:
            await leadership.until_leading()  # a standby: held until it wins the lease
        require_leader(self.core)
        epoch = self._epoch()
        _log.info("allocation server following", extra={"server": request.server, "epoch": epoch})
        yield allocation_pb2.PlanFeedUpdate(heartbeat=True, epoch=epoch, node_timeout_s=self.node_timeout_s)
        await downstream.forward(self.core.refresh_latest(max_age_s=WATCH_REFRESH_AGE_S), "metadata GetLatestPlan",
                                 None)
        loop = asyncio.get_running_loop()
        sent: plan_pb2.AllocationPlan | None = None
        known = request.known_version
        addresses: dict[str, tuple[str, str]] = {}  # node -> (agent, cache) address as sent on this stream
        refresh_at = loop.time() + self.refresh_s
        while True:
            plan = self.core.latest
            if plan is not None and (sent is None or plan.version > sent.version):
                update = self._update(plan, sent, known, epoch)
                update.node_addresses.extend(self._new_addresses(addresses))
                yield update
                sent, known = plan, 0
            await self.core.wait_newer(sent.version if sent is not None else 0, self.refresh_s)
            require_leader(self.core)  # deposed: the allocation server follows the new leader
            epoch = self._epoch()
            if loop.time() >= refresh_at:  # committed by someone else (CommitPlan)
                await downstream.forward(self.core.refresh_latest(max_age_s=WATCH_REFRESH_AGE_S),
                                         "metadata GetLatestPlan", None)
                refresh_at = loop.time() + self.refresh_s

    def _update(self, plan: plan_pb2.AllocationPlan, sent: plan_pb2.AllocationPlan | None, known: int,
                epoch: int) -> allocation_pb2.PlanFeedUpdate:
        header = _header(plan)
        if sent is None and known == plan.version:  # the follower holds it: the header says it is still in force
            return allocation_pb2.PlanFeedUpdate(epoch=epoch, plan=header,
                                                 changes=plan_pb2.PlanChanges(base_version=plan.version))
        if sent is None:
            return allocation_pb2.PlanFeedUpdate(epoch=epoch, plan=plan, specs=self._specs_of(plan.jobs))
        key = (sent.version, plan.version)
        cached = self._changes.get(key)
        if cached is None:
            # This scheduler's own commits say what they changed; any other pair of plans is compared whole.
            known = self.core.changes_from(sent) if hasattr(self.core, "changes_from") else None
            if known is not None:
                upserts, removals, had = known.upserts, known.removals, known.previous
            else:
                had = {j.job_id: j for j in sent.jobs}
                diff = changes_between(had, {j.job_id: j for j in plan.jobs})
                upserts, removals = diff.upserts, diff.removals
            changes = plan_pb2.PlanChanges(base_version=sent.version, jobs=list(upserts.values()),
                                           removed_job_ids=list(removals))
            arrived = self._specs_of(j for j in upserts.values() if j.job_id not in had)
            if len(self._changes) >= 8:
                self._changes.pop(next(iter(self._changes)))
            cached = self._changes[key] = (changes, arrived)
        changes, arrived = cached
        return allocation_pb2.PlanFeedUpdate(epoch=epoch, plan=header, changes=changes, specs=arrived)

    def _specs_of(self, jobs: Iterable[plan_pb2.JobAllocation]) -> dict[str, common_pb2.JobSpec]:
        """The specs this scheduler holds of ``jobs`` (every job of its last snapshot; one missing,
        e.g. before a new leader's first round, is read by the follower from the store)."""
        specs = self.core.specs
        return {j.job_id: specs[j.job_id] for j in jobs if j.job_id in specs}

    def _new_addresses(self, sent: dict[str, tuple[str, str]]) -> list[allocation_pb2.FeedNodeAddress]:
        """The nodes' addresses not yet sent as they are now on a stream that sent ``sent`` (updated)."""
        agents, caches = self.core.agent_addresses, self.core.cache_addresses
        fresh = []
        for node, agent in agents.items():
            now = (agent, caches.get(node, ""))
            if sent.get(node) != now:
                sent[node] = now
                fresh.append(allocation_pb2.FeedNodeAddress(node=node, agent_address=now[0], cache_address=now[1]))
        return fresh

    async def Relay(self, request, context):  # noqa: N802
        require_leader(self.core)  # releases and job states live with the leader only
        if request.epoch > self._epoch():
            raise FailedPrecondition(f"epoch {request.epoch} is newer than this scheduler's ({self._epoch()}): "
                                     "another scheduler leads now", field="epoch")
        released = False
        for ack in request.acks:
            if not ack.node:
                continue
            if ack.released_jobs and self.core.release(ack.node, ack.released_jobs):
                released = True
            if counts_as_node_ack(ack):
                metrics.node_acked(ack.node, ack.version)
        if released:
            self.core.trigger("release")

        async def one(report: allocation_pb2.ReportTasksRequest) -> allocation_pb2.RelayOutcome:
            try:
                check_report_tasks(report)
                exits = await downstream.forward(self.core.report_tasks(report), "metadata (task reports)", None)
                return allocation_pb2.RelayOutcome(acknowledged_exits=exits)
            except ServiceError as exc:
                return allocation_pb2.RelayOutcome(error_code=exc.code.name, error=str(exc))
            except grpc.aio.AioRpcError as exc:
                return allocation_pb2.RelayOutcome(error_code=exc.code().name, error=exc.details() or "")

        outcomes = await asyncio.gather(*(one(r) for r in request.reports))
        return allocation_pb2.RelayResponse(reports=outcomes, latest_version=self.core.latest_version)


def _header(plan: plan_pb2.AllocationPlan) -> plan_pb2.AllocationPlan:
    """Every field of ``plan`` but its jobs (not copied only to be dropped: 5,000 entries a plan)."""
    header = plan_pb2.AllocationPlan()
    for field, value in plan.ListFields():
        if field.name == "jobs":
            continue
        target = getattr(header, field.name)
        if field.is_repeated:
            target.extend(value)
        elif field.message_type is not None:
            target.CopyFrom(value)
        else:
            setattr(header, field.name, value)
    return header
