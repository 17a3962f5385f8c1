"""Allocation plans: versions 1, 2, 3 ... with exactly one winner per version."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from silod.v1 import plan_pb2

from services.metadata import convert, paging
from services.metadata.clock import from_timestamp, to_timestamp, utc_now
from services.metadata.database import Database
from services.metadata.models import Plan
from services.metadata.store.leadership import epoch_now
from services.metadata.validation.common import check_int
from services.metadata.store.plan_order import EntryOrder
from services.metadata.validation.plan_holders import JobHolders
from services.metadata.validation.plans import check_plan, check_plan_changes
from services.runtime.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound

# A plan is stored whole at least every this many versions (and whenever its changes are half of
# it or more); in between, as its changes. Reading a version applies at most this many rows.
CHECKPOINT_EVERY = 64
REMOVED_KEY = "removed_job_ids"  # in a row of changes: the jobs the plan drops


class _Everything:
    def __contains__(self, item: object) -> bool:
        return True


_EVERY_JOB = _Everything()


class PlanStore:
    def __init__(self, db: Database) -> None:
        self._db = db
        # The latest plan as a message, with the (version, created_at) it was stored under: a
        # scheduler reads the latest plan every round, and parsing its JSON (1,000 jobs: tens
        # of ms of pure-Python json_format) cost more than the round's other reads. Plans are
        # never changed once committed, so the key read from the table tells whether it is current.
        self._latest: tuple[int, datetime, plan_pb2.AllocationPlan] | None = None
        self._latest_header: tuple[plan_pb2.AllocationPlan, plan_pb2.AllocationPlan] | None = None  # see _header
        # What the jobs of the latest plan committed here hold, so that a commit of changes
        # checks what they change (validation.plan_holders); one committer at a time moves it.
        self._holders: JobHolders | None = None
        self._holders_lock = threading.Lock()
        # Where each entry of the latest plan committed here sits (plan_order): the next plan
        # committed as changes is made from it.
        self._order: EntryOrder | None = None

    def _remember(self, version: int, created_at: datetime, plan: plan_pb2.AllocationPlan) -> None:
        # Last writer wins: a stale entry is only a cache miss, since readers check the key.
        self._latest = (version, created_at, plan)

    @staticmethod
    def _copy(plan: plan_pb2.AllocationPlan) -> plan_pb2.AllocationPlan:
        copy = plan_pb2.AllocationPlan()
        copy.CopyFrom(plan)
        return copy

    def commit(self, plan: plan_pb2.AllocationPlan, changes: plan_pb2.PlanChanges | None = None, *,
               header_only: bool = False) -> plan_pb2.AllocationPlan:
        """Commit ``plan`` as the next version; with ``changes``, ``plan`` holds every field but
        jobs, and its jobs are ``changes`` applied to plan ``changes.base_version``. The whole
        plan committed is returned either way (``header_only``: every field of it but jobs)."""
        if changes is not None:
            if plan.jobs:
                raise InvalidArgument("must be empty when changes are given (the plan's jobs are the changes applied "
                                      "to the base plan)", field="plan.jobs")
            check_plan_changes(changes)
            if changes.base_version != plan.version - 1:
                raise InvalidArgument(f"must be the plan's version - 1 ({plan.version - 1}), got {changes.base_version}",
                                      field="changes.base_version")
        else:
            check_plan(plan)
        created_at = from_timestamp(plan.created_at) if plan.HasField("created_at") else utc_now()
        try:
            with self._db.write() as session:
                # Fencing: a deposed leader (its epoch older than the lease's) cannot commit. The
                # lease row stays share-locked until this commit ends, so no takeover interleaves.
                current = epoch_now(session, lock=True)
                if plan.epoch < current:
                    raise FailedPrecondition(
                        f"plan epoch {plan.epoch} is older than the scheduler lease's epoch {current}: "
                        "this scheduler is no longer the leader", field="plan.epoch")
                latest = session.scalar(select(func.max(Plan.version))) or 0
                if plan.version != latest + 1:
                    raise _stale(plan.version, latest)
                header = self._copy(plan)
                header.created_at.CopyFrom(to_timestamp(created_at))
                if changes is None:
                    stored, row_json, base_version = header, convert.to_json(header), None
                else:
                    base = self._whole(session, changes.base_version)
                    stored, order = self._order_of(base).apply(base, header, changes.jobs, changes.removed_job_ids)
                    holders, changed = self._check_changes(base, header, changes, stored)
                    if plan.version % CHECKPOINT_EVERY and 2 * (len(changes.jobs) + len(changes.removed_job_ids)) < len(stored.jobs):
                        row_json, base_version = changes_to_json(header, changes), changes.base_version
                    else:  # a whole plan now and then, so that reading any version applies few changes
                        row_json, base_version = convert.to_json(stored), None
                session.add(Plan(version=plan.version, created_at=created_at, policy=plan.policy, plan=row_json,
                                 base_version=base_version))
                session.flush()
        except IntegrityError:
            # Another committer inserted this version after we read the latest one. The
            # primary key decides, in any process and on either database.
            raise _stale(plan.version, plan.version) from None
        self._remember(plan.version, created_at, stored)
        if changes is not None:
            self._follow_holders(holders, changed, plan.version)
            self._order = order
        return header if header_only else self._copy(stored)

    def _order_of(self, base: plan_pb2.AllocationPlan) -> EntryOrder:
        order = self._order  # read once: a concurrent commit may replace it
        if order is None or order.version != base.version or len(order.order) != len(base.jobs):
            order = EntryOrder.of(base)
        return order

    def _check_changes(self, base: plan_pb2.AllocationPlan, header: plan_pb2.AllocationPlan,
                       changes: plan_pb2.PlanChanges, stored: plan_pb2.AllocationPlan) -> tuple[JobHolders, Any]:
        """Refuse ``stored`` (``changes`` applied to ``base``) as the whole check would. Every
        entry's fields are checked by now: the base's when it was committed, the changed ones by
        check_plan_changes; what is left is the whole plan's invariants, checked by what the
        changes touch where that is sure to agree with the whole check (plan_holders)."""
        with self._holders_lock:
            holders = self._holders
            if holders is None or holders.version != base.version:
                holders = self._holders = JobHolders.of(base)
            changed = holders.after(header, changes)
        if changed is None:
            check_plan(stored, checked=_EVERY_JOB)  # refused with every problem, or sound after all
        return holders, changed

    def _follow_holders(self, holders: JobHolders, changed: Any, version: int) -> None:
        with self._holders_lock:
            if changed is not None and self._holders is holders and holders.version == version - 1:
                holders.apply(changed, version)
            else:  # made again from the plan when next needed
                self._holders = None

    def _whole(self, session: Session, version: int) -> plan_pb2.AllocationPlan:
        """Plan ``version`` whole (the store's own message: copy before handing it out)."""
        cached = self._latest
        if cached is not None and cached[0] == version:
            return cached[2]
        return whole_plans(session, [version])[version]

    def latest(self, known_version: int = 0) -> plan_pb2.AllocationPlan:
        """The latest plan; its header only (no jobs) when it is ``known_version``."""
        check_int(known_version, "known_version", minimum=0, maximum=2**63 - 1)
        with self._db.read() as session:
            head = session.execute(
                select(Plan.version, Plan.created_at).order_by(Plan.version.desc()).limit(1)).one_or_none()
            if head is None:
                raise NotFound("no plan has been committed yet")
            cached = self._latest
            if cached is None or cached[0] != head.version or cached[1] != head.created_at:
                cached = (head.version, head.created_at, whole_plans(session, [head.version])[head.version])
                self._remember(*cached)
        if head.version == known_version:
            return self._header(cached[2])
        return self._copy(cached[2])

    def _header(self, plan: plan_pb2.AllocationPlan) -> plan_pb2.AllocationPlan:
        """``plan`` without its jobs, made once per plan (the latest is asked for every round)."""
        kept = self._latest_header
        if kept is None or kept[0] is not plan:
            header = self._copy(plan)
            del header.jobs[:]
            kept = self._latest_header = (plan, header)
        return self._copy(kept[1])

    def get(self, version: int) -> plan_pb2.AllocationPlan:
        check_int(version, "version", minimum=1, maximum=2**63 - 1)
        with self._db.read() as session:
            if session.get(Plan, version) is None:
                raise NotFound(f"no plan with version {version}", field="version")
            return whole_plans(session, [version])[version]

    def list(self, page_size: int = 0, page_token: str = "") -> tuple[list[plan_pb2.AllocationPlan], str]:
        """Newest first."""
        size = paging.PLANS.size(page_size)
        before = paging.decode_token(page_token, "plans", int)
        query = select(Plan.version).order_by(Plan.version.desc()).limit(size + 1)
        if before:
            query = query.where(Plan.version < before[0])
        with self._db.read() as session:
            versions = list(session.scalars(query))
            page = versions[:size]
            plans = whole_plans(session, page)
        next_token = paging.encode_token("plans", page[-1]) if len(versions) > size else ""
        return [plans[v] for v in page], next_token


def apply_changes(base: plan_pb2.AllocationPlan, header: plan_pb2.AllocationPlan,
                  jobs: Iterable[plan_pb2.JobAllocation], removed: Iterable[str]) -> plan_pb2.AllocationPlan:
    """``header`` (every field but jobs) with the jobs of ``base`` changed: the base's entries in
    their order, changed ones in place, removed ones dropped, new ones after them in the order given
    (the rule of scheduler.plan_changes, on the messages)."""
    plan = plan_pb2.AllocationPlan()
    plan.CopyFrom(header)
    del plan.jobs[:]
    changed = {job.job_id: job for job in jobs}
    gone = set(removed)
    plan.jobs.extend([changed.pop(job.job_id, job) for job in base.jobs if job.job_id not in gone])
    plan.jobs.extend(changed.values())
    return plan


def changes_to_json(header: plan_pb2.AllocationPlan, changes: plan_pb2.PlanChanges) -> dict[str, Any]:
    """A plan row that holds changes: the header with the changed entries as its jobs, and the
    removed job ids under a key of their own."""
    row = plan_pb2.AllocationPlan()
    row.CopyFrom(header)
    del row.jobs[:]
    row.jobs.extend(changes.jobs)
    data = convert.to_json(row)
    data[REMOVED_KEY] = list(changes.removed_job_ids)
    return data


def whole_plans(session: Session, versions: Iterable[int]) -> dict[int, plan_pb2.AllocationPlan]:
    """Plans ``versions`` whole: each row of changes applied, in order, to the whole plan at or
    below it (at most CHECKPOINT_EVERY rows to read per version)."""
    wanted = set(versions)
    if not wanted:
        return {}
    low, high = min(wanted), max(wanted)
    start = session.scalar(select(func.max(Plan.version)).where(Plan.version <= low, Plan.base_version.is_(None)))
    if start is None:  # retention keeps the oldest plan whole, so this is a damaged store
        raise NotFound(f"plan {low} is stored as changes of a plan that is gone", field="version")
    out: dict[int, plan_pb2.AllocationPlan] = {}
    plan: plan_pb2.AllocationPlan | None = None
    for row in session.execute(select(Plan.version, Plan.base_version, Plan.plan)
                               .where(Plan.version >= start, Plan.version <= high).order_by(Plan.version)):
        if row.base_version is None:
            plan = convert.plan_to_proto(row)
        else:
            if plan is None or plan.version != row.base_version:
                raise NotFound(f"plan {row.version} is stored as changes of plan {row.base_version}, which is gone",
                               field="version")
            data = dict(row.plan)
            removed = data.pop(REMOVED_KEY, [])
            delta = convert.from_json(data, plan_pb2.AllocationPlan)
            plan = apply_changes(plan, delta, delta.jobs, removed)
        if row.version in wanted:
            out[row.version] = plan
    return out


def _stale(version: int, latest: int) -> Aborted:
    return Aborted(
        f"expected {latest + 1} (latest committed is {latest}), got {version}; re-read the latest plan and retry",
        field="plan.version",
    )
