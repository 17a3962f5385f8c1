"""Allocation plans: versions 1, 2, 3 ... with exactly one winner per version."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from silod.v1 import plan_pb2

from services.metadata import convert, paging
from services.metadata.clock import from_timestamp, to_timestamp, utc_now
from services.metadata.database import Database
from services.metadata.models import Plan
from services.metadata.store.leadership import epoch_now
from services.metadata.validation.common import check_int
from services.metadata.validation.plans import check_plan
from services.runtime.errors import Aborted, FailedPrecondition, NotFound


class PlanStore:
    def __init__(self, db: Database) -> None:
        self._db = db
        # The latest plan as a message, with the (version, created_at) it was stored under: a
        # scheduler reads the latest plan every round, and parsing its JSON (1,000 jobs: tens
        # of ms of pure-Python json_format) cost more than the round's other reads. Plans are
        # never changed once committed, so the key read from the table tells whether it is current.
        self._latest: tuple[int, datetime, plan_pb2.AllocationPlan] | None = None

    def _remember(self, version: int, created_at: datetime, plan: plan_pb2.AllocationPlan) -> None:
        # Last writer wins: a stale entry is only a cache miss, since readers check the key.
        self._latest = (version, created_at, plan)

    @staticmethod
    def _copy(plan: plan_pb2.AllocationPlan) -> plan_pb2.AllocationPlan:
        copy = plan_pb2.AllocationPlan()
        copy.CopyFrom(plan)
        return copy

    def commit(self, plan: plan_pb2.AllocationPlan) -> plan_pb2.AllocationPlan:
        check_plan(plan)
        stored = plan_pb2.AllocationPlan()
        stored.CopyFrom(plan)
        created_at = from_timestamp(plan.created_at) if plan.HasField("created_at") else utc_now()
        stored.created_at.CopyFrom(to_timestamp(created_at))
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
                session.add(Plan(version=plan.version, created_at=created_at, policy=plan.policy, plan=convert.to_json(stored)))
                session.flush()
        except IntegrityError:
            # Another committer inserted this version after we read the latest one. The
            # primary key decides, in any process and on either database.
            raise _stale(plan.version, plan.version) from None
        self._remember(plan.version, created_at, stored)
        return self._copy(stored)

    def latest(self) -> plan_pb2.AllocationPlan:
        with self._db.read() as session:
            head = session.execute(
                select(Plan.version, Plan.created_at).order_by(Plan.version.desc()).limit(1)).one_or_none()
            if head is None:
                raise NotFound("no plan has been committed yet")
            cached = self._latest
            if cached is not None and cached[0] == head.version and cached[1] == head.created_at:
                return self._copy(cached[2])
            row = session.get(Plan, head.version)
            plan = convert.plan_to_proto(row)
            created_at = row.created_at
        self._remember(head.version, created_at, plan)
        return self._copy(plan)

    def get(self, version: int) -> plan_pb2.AllocationPlan:
        check_int(version, "version", minimum=1, maximum=2**63 - 1)
        with self._db.read() as session:
            row = session.get(Plan, version)
            if row is None:
                raise NotFound(f"no plan with version {version}", field="version")
            return convert.plan_to_proto(row)

    def list(self, page_size: int = 0, page_token: str = "") -> tuple[list[plan_pb2.AllocationPlan], str]:
        """Newest first."""
        size = paging.PLANS.size(page_size)
        before = paging.decode_token(page_token, "plans", int)
        query = select(Plan).order_by(Plan.version.desc()).limit(size + 1)
        if before:
            query = query.where(Plan.version < before[0])
        with self._db.read() as session:
            rows = list(session.scalars(query))
        page = rows[:size]
        next_token = paging.encode_token("plans", page[-1].version) if len(rows) > size else ""
        return [convert.plan_to_proto(row) for row in page], next_token


def _stale(version: int, latest: int) -> Aborted:
    return Aborted(
        f"expected {latest + 1} (latest committed is {latest}), got {version}; re-read the latest plan and retry",
        field="plan.version",
    )
