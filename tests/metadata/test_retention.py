"""Retention: old plans, metric samples and the events of long-finished jobs are removed, what is
recent or still needed stays (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import timedelta

from silod.v1 import common_pb2, plan_pb2

from services.metadata.clock import to_timestamp, utc_now
from services.metadata.store import MetadataStore
from services.metadata.store.retention import RetentionPolicy
from tests.metadata.metadata_samples import placement, plan, training_spec

S = common_pb2


def _old_plans(store: MetadataStore, count: int, hours_ago: float) -> None:
    start = store.plans.latest().version if store.retention.counts()["plans"] else 0
    for i in range(count):
        p = plan(start + i + 1, plan_pb2.JobAllocation(job_id="job-x", placements=[placement("n1", 0)]))
        p.created_at.CopyFrom(to_timestamp(utc_now() - timedelta(hours=hours_ago)))
        store.plans.commit(p)


def test_old_plans_go_but_the_newest_stay(store: MetadataStore) -> None:
    _old_plans(store, 30, hours_ago=10)  # versions 1-30, old
    _old_plans(store, 5, hours_ago=0)  # versions 31-35, fresh
    policy = RetentionPolicy(plans_s=3600, min_plans=10, metrics_s=0, finished_job_events_s=0, batch=7)
    assert store.retention.compact(policy)["plans"] == 25  # 1-25: old and not among the newest 10
    assert store.retention.counts()["plans"] == 10
    assert store.plans.latest().version == 35
    assert store.retention.compact(policy)["plans"] == 0  # nothing more to do


def test_old_metric_samples_go(store: MetadataStore) -> None:
    job = store.jobs.create(training_spec())
    samples = []
    for i, hours in enumerate((30, 30, 2, 0)):
        sample = S.MetricSample(job_id=job.id, name="step_time_s", value=float(i))
        sample.time.CopyFrom(to_timestamp(utc_now() - timedelta(hours=hours)))
        samples.append(sample)
    assert store.metrics.append(samples) == 4
    removed = store.retention.compact(RetentionPolicy(plans_s=0, metrics_s=24 * 3600, finished_job_events_s=0))
    assert removed["metric_samples"] == 2
    assert [s.value for s in store.metrics.query(job.id)] == [3.0, 2.0]  # newest first


def test_a_long_finished_job_keeps_its_last_event_and_a_running_one_all(store: MetadataStore) -> None:
    done = store.jobs.create(training_spec(name="done"))
    for state in (S.JOB_STATE_SCHEDULED, S.JOB_STATE_RUNNING, S.JOB_STATE_SUCCEEDED):
        done = store.jobs.transition(done.id, done.state, state)
    running = store.jobs.create(training_spec(name="running"))
    for state in (S.JOB_STATE_SCHEDULED, S.JOB_STATE_RUNNING):
        running = store.jobs.transition(running.id, running.state, state)
    events_before = {j: len(store.jobs.list_events(j)) for j in (done.id, running.id)}
    assert events_before[done.id] >= 3
    policy = RetentionPolicy(plans_s=0, metrics_s=0, finished_job_events_s=3600)
    assert store.retention.compact(policy)["job_events"] == 0  # finished just now: kept
    removed = store.retention.compact(policy, now=utc_now() + timedelta(hours=2))
    assert removed["job_events"] == events_before[done.id] - 1
    last = store.jobs.list_events(done.id)
    assert len(last) == 1 and last[0].to_state == S.JOB_STATE_SUCCEEDED
    assert len(store.jobs.list_events(running.id)) == events_before[running.id]
    assert store.jobs.get(done.id).state == S.JOB_STATE_SUCCEEDED  # the job itself stays


def test_the_service_compacts_in_the_background(db_url: str) -> None:
    """`silod metadata` with retention_interval_s: old plans go without anyone asking."""
    import time

    from prometheus_client import REGISTRY

    from services.metadata.service import Settings
    from silod.v1 import metadata_pb2, metadata_pb2_grpc
    from tests.metadata.metadata_harness import InProcessServer

    removed_before = REGISTRY.get_sample_value("silod_metadata_compacted_rows_total", {"table": "plans"}) or 0.0
    settings = Settings(db=db_url, listen="127.0.0.1:0", log_level="warning", retention_interval_s=0.2,
                        retention_plans_s=3600, retention_min_plans=2)
    with InProcessServer(settings) as server:
        stub = metadata_pb2_grpc.MetadataServiceStub(server.channel)
        for version in range(1, 6):
            p = plan(version, plan_pb2.JobAllocation(job_id="job-x", placements=[placement("n1", 0)]))
            p.created_at.CopyFrom(to_timestamp(utc_now() - timedelta(hours=3)))
            stub.CommitPlan(metadata_pb2.CommitPlanRequest(plan=p))
        deadline = time.monotonic() + 10
        while len(stub.ListPlans(metadata_pb2.ListPlansRequest()).plans) != 2:
            assert time.monotonic() < deadline, "old plans were not compacted"
            time.sleep(0.1)
        assert stub.GetLatestPlan(metadata_pb2.GetLatestPlanRequest()).version == 5

        def removed() -> float:
            return (REGISTRY.get_sample_value("silod_metadata_compacted_rows_total", {"table": "plans"}) or 0.0) - removed_before

        # The rows go when the compaction commits; it counts them just after (seen 0 once on a
        # loaded CI run, between the two).
        while removed() != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert removed() == 3
