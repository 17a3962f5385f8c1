"""A ranked rigid policy's jobs kept between calls (sjf, tiresias): a round over 20,000 jobs with a
handful of changes works on the changes and on numbers, not on 20,000 JobInfos.

Such a policy (:func:`scheduler.policies.estimates.rigid_plan`) ranks every job by a key, then
admits jobs in that order while their requested count fits what is unclaimed, and places them:
the running jobs admitted keep their GPUs, the others get fresh ones in order. This memo gives the
same plan, and keeps the policy a pure function of the snapshot: what it keeps is only what the
last call worked out, used where the answer is provably the one a whole pass gives. It follows
clusters of one GPU type whose running jobs each hold exactly their requested count on GPUs that
exist and nobody else holds, with no cached datasets and no cores or memory requested; anything
else makes the call a whole pass (the policy's own) and the memo starts afresh from the next.

Kept per job, in arrays: the part of its key its JobInfo decides (computed again only when the
JobInfo changes: sjf's remaining time packed, tiresias' queue), its priority, arrival and count,
and whether it runs in place; besides, the free GPUs once the running jobs took theirs. A call
updates those from what changed (:mod:`scheduler.policies.snapshot_changes`), sorts the keys, and
walks the order from event to event instead of job by job. Before the first waiting job that is
admitted, every running job is admitted: the running jobs all held their GPUs together, so each
fits after those ranked before it. From there on, an *event* is a waiting job that fits or a
running job that no longer does; the room at each position between events is known from a
running sum, so each event is one vectorized search. In a steady round there are as many events
as jobs that start or stop (a cap hands the rest to a plain walk). tests/scheduler/test_ranked_queue.py
checks the plan against the whole pass call after call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from scheduler.placement import FreeGpus, fresh_placement, gpu_allocation
from scheduler.policies.memo import PolicyMemo, keep_running
from scheduler.policies.snapshot_changes import changes_since
from scheduler.policy import Allocation, ChangedSince, ClusterSnapshot, JobInfo, Plan

# Per job, the part of its key its JobInfo decides; called with the jobs whose JobInfo changed.
ValuesOf = Callable[[ClusterSnapshot, Sequence[JobInfo]], np.ndarray]
# (snapshot, values, runs in place) -> each job's key: lower ranks first.
KeysOf = Callable[[ClusterSnapshot, np.ndarray, np.ndarray], np.ndarray]
WholePass = Callable[[ClusterSnapshot], Plan]

_MAX_EVENTS = 64  # vectorized searches per call before the rest of the order is walked job by job


@dataclasses.dataclass
class _Ranked:
    nodes: tuple  # the snapshot's node tuple it was built for (identity)
    gpu_type: str  # the training pool's one GPU type
    capacity: int  # its GPUs
    free: FreeGpus  # every training GPU but those of the jobs running in place
    jobs: dict[str, JobInfo] = dataclasses.field(default_factory=dict)  # as last seen
    held: dict[str, Allocation] = dataclasses.field(default_factory=dict)  # running jobs: the current allocation
    kept: dict[str, Allocation] = dataclasses.field(default_factory=dict)  # running jobs: their plan allocation
    slot: dict[str, int] = dataclasses.field(default_factory=dict)  # job -> its row in the arrays
    ids: list = dataclasses.field(default_factory=list)  # row -> job (None: a free row)
    spare: list[int] = dataclasses.field(default_factory=list)  # free rows
    value: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    negative_priority: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    arrival: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    gpus: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    running: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=bool))
    live: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=bool))
    # What the last call saw and answered, by identity (hints followed, hint given).
    seen_jobs: tuple = ()
    seen_current: object = None
    answered: dict[str, Allocation] | None = None
    admitted: tuple[str, ...] = ()  # waiting jobs the last plan placed (new objects every call)
    left_out: tuple[str, ...] = ()  # running jobs the last plan left out
    touched: set[str] = dataclasses.field(default_factory=set)  # running jobs stopped or started this call

    def add(self, job: JobInfo) -> int:
        if not self.spare:
            grown = max(16, 2 * len(self.ids))
            self.spare = list(range(grown - 1, len(self.ids) - 1, -1))
            self.ids.extend([None] * (grown - len(self.ids)))
            for name in ("value", "negative_priority", "arrival", "gpus", "running", "live"):
                old = getattr(self, name)
                new = np.zeros(grown, dtype=old.dtype)
                new[:len(old)] = old
                setattr(self, name, new)
        row = self.spare.pop()
        self.ids[row], self.slot[job.job_id] = job.job_id, row
        self.live[row], self.running[row] = True, False
        self.describe(row, job)
        return row

    def describe(self, row: int, job: JobInfo) -> None:
        self.jobs[job.job_id] = job
        self.negative_priority[row], self.arrival[row], self.gpus[row] = -job.priority, job.submit_time_s, job.requested

    def remove(self, job_id: str) -> None:
        row = self.slot.pop(job_id)
        self.ids[row] = None
        self.live[row] = self.running[row] = False
        self.spare.append(row)
        del self.jobs[job_id]

    def start(self, job: JobInfo, held: Allocation) -> bool:
        """``job`` runs in place on ``held`` (False: not its requested count, or GPUs not free)."""
        kept = keep_running(held, self.free, self.gpu_type) if held.gpus == job.requested else None
        if kept is None:
            return False
        self.held[job.job_id], self.kept[job.job_id] = held, kept
        self.running[self.slot[job.job_id]] = True
        self.touched.add(job.job_id)
        return True

    def stop(self, job_id: str) -> bool:
        """``job_id`` no longer runs as it did: its GPUs back (False: they were not taken)."""
        held = self.held.pop(job_id, None)
        if self.kept.pop(job_id, None) is not None:
            self.touched.add(job_id)
        if job_id in self.slot:
            self.running[self.slot[job_id]] = False
        return held is None or all(self.free.release(node, indices) for node, indices in held.placement)


class RankedQueue(PolicyMemo[_Ranked]):
    """The memo of one ranked policy object."""

    def __init__(self) -> None:
        super().__init__()
        self.last_events = 0  # events the last call's walk stopped at (tests, benchmarks)

    def schedule(self, snapshot: ClusterSnapshot, values_of: ValuesOf, keys_of: KeysOf, whole_pass: WholePass) -> Plan:
        with self._lock:
            state = self._kept_for(snapshot)
            if state is not None and self._follow(state, snapshot, values_of):
                self.last_call = "queue"
                return _admit(state, snapshot, keys_of, self)
            plan = whole_pass(snapshot)
            self._keep_after_whole_pass(snapshot, lambda: self._build(snapshot, values_of))
            return plan

    def _follow_failed(self, why: str) -> bool:
        self.why_whole = why
        return False

    def _build(self, snapshot: ClusterSnapshot, values_of: ValuesOf) -> _Ranked | None:
        types = snapshot.gpu_types()
        if len(types) != 1 or snapshot.cached_bytes:
            return self._whole_because("several GPU types, or datasets cached")
        free = FreeGpus(snapshot)
        state = _Ranked(snapshot.nodes, types[0], free.total, free)
        current = snapshot.current.allocations
        for job in snapshot.jobs:
            if not _followed(job, state.gpu_type):
                return self._whole_because(f"{job.job_id} requests cores or memory, or not the nodes' GPU type")
            state.add(job)
            held = current.get(job.job_id)
            if held is not None and held.gpus and not state.start(job, held):
                return self._whole_because(f"{job.job_id} runs on other than its requested GPUs, or on GPUs not free")
        rows = [state.slot[job.job_id] for job in snapshot.jobs]
        state.value[rows] = values_of(snapshot, snapshot.jobs)
        state.seen_jobs, state.seen_current, state.touched = snapshot.jobs, current, set()
        return state

    def _follow(self, state: _Ranked, snapshot: ClusterSnapshot, values_of: ValuesOf) -> bool:
        """Brings ``state`` up to ``snapshot``; False where a whole pass is needed (the caller then
        drops the state, which may be half updated)."""
        if snapshot.cached_bytes:  # fresh placements would prefer the dataset's nodes
            return self._follow_failed("datasets cached")
        state.touched = set()
        changes = changes_since(state.jobs, state.seen_jobs, state.seen_current, snapshot)
        current = snapshot.current.allocations
        valued: list[JobInfo] = []
        for job_id, job in changes.changed:
            if not _followed(job, state.gpu_type):
                return self._follow_failed(f"{job_id} requests cores or memory, or not the nodes' GPU type")
            if job_id in state.slot:
                state.describe(state.slot[job_id], job)
            else:
                state.add(job)
            valued.append(job)
        for job_id in changes.left:
            if not state.stop(job_id):
                return self._follow_failed(f"{job_id} held GPUs not taken")
            state.remove(job_id)
        self.last_looked = len(changes.looked)
        starts: list[tuple[JobInfo, Allocation]] = []
        for job_id, job in changes.looked:
            held = current.get(job_id)
            if held is not None and not held.gpus:
                held = None
            was = state.held.get(job_id)
            if held is was:
                if held is not None and held.gpus != job.requested:  # its request changed
                    return self._follow_failed(f"{job_id} runs on other than its requested GPUs")
                continue
            if held is not None and was is not None and held == was and held.gpus == job.requested:
                state.held[job_id] = held
                continue
            if not state.stop(job_id):
                return self._follow_failed(f"{job_id} held GPUs not taken")
            if held is not None:
                starts.append((job, held))
        # Every GPU given back before any is taken: a job may start on GPUs another left this round.
        for job, held in starts:
            if not state.start(job, held):
                return self._follow_failed(f"{job.job_id} runs on other than its requested GPUs, or on GPUs not free")
        if valued:
            state.value[[state.slot[job.job_id] for job in valued]] = values_of(snapshot, valued)
        state.seen_jobs, state.seen_current = snapshot.jobs, current
        return True


def _followed(job: JobInfo, gpu_type: str) -> bool:
    return not job.has_requests and job.allows(gpu_type)


def _admit(state: _Ranked, snapshot: ClusterSnapshot, keys_of: KeysOf, queue: RankedQueue) -> Plan:
    """The whole pass's admission and placement, from the kept arrays."""
    order = _order(state, snapshot, keys_of)
    admitted_rows, left_out_rows, events = _walk(state.gpus[order], state.running[order], state.capacity)
    queue.last_events = events
    admitted = [state.ids[order[k]] for k in admitted_rows]
    left_out = [state.ids[order[k]] for k in left_out_rows]
    allocations = dict(state.kept)
    for job_id in left_out:
        del allocations[job_id]
    if admitted:
        free = state.free.copy()
        for job_id in left_out:
            for node, indices in state.held[job_id].placement:
                free.release(node, indices)
        current = snapshot.current.allocations
        for job_id in admitted:
            job = state.jobs[job_id]
            placement = fresh_placement(job, job.requested, free, {}, state.gpu_type)
            if placement is not None:
                allocations[job_id] = gpu_allocation(current.get(job_id), placement, 0, state.gpu_type)
    answered, state.answered = state.answered, allocations
    entries = {job_id: allocations.get(job_id)
               for job_id in (*state.touched, *state.admitted, *admitted, *state.left_out, *left_out)}
    state.admitted, state.left_out = tuple(admitted), tuple(left_out)
    if answered is None:
        return Plan(allocations)
    return Plan(allocations, changed=ChangedSince(answered, allocations, entries))


def _order(state: _Ranked, snapshot: ClusterSnapshot, keys_of: KeysOf) -> np.ndarray:
    """Rows of the live jobs by (key, -priority, arrival, job id), as the whole pass sorts them."""
    rows = np.flatnonzero(state.live)
    keys = np.asarray(keys_of(snapshot, state.value[rows], state.running[rows]), dtype=np.float64)
    keys = np.where(np.isnan(keys), np.inf, keys)  # as estimates.sorted_by: NaN would break the sort
    negative_priority, arrival = state.negative_priority[rows], state.arrival[rows]
    ranked = np.lexsort((arrival, negative_priority, keys))
    order = rows[ranked]
    keys, negative_priority, arrival = keys[ranked], negative_priority[ranked], arrival[ranked]
    tied = np.flatnonzero((keys[1:] == keys[:-1]) & (negative_priority[1:] == negative_priority[:-1])
                          & (arrival[1:] == arrival[:-1]))
    if len(tied):  # equal up to the job id: by id, as Python compares the whole pass's tuples
        start = 0
        while start < len(tied):
            end = start
            while end + 1 < len(tied) and tied[end + 1] == tied[end] + 1:
                end += 1
            first, last = int(tied[start]), int(tied[end]) + 1
            order[first:last + 1] = sorted(order[first:last + 1].tolist(), key=lambda row: state.ids[row])
            start = end + 1
    return order


def _walk(gpus: np.ndarray, running: np.ndarray, capacity: int) -> tuple[list[int], list[int], int]:
    """Gang admission over jobs in rank order (:func:`scheduler.policies.estimates.admit_typed` on
    one GPU type): ``(positions of the waiting jobs admitted, positions of the running jobs not
    admitted, vectorized searches made)``. Every other running job is admitted, no other waiting one."""
    count = len(gpus)
    held = np.where(running, gpus, 0)
    # The room before each position if exactly the running jobs ranked before it were admitted.
    room_before = capacity - (np.cumsum(held) - held)
    admitted: list[int] = []
    left_out: list[int] = []
    offset = 0  # GPUs of the waiting jobs admitted so far, less those of the running jobs left out
    position, events = 0, 0
    while position < count:
        if events == _MAX_EVENTS:
            _walk_rest(gpus, running, int(room_before[position]) - offset, position, admitted, left_out)
            break
        room = room_before[position:] - offset
        wanted = gpus[position:]
        hits = np.flatnonzero(np.where(running[position:], wanted > room, (wanted <= room) & (wanted > 0)))
        if not len(hits):
            break
        events += 1
        at = position + int(hits[0])
        position = at + 1
        if running[at]:
            left_out.append(at)
            offset -= int(gpus[at])
            continue
        admitted.append(at)
        offset += int(gpus[at])
        if int(room_before[at]) - offset == 0:  # nothing more is admitted: the running jobs after it are out
            left_out.extend((position + np.flatnonzero(running[position:])).tolist())
            break
    return admitted, left_out, events


def _walk_rest(gpus: np.ndarray, running: np.ndarray, room: int, position: int,
               admitted: list[int], left_out: list[int]) -> None:
    """The rest of :func:`_walk`'s order, job by job."""
    for at, (wanted, runs) in enumerate(zip(gpus[position:].tolist(), running[position:].tolist()), start=position):
        if room == 0:
            if runs:
                left_out.append(at)
            continue
        if wanted <= 0:
            continue
        if wanted <= room:
            room -= wanted
            if not runs:
                admitted.append(at)
        elif runs:
            left_out.append(at)
