"""Metric samples and fitted per-job model parameters (the estimator's durable state)."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf import timestamp_pb2
from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from silod.v1 import common_pb2

from services.metadata import convert, paging
from services.metadata.clock import from_timestamp, utc_now
from services.metadata.database import Database
from services.metadata.models import Job, JobModel, MetricSample
from services.metadata.validation.common import check_timestamp
from services.metadata.validation.jobs import check_job_id
from services.metadata.validation.metrics import check_job_model, check_metrics_query, check_samples
from services.runtime.errors import InvalidArgument, NotFound


class MetricStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def append(self, samples: Sequence[common_pb2.MetricSample]) -> int:
        check_samples(samples)
        now = utc_now()
        rows = [
            {
                "job_id": sample.job_id,
                "time": from_timestamp(sample.time) if sample.HasField("time") else now,
                "name": sample.name,
                "value": sample.value,
                "labels": dict(sample.labels),
            }
            for sample in samples
        ]
        with self._db.write() as session:
            wanted = {sample.job_id for sample in samples}
            known = set(session.scalars(select(Job.id).where(Job.id.in_(wanted))))
            for index, sample in enumerate(samples):
                if sample.job_id not in known:
                    raise NotFound(f"no job {sample.job_id!r}", field=f"samples[{index}].job_id")
            session.connection().execute(insert(MetricSample.__table__), rows)
        return len(rows)

    def query(
        self,
        job_id: str,
        *,
        name: str = "",
        since: timestamp_pb2.Timestamp | None = None,
        until: timestamp_pb2.Timestamp | None = None,
        limit: int = 0,
    ) -> list[common_pb2.MetricSample]:
        """Newest first, within [since, until)."""
        check_metrics_query(job_id, name)
        size = paging.METRICS.size(limit, field="limit")
        if since is not None:
            check_timestamp(since, "since")
        if until is not None:
            check_timestamp(until, "until")
        start = from_timestamp(since) if since is not None else None
        end = from_timestamp(until) if until is not None else utc_now()
        if start is not None and start > end:
            raise InvalidArgument("must not be before since", field="until")
        query = (
            select(MetricSample)
            .where(MetricSample.job_id == job_id, MetricSample.time < end)
            .order_by(MetricSample.time.desc(), MetricSample.id.desc())
            .limit(size)
        )
        if start is not None:
            query = query.where(MetricSample.time >= start)
        if name:
            query = query.where(MetricSample.name == name)
        with self._db.read() as session:
            _require_job(session, job_id, "job_id")
            return [convert.sample_to_proto(row) for row in session.scalars(query)]

    def put_model(self, model: common_pb2.JobModelParams) -> common_pb2.JobModelParams:
        check_job_model(model)
        try:
            return self._put_model_once(model)
        except IntegrityError:
            return self._put_model_once(model)  # lost a race to insert the first fit: update it

    def _put_model_once(self, model: common_pb2.JobModelParams) -> common_pb2.JobModelParams:
        with self._db.write() as session:
            _require_job(session, model.job_id, "model.job_id")
            row = session.get(JobModel, model.job_id)
            if row is None:
                row = JobModel(job_id=model.job_id)
                session.add(row)
            row.application = model.application
            row.params = dict(model.params)
            row.observations = model.observations
            row.updated_at = utc_now()
            session.flush()
            return convert.job_model_to_proto(row)

    def get_model(self, job_id: str) -> common_pb2.JobModelParams:
        check_job_id(job_id)
        with self._db.read() as session:
            row = session.get(JobModel, job_id)
            if row is None:
                _require_job(session, job_id, "job_id")
                raise NotFound(f"no model stored for {job_id}", field="job_id")
            return convert.job_model_to_proto(row)


def _require_job(session: Session, job_id: str, field: str) -> None:
    if session.scalar(select(Job.seq).where(Job.id == job_id)) is None:
        raise NotFound(f"no job {job_id!r}", field=field)
