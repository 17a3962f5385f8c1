"""The plan in force indexed by job (scheduler.live.plan_index): followed by a plan's changes, it
says what indexing the plan afresh says, with one pass over every entry in all; and the
allocation service's plan patched from the feed's changes is the plan rebuilt from them."""

from __future__ import annotations

import asyncio
import random

import pytest

from scheduler.allocation.follower import _applied
from scheduler.live.clients import Clients
from scheduler.live.entries import EntryChanges
from scheduler.live.plan_index import PATCH_REMOVALS_AT_MOST, PlanIndex, applied_in_place
from scheduler.live.plans import PlanStore
from silod.v1 import plan_pb2


def _entry(job_id: str, rng: random.Random) -> plan_pb2.JobAllocation:
    entry = plan_pb2.JobAllocation(job_id=job_id, generation=1, batch_size=32)
    entry.placements.add(node=f"n{rng.randrange(50)}", gpu_indices=[rng.randrange(8)])
    return entry


def _first(rng: random.Random, jobs: int = 200) -> plan_pb2.AllocationPlan:
    plan = plan_pb2.AllocationPlan(version=1, epoch=1, policy="fifo")
    plan.jobs.extend(_entry(f"j{j}", rng) for j in range(jobs))
    plan.replicas.add(replica_id="r0", node="n0", gpu_index=0)
    return plan


def _changes(held: plan_pb2.AllocationPlan, rng: random.Random, serial: list[int]
             ) -> tuple[plan_pb2.AllocationPlan, plan_pb2.PlanChanges]:
    """The header of the plan after ``held`` and its changes: restarts, ends, new jobs."""
    header = plan_pb2.AllocationPlan(version=held.version + 1, epoch=held.epoch, policy="fifo",
                                     reason=rng.choice(["interval", "completion"]))
    if rng.random() < 0.5:  # the replicas change now and then
        header.replicas.add(replica_id=f"r{header.version}", node="n1", gpu_index=1)
    ids = [e.job_id for e in held.jobs]
    changes = plan_pb2.PlanChanges(base_version=held.version)
    for job_id in rng.sample(ids, min(len(ids), rng.randint(0, 6))):
        restarted = changes.jobs.add()
        restarted.CopyFrom(held.jobs[ids.index(job_id)])
        restarted.generation += 1
    changed = {e.job_id for e in changes.jobs}
    changes.removed_job_ids.extend(rng.sample([j for j in ids if j not in changed], rng.randint(0, 5)))
    for _ in range(rng.randint(0, 5)):
        serial[0] += 1
        changes.jobs.append(_entry(f"new{serial[0]}", rng))
    return header, changes


def _entry_changes(held: plan_pb2.AllocationPlan, changes: plan_pb2.PlanChanges) -> EntryChanges:
    before = {e.job_id: e for e in held.jobs}
    upserts = {e.job_id: e for e in changes.jobs}
    removals = tuple(changes.removed_job_ids)
    return EntryChanges(upserts, removals, {j: before[j] for j in (*upserts, *removals) if j in before}, in_place=True)


def _says_what_a_fresh_index_says(index: PlanIndex, plan: plan_pb2.AllocationPlan) -> None:
    fresh = PlanIndex()
    fresh.index_whole(plan)
    assert set(index) == set(fresh) and len(index) == len(plan.jobs)
    for position, entry in enumerate(plan.jobs):
        assert index.position(entry.job_id) == position
        assert index[entry.job_id][1] == entry
    assert sorted(index, key=lambda job_id: index[job_id][0]) == [e.job_id for e in plan.jobs]


@pytest.mark.parametrize("seed", range(8))
def test_followed_by_changes_it_says_what_indexing_afresh_says_and_the_patched_plan_is_the_rebuilt_one(seed: int) -> None:
    rng = random.Random(seed)
    held = _first(rng)
    index = PlanIndex()
    index.index_whole(held)
    serial = [0]
    for _ in range(60):
        header, changes = _changes(held, rng, serial)
        rebuilt = _applied(held, header, changes)
        patched = applied_in_place(index, header, changes.jobs, changes.removed_job_ids)
        assert patched == rebuilt
        assert index.follow(held, patched, _entry_changes(held, changes))
        _says_what_a_fresh_index_says(index, patched)
        held = patched
    assert index.whole_passes == 1


def test_a_plan_not_made_in_place_from_the_indexed_one_is_not_followed() -> None:
    rng = random.Random(1)
    held = _first(rng, jobs=10)
    index = PlanIndex()
    index.index_whole(held)
    header, changes = _changes(held, rng, [0])
    plan = _applied(held, header, changes)
    not_in_place = _entry_changes(held, changes)
    not_in_place.in_place = False
    assert not index.follow(held, plan, not_in_place) and index.plan is None
    index.index_whole(held)
    assert not index.follow(_first(rng, jobs=10), plan, _entry_changes(held, changes))  # another base
    index.index_whole(held)
    header = plan_pb2.AllocationPlan(version=2, epoch=1)
    one_new = plan_pb2.PlanChanges(base_version=1, jobs=[_entry("new", rng)])
    reordered = _applied(held, header, one_new)
    moved = plan_pb2.AllocationPlan()
    moved.CopyFrom(header)
    moved.jobs.extend([reordered.jobs[-1], *list(reordered.jobs)[:-1]])  # the new entry first, not last
    assert not index.follow(held, moved, _entry_changes(held, one_new)) and index.plan is None


def test_many_removals_are_rebuilt_not_patched() -> None:
    rng = random.Random(2)
    held = _first(rng)
    index = PlanIndex()
    index.index_whole(held)
    removed = [e.job_id for e in held.jobs][:PATCH_REMOVALS_AT_MOST + 1]
    assert applied_in_place(index, plan_pb2.AllocationPlan(version=2), [], removed) is None
    patched = applied_in_place(index, plan_pb2.AllocationPlan(version=2), [], removed[:-1])
    assert patched is not None and len(patched.jobs) == len(held.jobs) - PATCH_REMOVALS_AT_MOST


def test_the_plan_store_follows_its_plans_by_their_changes() -> None:
    async def main() -> None:
        rng = random.Random(3)
        store = PlanStore(Clients(md=None))  # type: ignore[arg-type]
        assert len(store.indexed()) == 0 and store.allocation("j0") is None
        held = _first(rng)
        await store.set_latest(held)
        serial = [0]
        for _ in range(20):
            header, changes = _changes(held, rng, serial)
            plan = _applied(held, header, changes)
            await store.set_latest(plan, base=held, changes=_entry_changes(held, changes))
            for entry in plan.jobs:
                assert store.allocation(entry.job_id) == entry
            for job_id in changes.removed_job_ids:
                assert store.allocation(job_id) is None
            held = plan
        assert store.indexed().whole_passes == 1
        read = plan_pb2.AllocationPlan()
        read.CopyFrom(held)
        read.version += 1
        await store.set_latest(read)  # read whole from the store: indexed whole
        assert store.allocation(read.jobs[0].job_id) == read.jobs[0] and store.indexed().whole_passes == 2

    asyncio.run(main())


def test_a_plan_laid_out_otherwise_than_its_changes_said_never_answers_another_jobs_entry() -> None:
    rng = random.Random(4)
    held = _first(rng, jobs=10)
    index = PlanIndex()
    index.index_whole(held)
    restarted = plan_pb2.AllocationPlan()
    restarted.CopyFrom(held)
    restarted.version = 2
    restarted.jobs[3].generation = 2
    swapped = plan_pb2.AllocationPlan()
    swapped.CopyFrom(restarted)
    swapped.jobs[0].CopyFrom(restarted.jobs[1])
    swapped.jobs[1].CopyFrom(restarted.jobs[0])  # two entries swapped: same length, nothing appended
    changes = EntryChanges({"j3": swapped.jobs[3]}, (), {"j3": held.jobs[3]}, in_place=True)
    assert index.follow(held, swapped, changes)  # the cheap checks pass
    assert index["j0"][1] == swapped.jobs[1] and index["j1"][1] == swapped.jobs[0]
    assert index.whole_passes == 2
    _says_what_a_fresh_index_says(index, swapped)
