"""What each training job holds under the plan in force and can still run on: the snapshot's
``current`` plan, carried from one plan in force to the next by what the next one changed.

At 20,000 jobs a plan in force converted whole (every entry to an Allocation, every placement
checked against the live nodes and faulted GPUs) cost a quarter of a second a commit; a round
that changes a handful of entries now converts and checks those only. A plan whose changes are
not known (read from the store, another leader's, built whole) is converted whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from scheduler.live import convert
from scheduler.live.entries import EntryChanges
from scheduler.live.gpu_health import UsableGpus
from scheduler.policy import Allocation, ChangedSince, NodeInfo, Plan
from silod.v1 import plan_pb2


_UNSEEN = object()


class Holdings:
    def __init__(self, changes_from: Callable[[plan_pb2.AllocationPlan | None], EntryChanges | None]) -> None:
        self._changes_from = changes_from  # PlanStore.changes_from: what the plan in force changed of a plan
        self._plan: plan_pb2.AllocationPlan | None = None
        # job -> its allocation under _plan (None: placed nowhere), in the order of _plan's entries,
        # so that the Plan handed to the policy is the one convert.plan_from_proto gives
        self._allocations: dict[str, Allocation | None] = {}
        self._nodes: tuple[object, ...] = ()  # the live nodes' sizes and faulted GPUs _kept holds for
        self._kept: dict[str, Allocation | None] = {}  # job -> what it keeps of its allocation on them
        self._alive: Mapping[str, NodeInfo] | None = None  # the objects _nodes was read off
        self._usable: UsableGpus | None = None
        self._current: dict[str, Allocation] | None = None  # the last answer (the hint's before)

    def current(self, latest: plan_pb2.AllocationPlan | None, min_gpus: Mapping[str, int],
                alive: Mapping[str, NodeInfo], usable: UsableGpus) -> Plan:
        """What each job of ``min_gpus`` (the active training jobs) holds under ``latest`` on the
        ``alive`` nodes' ``usable`` GPUs, if that is at least its min_gpus (else it holds nothing),
        with the jobs whose allocation is not the last answer's object (Plan.changed).

        Still a pass over the plan's entries, in their order (the policies see the order a whole
        conversion gives), but each a lookup; only what changed is converted and checked."""
        self._follow(latest)
        # What a job keeps depends on its allocation, the live nodes' sizes and the faulted GPUs
        # only: while those are as last round, last round's answer per job stands (most rounds).
        if alive is not self._alive or usable is not self._usable:  # the snapshot keeps both while no node changed
            nodes = (tuple((name, info.gpus) for name, info in alive.items()), tuple(sorted(usable.faulted.items())))
            if nodes != self._nodes:
                self._nodes, self._kept = nodes, {}
            self._alive, self._usable = alive, usable
        kept = self._kept
        current: dict[str, Allocation] = {}
        made: list[str] = []
        for job_id, alloc in self._allocations.items():
            if alloc is None or job_id not in min_gpus:
                continue  # placed nowhere, or finished or cancelled: holds nothing any more
            survivor = kept.get(job_id, _UNSEEN)
            if survivor is _UNSEEN:
                survivor = kept[job_id] = _surviving(alloc, alive, usable, min_gpus[job_id])
                made.append(job_id)
            if survivor is not None:
                current[job_id] = survivor  # type: ignore[assignment]
        before = self._current
        self._current = current
        if before is None:
            return Plan(current)
        # An answer not made now is last answer's object, unless the job came or went from it.
        entries = {job_id: current.get(job_id) for job_id in made}
        entries.update((job_id, current.get(job_id)) for job_id in before.keys() ^ current.keys())
        return Plan(current, changed=ChangedSince(before, current, entries))

    def _follow(self, latest: plan_pb2.AllocationPlan | None) -> None:
        if latest is self._plan:
            return
        changes = self._changes_from(self._plan) if self._plan is not None and latest is not None else None
        if changes is None or not changes.in_place:
            self._allocations = {e.job_id: convert.allocation_of(e) for e in latest.jobs} if latest is not None else {}
            self._kept = {}
        else:
            for job_id in changes.removals:
                self._allocations.pop(job_id, None)
                self._kept.pop(job_id, None)
            for job_id, entry in changes.upserts.items():  # in place, or new ones last: as in the plan
                self._allocations[job_id] = convert.allocation_of(entry)
                self._kept.pop(job_id, None)
        self._plan = latest


def _surviving(alloc: Allocation, alive: Mapping[str, NodeInfo], usable: UsableGpus, min_gpus: int) -> Allocation | None:
    """``alloc`` without its placements on lost nodes and faulted GPUs, if the job can still run
    on what is left."""
    survivors = usable.without_faulted(tuple(
        (node, idx) for node, idx in alloc.placement if node in alive and all(i < alive[node].gpus for i in idx)))
    if sum(len(idx) for _, idx in survivors) < max(1, min_gpus):
        return None
    return Allocation(placement=survivors, batch_size=alloc.batch_size,
                      cache_bytes={n: b for n, b in alloc.cache_bytes.items() if n in alive},
                      remote_io_bytes_per_s=alloc.remote_io_bytes_per_s, gpu_type=alloc.gpu_type)

