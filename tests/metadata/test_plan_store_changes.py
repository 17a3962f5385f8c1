"""Plans committed as changes (MetadataService.CommitPlanChanges): the store keeps the changes, with a whole
plan now and then, and every read (latest, by version, a page of the list, after a restart, after
retention removed the whole plan they were based on) gives the whole plan."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from silod.v1 import plan_pb2

from services.metadata.clock import to_timestamp, utc_now
from services.metadata.store import MetadataStore
from services.metadata.store.plans import CHECKPOINT_EVERY
from services.metadata.store.retention import RetentionPolicy
from services.runtime.errors import Aborted, InvalidArgument
from tests.metadata.metadata_samples import placement, plan

JOBS = [f"job-{i:012x}" for i in range(40)]


def _entry(job: str, node: int, generation: int) -> plan_pb2.JobAllocation:
    return plan_pb2.JobAllocation(job_id=job, placements=[placement(f"n{node}", 0, 1)], generation=generation,
                                  batch_size=32)


def _header(version: int, hours_ago: float = 0.0) -> plan_pb2.AllocationPlan:
    header = plan(version, reason=f"round {version}")
    header.created_at.CopyFrom(to_timestamp(utc_now() - timedelta(hours=hours_ago)))
    return header


def _commit_rounds(store: MetadataStore, rounds: int, seed: int = 7, hours_ago: float = 0.0
                   ) -> dict[int, plan_pb2.AllocationPlan]:
    """Version 1 whole, then ``rounds`` versions as changes (a few jobs move, start or end each
    round); the whole plans expected, by version."""
    rng = random.Random(seed)
    fresh_nodes = iter(range(1000, 10**6))  # a node of its own for each job placed or moved
    start = store.plans.latest().version if store.retention.counts()["plans"] else 0
    entries = {job: _entry(job, i, 1) for i, job in enumerate(JOBS[:20])}
    first = _header(start + 1, hours_ago)
    first.jobs.extend(entries.values())
    expected = {start + 1: store.plans.commit(first)}
    for version in range(start + 2, start + 2 + rounds):
        changes = plan_pb2.PlanChanges(base_version=version - 1)
        moved = rng.sample(sorted(entries), 2)
        for job in moved:  # to another node
            entries[job] = _entry(job, next(fresh_nodes), entries[job].generation + 1)
            changes.jobs.append(entries[job])
        gone = rng.choice(sorted(set(entries) - set(moved)))  # one ends
        del entries[gone]
        changes.removed_job_ids.append(gone)
        new = next(j for j in JOBS if j not in entries and j != gone)  # one starts
        entries[new] = _entry(new, next(fresh_nodes), 1)
        changes.jobs.append(entries[new])
        committed = store.plans.commit(_header(version, hours_ago), changes)
        assert [j.job_id for j in committed.jobs] == list(entries)  # kept order, new ones last
        assert list(committed.jobs) == list(entries.values())
        expected[version] = committed
    return expected


def test_every_read_gives_the_whole_plan(store: MetadataStore, db_url: str) -> None:
    expected = _commit_rounds(store, CHECKPOINT_EVERY + 10)
    newest = max(expected)
    assert store.plans.latest() == expected[newest]
    for version in (1, 2, CHECKPOINT_EVERY - 1, CHECKPOINT_EVERY, CHECKPOINT_EVERY + 1, newest):
        assert store.plans.get(version) == expected[version]
    page, token = store.plans.list(page_size=30)
    assert page == [expected[v] for v in range(newest, newest - 30, -1)] and token
    fresh = MetadataStore.open(db_url)  # a restarted service: nothing cached
    try:
        assert fresh.plans.latest() == expected[newest]
        assert fresh.plans.get(CHECKPOINT_EVERY + 3) == expected[CHECKPOINT_EVERY + 3]
    finally:
        fresh.close()
    # Kept as changes: most rows hold a handful of entries, not the twenty of a whole plan.
    with store.db.read() as session:
        from services.metadata.models import Plan
        from sqlalchemy import select
        rows = list(session.execute(select(Plan.version, Plan.base_version)))
    whole = sorted(v for v, base in rows if base is None)
    assert whole == [1, CHECKPOINT_EVERY]


def test_retention_keeps_the_oldest_plan_whole(store: MetadataStore) -> None:
    old = _commit_rounds(store, 30, hours_ago=10)  # versions 1-31
    _commit_rounds(store, 4)  # 32 whole, 33-36 changes
    policy = RetentionPolicy(plans_s=3600, min_plans=10, metrics_s=0, finished_job_events_s=0, batch=7)
    assert store.retention.compact(policy)["plans"] == 26  # 1-26: old, not among the newest 10
    assert store.plans.get(27) == old[27]  # was changes of 26; now whole
    assert store.plans.get(31) == old[31]
    assert [p.version for p in store.plans.list(page_size=100)[0]] == list(range(36, 26, -1))


def test_changes_that_do_not_fit_are_refused_and_change_nothing(store: MetadataStore) -> None:
    expected = _commit_rounds(store, 2)  # versions 1-3
    stale = plan_pb2.PlanChanges(base_version=2, jobs=[_entry(JOBS[39], 1, 1)])
    with pytest.raises(InvalidArgument) as refused:
        store.plans.commit(_header(4), stale)
    assert refused.value.violations[0].field == "changes.base_version"
    with pytest.raises(Aborted):  # version 3 is taken
        store.plans.commit(_header(3), plan_pb2.PlanChanges(base_version=2))
    both = _header(4)
    both.jobs.append(_entry(JOBS[39], 1, 1))
    with pytest.raises(InvalidArgument) as refused:
        store.plans.commit(both, plan_pb2.PlanChanges(base_version=3))
    assert refused.value.violations[0].field == "plan.jobs"
    held = expected[3].jobs[0]  # a new job on a GPU another job holds
    clash = plan_pb2.JobAllocation(job_id=JOBS[39], placements=list(held.placements))
    with pytest.raises(InvalidArgument, match="already held"):
        store.plans.commit(_header(4), plan_pb2.PlanChanges(base_version=3, jobs=[clash]))
    bad = plan_pb2.PlanChanges(base_version=3, jobs=[_entry("not a job!", 1, 1)], removed_job_ids=["also nope"])
    with pytest.raises(InvalidArgument) as refused:
        store.plans.commit(_header(4), bad)
    assert {v.field for v in refused.value.violations} == {"changes.jobs[0].job_id", "changes.removed_job_ids[0]"}
    assert store.plans.latest() == expected[3]
    assert store.plans.commit(_header(4), plan_pb2.PlanChanges(base_version=3)).jobs == expected[3].jobs


def test_a_header_only_commit_answers_the_header_and_stores_the_whole_plan(store: MetadataStore) -> None:
    expected = _commit_rounds(store, 2)
    changes = plan_pb2.PlanChanges(base_version=3, jobs=[_entry(JOBS[0], 5000, 9)])
    sent = _header(4)
    header = store.plans.commit(sent, changes, header_only=True)
    assert not header.jobs and header.version == 4 and header.reason == "round 4"
    assert header.created_at.ToMicroseconds() == sent.created_at.ToMicroseconds()  # as stored: microseconds
    whole = store.plans.latest()
    assert whole.version == 4 and len(whole.jobs) == len(expected[3].jobs)
    assert next(j for j in whole.jobs if j.job_id == JOBS[0]).generation == 9


def test_the_latest_plan_comes_back_as_its_header_to_a_reader_that_holds_it(store: MetadataStore) -> None:
    expected = _commit_rounds(store, 2)
    assert store.plans.latest(known_version=3) == plan_pb2.AllocationPlan(
        version=3, reason="round 3", policy="pollux", cache_mode="silod", created_at=expected[3].created_at)
    assert list(store.plans.latest(known_version=2).jobs) == list(expected[3].jobs)  # an older one: whole
    assert list(store.plans.latest().jobs) == list(expected[3].jobs)
    with pytest.raises(InvalidArgument, match="known_version"):
        store.plans.latest(known_version=-1)
