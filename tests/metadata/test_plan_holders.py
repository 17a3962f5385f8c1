"""A plan committed as changes is checked by what the changes touch (validation.plan_holders),
and refused or passed exactly as the whole check (check_plan) would refuse or pass the plan they
make: the same problems named, the same plan stored."""

from __future__ import annotations

import random

import pytest
from silod.v1 import plan_pb2

from services.metadata.clock import utc_now, to_timestamp
from services.metadata.store import MetadataStore
from services.metadata.store import plans as plan_store
from services.metadata.store.plans import apply_changes
from services.metadata.validation.plans import check_plan
from services.runtime.errors import InvalidArgument
from tests.metadata.metadata_samples import placement, plan

JOBS = [f"job-{i:04d}" for i in range(14)]
GPUS = [(f"n{node}", index) for node in range(4) for index in range(4)]
STATES = (plan_pb2.REPLICA_STATE_RUNNING, plan_pb2.REPLICA_STATE_SLEEP, plan_pb2.REPLICA_STATE_PROTECT,
          plan_pb2.REPLICA_STATE_END)


def _entry(rng: random.Random, job_id: str, gpus: list[tuple[str, int]]) -> plan_pb2.JobAllocation:
    entry = plan_pb2.JobAllocation(job_id=job_id, batch_size=32, generation=rng.randrange(1, 5))
    for node, index in gpus:
        entry.placements.append(placement(node, index))
    if gpus and rng.random() < 0.5:
        entry.cache_grants.add(node=gpus[0][0], cache_quota_bytes=1 << 20, remote_io_bytes_per_s=rng.randrange(0, 100))
    return entry


def _header(rng: random.Random, version: int, jobs: list[str]) -> plan_pb2.AllocationPlan:
    header = plan(version, storage_bandwidth_budget_bytes_per_s=rng.choice((0, 150, 300, 10_000)))
    header.created_at.CopyFrom(to_timestamp(utc_now()))
    for _ in range(rng.choice((0, 0, 1, 2))):
        node, index = rng.choice(GPUS)
        header.loans.add(node=node, gpu_index=index, job_id=rng.choice(jobs))
    for r in range(rng.choice((0, 0, 1, 2))):
        node, index = rng.choice(GPUS)
        header.replicas.add(replica_id=f"app#{r}", application="app", node=node, gpu_index=index,
                            state=rng.choice(STATES), task_id=rng.choice(jobs))
    return header


def _changes(rng: random.Random, latest: plan_pb2.AllocationPlan) -> plan_pb2.PlanChanges:
    """A few entries moved, started or given grants, a few removed: GPUs drawn at random, so some
    land on GPUs another job holds, and some grants exceed the budget."""
    changes = plan_pb2.PlanChanges(base_version=latest.version)
    held = {job.job_id for job in latest.jobs}
    changed = rng.sample(JOBS, rng.randrange(0, 4))
    for job_id in changed:
        changes.jobs.append(_entry(rng, job_id, rng.sample(GPUS, rng.choice((0, 1, 1, 2)))))
    removable = sorted(held - set(changed))
    changes.removed_job_ids.extend(rng.sample(removable, min(len(removable), rng.choice((0, 0, 1, 2)))))
    return changes


def _whole_verdict(stored: plan_pb2.AllocationPlan) -> list[tuple[str, str]] | None:
    try:
        check_plan(stored)
    except InvalidArgument as refused:
        return [(v.field, v.description) for v in refused.violations]
    return None


def test_commits_of_changes_are_refused_exactly_as_the_whole_check_refuses_them(
        store: MetadataStore, monkeypatch: pytest.MonkeyPatch) -> None:
    whole_checks = []
    counted = plan_store.check_plan

    def counting(plan_: plan_pb2.AllocationPlan, *args, **kwargs) -> None:
        whole_checks.append(plan_.version)
        counted(plan_, *args, **kwargs)

    monkeypatch.setattr(plan_store, "check_plan", counting)
    rng = random.Random(45)
    first = plan(1)
    first.created_at.CopyFrom(to_timestamp(utc_now()))
    for job_id, gpu in zip(JOBS[:6], GPUS[::2]):
        first.jobs.append(_entry(rng, job_id, [gpu]))
    latest = store.plans.commit(first)
    outcomes = {"passed": 0, "refused": 0}
    for _ in range(300):
        header, changes = _header(rng, latest.version + 1, JOBS), _changes(rng, latest)
        expected = apply_changes(latest, header, changes.jobs, changes.removed_job_ids)
        verdict = _whole_verdict(expected)
        try:
            committed = store.plans.commit(header, changes)
        except InvalidArgument as refused:
            assert [(v.field, v.description) for v in refused.violations] == verdict
            outcomes["refused"] += 1
            continue
        assert verdict is None, f"passed a plan the whole check refuses: {verdict}"
        assert committed == expected
        latest = committed
        outcomes["passed"] += 1
    assert outcomes["passed"] >= 40 and outcomes["refused"] >= 40, outcomes
    # Most commits were settled by what they changed, without the whole check.
    assert len(whole_checks) < sum(outcomes.values()) * 0.8, (len(whole_checks), outcomes)
    assert store.plans.latest() == latest


def test_a_restarted_store_checks_changes_against_the_plan_it_reads(store: MetadataStore, db_url: str) -> None:
    rng = random.Random(7)
    first = plan(1)
    first.jobs.extend([_entry(rng, JOBS[0], [GPUS[0]]), _entry(rng, JOBS[1], [GPUS[1]])])
    store.plans.commit(first)
    fresh = MetadataStore.open(db_url)  # knows nothing of who holds what
    try:
        clash = plan_pb2.PlanChanges(base_version=1, jobs=[_entry(rng, JOBS[2], [GPUS[1]])])
        with pytest.raises(InvalidArgument, match="already held by job-0001") as refused:
            fresh.plans.commit(plan(2), clash)
        assert refused.value.field == "plan.jobs[2].placements[0].gpu_indices"
        moved = plan_pb2.PlanChanges(base_version=1, jobs=[_entry(rng, JOBS[2], [GPUS[1]])], removed_job_ids=[JOBS[1]])
        assert [j.job_id for j in fresh.plans.commit(plan(2), moved).jobs] == [JOBS[0], JOBS[2]]
        # The store that committed version 1 follows version 2 from the table, not its own memory.
        back = plan_pb2.PlanChanges(base_version=2, jobs=[_entry(rng, JOBS[1], [GPUS[1]])])
        with pytest.raises(InvalidArgument, match="already held by job-0002"):
            store.plans.commit(plan(3), back)
    finally:
        fresh.close()
