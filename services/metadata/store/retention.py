"""What the metadata store keeps: plans, metric samples and job events by age, compacted in the
background (services/metadata/service.py runs :meth:`RetentionStore.compact` every
``retention_interval_s``).

Why these three: they are the tables that grow with time rather than with the cluster. A busy
scheduler commits a plan on most rounds (each a JSON document of every job's placement, about
half a megabyte at 1,000 nodes), the scheduler appends two metric samples per job report, and
every state change of every job adds an event. Nothing reads old plans but the dashboard's
recent history, nothing reads old samples but a person looking at a job, and a finished job's
story is its last event. Jobs, datasets, nodes and models are kept: they grow with what the
cluster holds, not with how long it runs. The audit log (services/metadata/store/audit.py)
grows with what people do and is kept ``audit_s`` (90 days unless set): long enough to answer
"who cancelled this job last month", bounded so that it cannot fill the disk.

Deletes go in batches of ``batch`` rows, so no statement holds the tables for long while the
scheduler and the agents write.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, delete, func, select
from sqlalchemy.orm import Session

from services.metadata import convert
from services.metadata.clock import utc_now
from services.metadata.database import Database
from services.metadata.models import AuditEvent, Job, JobEvent, MetricSample, Plan
from services.metadata.store.plans import whole_plans

MAX_BATCHES = 50  # per table and compaction: a backlog is worked off over several compactions


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each kind of record is kept; 0 keeps it for ever."""

    plans_s: float = 6 * 3600.0  # plans older than this are removed ...
    min_plans: int = 100  # ... but never the newest this many (the dashboard's history, a rollback's view)
    metrics_s: float = 24 * 3600.0  # metric samples older than this
    finished_job_events_s: float = 30 * 86400.0  # jobs finished this long ago keep only their last event
    audit_s: float = 90 * 86400.0  # audit log rows older than this
    batch: int = 5000  # rows per DELETE statement


class RetentionStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def compact(self, policy: RetentionPolicy, now: datetime | None = None) -> dict[str, int]:
        """Delete what ``policy`` no longer keeps; rows removed per table."""
        now = now or utc_now()
        removed = {"plans": 0, "metric_samples": 0, "job_events": 0, "audit_events": 0}
        if policy.plans_s > 0:
            removed["plans"] = self._plans(now - timedelta(seconds=policy.plans_s), policy.min_plans, policy.batch)
        if policy.metrics_s > 0:
            removed["metric_samples"] = self._rows_older_than(MetricSample, now - timedelta(seconds=policy.metrics_s), policy.batch)
        if policy.finished_job_events_s > 0:
            removed["job_events"] = self._finished_job_events(
                now - timedelta(seconds=policy.finished_job_events_s), policy.batch)
        if policy.audit_s > 0:
            removed["audit_events"] = self._rows_older_than(AuditEvent, now - timedelta(seconds=policy.audit_s), policy.batch)
        return removed

    def _plans(self, before: datetime, min_plans: int, batch: int) -> int:
        removed = 0
        for _ in range(MAX_BATCHES):
            with self._db.write() as session:
                newest = session.scalar(select(func.max(Plan.version))) or 0
                versions = session.scalars(
                    select(Plan.version).where(and_(Plan.created_at < before, Plan.version <= newest - min_plans))
                    .order_by(Plan.version).limit(batch)).all()
                if versions:
                    _keep_oldest_whole(session, max(versions))
                    session.execute(delete(Plan).where(Plan.version.in_(versions)))
            removed += len(versions)
            if len(versions) < batch:
                break
        return removed

    def _rows_older_than(self, model: type[MetricSample] | type[AuditEvent], before: datetime, batch: int) -> int:
        """Deletes the rows of a time-stamped table (metric samples, audit events) older than ``before``."""
        removed = 0
        for _ in range(MAX_BATCHES):
            with self._db.write() as session:
                ids = session.scalars(select(model.id).where(model.time < before).order_by(model.id).limit(batch)).all()
                if ids:
                    session.execute(delete(model).where(model.id.in_(ids)))
            removed += len(ids)
            if len(ids) < batch:
                break
        return removed

    def _finished_job_events(self, before: datetime, batch: int) -> int:
        """Every event but the last of jobs that finished before ``before``."""
        removed = 0
        for _ in range(MAX_BATCHES):
            with self._db.write() as session:
                rows = session.execute(
                    select(JobEvent.job_id, JobEvent.sequence)
                    .join(Job, Job.id == JobEvent.job_id)
                    .where(and_(Job.finished_at.is_not(None), Job.finished_at < before,
                                JobEvent.sequence < Job.last_event_sequence))
                    .limit(batch)).all()
                by_job: dict[str, list[int]] = {}
                for job_id, sequence in rows:
                    by_job.setdefault(job_id, []).append(sequence)
                for job_id, sequences in by_job.items():
                    session.execute(delete(JobEvent).where(and_(JobEvent.job_id == job_id,
                                                                JobEvent.sequence.in_(sequences))))
            removed += len(rows)
            if len(rows) < batch:
                break
        return removed

    def counts(self) -> dict[str, int]:
        """Rows per table that retention compacts (for benchmarks and the operators' page)."""
        with self._db.read() as session:
            return {name: int(session.scalar(select(func.count()).select_from(model)) or 0)
                    for name, model in (("plans", Plan), ("metric_samples", MetricSample), ("job_events", JobEvent),
                                             ("audit_events", AuditEvent))}


def _keep_oldest_whole(session: Session, last_removed: int) -> None:
    """The plan after ``last_removed`` becomes the oldest one kept: if it is stored as changes of
    a plan about to go, it is rewritten whole first (plans.whole_plans starts from a whole one)."""
    row = session.scalars(select(Plan).where(Plan.version > last_removed).order_by(Plan.version).limit(1)).first()
    if row is not None and row.base_version is not None:
        row.plan = convert.to_json(whole_plans(session, [row.version])[row.version])
        row.base_version = None
        session.flush()
