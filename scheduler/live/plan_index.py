"""The plan in force indexed by job: where each job's entry sits, followed by a plan's changes.

Every task report asks for its job's entry and every cut for the entries of the nodes it redoes.
Indexing a plan of 20,000 entries afresh costs about 25 ms of CPU (each entry read out of the
message is an object made), more than the rest of what a plan that moves a few jobs costs the
process serving the watches. A plan made from the indexed one in place (changed entries where
they were, removed ones dropped, new ones last: EntryChanges.in_place) moves no entry but
those, so the index follows it by its changes: each job keeps a key, its rank among every entry
indexed since the last whole pass, and an entry's position in the plan is its key less the number
of removed keys below it.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Mapping

from scheduler.live.entries import EntryChanges
from silod.v1 import plan_pb2

# Past this many removals a plan is rebuilt rather than patched (applied_in_place).
PATCH_REMOVALS_AT_MOST = 64


class PlanIndex(Mapping[str, tuple[int, plan_pb2.JobAllocation]]):
    """job -> (its key, its entry) in :attr:`plan`; keys ascend in the plan's order."""

    def __init__(self) -> None:
        self.plan: plan_pb2.AllocationPlan | None = None  # the plan indexed (None: none yet)
        self._keys: dict[str, int] = {}
        self._removed: list[int] = []  # keys of the entries removed since the whole pass, ascending
        self._next_key = 0
        self.whole_passes = 0  # (for tests and the curious) indexings that went over every entry

    def index_whole(self, plan: plan_pb2.AllocationPlan) -> None:
        self.whole_passes += 1
        self._keys = {entry.job_id: key for key, entry in enumerate(plan.jobs)}
        self._removed = []
        self._next_key = len(self._keys)
        self.plan = plan

    def follow(self, base: plan_pb2.AllocationPlan, plan: plan_pb2.AllocationPlan, changes: EntryChanges) -> bool:
        """Index ``plan``, made from ``base`` (the plan indexed) by ``changes`` in place, from its
        changes alone; False (and nothing indexed) when it cannot be: index it whole then."""
        if self.plan is not base or not changes.in_place:
            self.plan = None
            return False
        keys = self._keys
        for job_id in changes.removals:
            key = keys.pop(job_id, None)
            if key is not None:
                insort(self._removed, key)
        appended = [job_id for job_id in changes.upserts if job_id not in keys]
        for job_id in appended:
            keys[job_id] = self._next_key
            self._next_key += 1
        self.plan = plan
        # A plan not laid out as the changes say (or a slow index: more removed keys than live
        # ones) is indexed whole instead: checked where it is cheap, the length and the new tail.
        if (len(plan.jobs) != len(keys) or len(self._removed) > max(1024, len(keys))
                or any(self._position(keys[job_id]) >= len(plan.jobs)
                       or plan.jobs[self._position(keys[job_id])].job_id != job_id for job_id in appended)):
            self.plan = None
            return False
        return True

    def _position(self, key: int) -> int:
        return key - bisect_left(self._removed, key)

    def position(self, job_id: str) -> int:
        """Where ``job_id``'s entry sits in :attr:`plan` (KeyError: it has none)."""
        return self._position(self._keys[job_id])

    def __getitem__(self, job_id: str) -> tuple[int, plan_pb2.JobAllocation]:
        key = self._keys[job_id]
        assert self.plan is not None
        entry = self.plan.jobs[self._position(key)]
        if entry.job_id != job_id:  # laid out otherwise than its changes said: never another job's entry
            self.index_whole(self.plan)
            key = self._keys[job_id]
            entry = self.plan.jobs[key]
        return key, entry

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def applied_in_place(index: PlanIndex, header: plan_pb2.AllocationPlan, jobs: Iterable[plan_pb2.JobAllocation],
                     removed: Iterable[str]) -> plan_pb2.AllocationPlan | None:
    """``header`` (every field but jobs) with the jobs of ``index.plan`` changed: ``jobs`` in their
    entries' places or last, ``removed`` dropped, as PlanChanges.apply lays them out. Made by copying
    the indexed plan whole (in C) and patching the changed entries, not by rebuilding 20,000 of
    them in Python; None where patching would cost more (many removals: each shifts the rest)."""
    base = index.plan
    gone = set(removed)
    if base is None or header.jobs or len(gone) > PATCH_REMOVALS_AT_MOST:
        return None
    plan = plan_pb2.AllocationPlan()
    plan.CopyFrom(base)
    for field, _ in plan.ListFields():
        if field.name != "jobs":
            plan.ClearField(field.name)
    plan.MergeFrom(header)
    upserts = {entry.job_id: entry for entry in jobs}
    appended = []
    for job_id, entry in upserts.items():
        if job_id in index and job_id not in gone:
            plan.jobs[index.position(job_id)].CopyFrom(entry)
        else:
            appended.append(entry)
    for position in sorted((index.position(job_id) for job_id in gone if job_id in index), reverse=True):
        del plan.jobs[position]
    plan.jobs.extend(appended)
    return plan
