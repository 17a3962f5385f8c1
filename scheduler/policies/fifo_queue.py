"""FIFO's queue kept between calls: a round over 20,000 jobs with a handful of changes looks at
the changes, not at every job.

:class:`~scheduler.policies.fifo.FifoPolicy` is a pure function of the snapshot, and this keeps
it one: what is kept is only what the last call worked out, and a call uses it only where the
answer is provably the one a whole pass gives. A whole pass over a snapshot whose running jobs
all keep what they hold (each within its bounds, on GPUs that exist and nobody else holds, of
a type it allows) amounts to: every running job keeps its GPUs, then the waiting jobs, in
arrival order, take the first free GPUs their count fits (tightest node first). So kept here:

- the free GPUs once the running jobs took theirs (a :class:`~scheduler.placement.FreeGpus`
  carried from call to call: a job that stops running gives its GPUs back, one that starts
  takes them), and the running jobs' allocations as the plan states them;
- the waiting jobs in arrival order (a sorted list: arrivals are inserted, starters removed).

A call compares the snapshot with the last one it saw by identity (the live scheduler and the
simulator hand the same JobInfo and Allocation objects for what did not change), updates the
two from the differences, and places waiting jobs until no free GPU is left. Where the snapshot
says which jobs and which current allocations changed since the one this queue saw last
(ClusterSnapshot.jobs_changed, Plan.changed), only those are compared; the plan it returns says
in turn which allocations are not the last plan's objects (the running jobs that stopped or
started, and the waiting jobs placed, last call and this one). Anything it does
not follow (a job's bounds or types, GPU types, ranks' cores and memory, cached datasets, new
nodes) makes it do the whole pass, as before, and start afresh from its outcome.
tests/scheduler/test_fifo_queue.py checks the two against each other call after call.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping

from scheduler.placement import FreeGpus, Placement, fresh_placement, gpu_allocation, node_types
from scheduler.policy import Allocation, ChangedSince, ClusterSnapshot, JobInfo, Plan
from scheduler.policies.memo import PolicyMemo, keep_running
from scheduler.policies.snapshot_changes import changes_since

WholePass = Callable[[ClusterSnapshot], dict[str, Placement]]


@dataclasses.dataclass
class _Queue:
    nodes: tuple  # the snapshot's node tuple it was built for (identity)
    gpu_type: str  # the training pool's one GPU type
    jobs: dict[str, JobInfo]  # the snapshot's jobs by id, as last seen
    running: dict[str, Allocation]  # job -> what it holds (the snapshot's current allocation), running jobs
    kept: dict[str, Allocation]  # job -> its allocation in the plan, running jobs (gpu_allocation of the above)
    free: FreeGpus  # every training GPU but the running jobs'
    waiting: list[tuple[float, str]]  # (arrival, job) of the jobs not running, in arrival order
    smallest_wait: int  # no waiting job asks for fewer GPUs (a lower bound: kept, not recomputed)
    # What the last call saw and answered, by identity, to follow the snapshot's hints
    # (ClusterSnapshot.jobs_changed, Plan.changed) and give one with the plan.
    seen_jobs: tuple = ()
    seen_current: object = None
    answered: dict[str, Allocation] | None = None  # the allocations of the last plan
    admitted: tuple[str, ...] = ()  # the waiting jobs that plan placed (new objects every call)
    touched: set[str] = dataclasses.field(default_factory=set)  # running jobs stopped or started this call


class FifoQueue(PolicyMemo[_Queue]):
    """The memo of one FifoPolicy object."""

    def schedule(self, snapshot: ClusterSnapshot, backfill: bool, whole_pass: WholePass) -> Plan:
        with self._lock:
            queue = self._kept_for(snapshot)
            if queue is not None:
                plan = self._follow(queue, snapshot, backfill)
                if plan is not None:
                    self.last_call = "queue"
                    return plan
            plan = _plan(whole_pass(snapshot), snapshot)
            self._keep_after_whole_pass(snapshot, lambda: _build(snapshot))
            return plan

    def _follow(self, queue: _Queue, snapshot: ClusterSnapshot, backfill: bool) -> Plan | None:
        """The plan by the queue, after updating it to ``snapshot``; None where a whole pass is
        needed (the caller then drops the queue, which may be half updated)."""
        if snapshot.cached_bytes:  # fresh placements would prefer the dataset's nodes
            return self._whole_because("datasets cached")
        jobs = queue.jobs
        queue.touched = set()
        changes = changes_since(jobs, queue.seen_jobs, queue.seen_current, snapshot)
        current = snapshot.current.allocations
        for job_id, job in changes.changed:
            before = jobs.get(job_id)
            if before is None:
                if job.has_requests or not job.allows(queue.gpu_type):
                    return self._whole_because(f"{job_id} requests cores or memory, or not the nodes' GPU type")
            elif not _same_to_fifo(before, job):
                return self._whole_because(f"{job_id} changed its arrival, bounds or types")
        # Jobs that left, started, stopped or moved: the free GPUs and the waiting list follow.
        for job_id in changes.left:
            if not _stop(queue, job_id, jobs[job_id]):
                return self._whole_because(f"{job_id} held GPUs not taken")
        running = queue.running
        seen, looked = changes.jobs, changes.looked
        self.last_looked = len(looked)
        starts: list[tuple[JobInfo, Allocation]] = []
        for job_id, job in looked:
            held = current.get(job_id)
            if held is not None and not held.gpus:
                held = None
            was = running.get(job_id)
            if held is was:
                if held is None and job_id not in jobs:
                    _wait(queue, job)  # arrived, waits
                continue
            if held is not None and was is not None and held == was:
                running[job_id] = held
                continue
            if job_id in jobs and not _stop(queue, job_id, jobs[job_id]):
                return self._whole_because(f"{job_id} held GPUs not taken")
            if held is None:
                _wait(queue, job)
            else:
                starts.append((job, held))
        # Every GPU given back before any is taken: a job may start on GPUs another left this round.
        for job, held in starts:
            if not _run(queue, job, held):
                return self._whole_because(f"{job.job_id} holds GPUs that are not free, or out of its bounds")
        queue.jobs, queue.seen_jobs, queue.seen_current = seen, snapshot.jobs, current
        return _admit(queue, snapshot, backfill)


def _admit(queue: _Queue, snapshot: ClusterSnapshot, backfill: bool) -> Plan:
    """Running jobs keep their GPUs; waiting jobs in arrival order claim their count while it
    fits what is free (a claim holds even where no node's holes take it, as in the whole pass,
    whose claims come before its placements), and are placed in that order."""
    allocations = dict(queue.kept)
    admitted: list[str] = []
    free, room = None, queue.free.total
    if room >= queue.smallest_wait:
        jobs, gpu_type = queue.jobs, queue.gpu_type
        for _, job_id in queue.waiting:
            job = jobs[job_id]
            count = job.requested
            if count > room:
                if not backfill:
                    break
                continue
            room -= count
            if count > 0:
                if free is None:
                    free = queue.free.copy()
                placement = fresh_placement(job, count, free, {}, gpu_type)
                if placement is not None:
                    allocations[job_id] = gpu_allocation(None, placement, 0, _type_of(placement, snapshot))
                    admitted.append(job_id)
            if room < queue.smallest_wait:
                break  # no waiting job asks for this little
    answered, queue.answered = queue.answered, allocations
    if answered is None:
        queue.admitted = tuple(admitted)
        return Plan(allocations)
    # Only a running job that stopped or started changed its kept allocation; the placed waiting
    # jobs' are made anew every call, last call's and this one's.
    entries = {job_id: allocations.get(job_id) for job_id in (*queue.touched, *queue.admitted, *admitted)}
    queue.admitted = tuple(admitted)
    return Plan(allocations, changed=ChangedSince(answered, allocations, entries))


def _same_to_fifo(before: JobInfo, now: JobInfo) -> bool:
    """Is ``now`` the same job to FIFO as ``before`` (it reads no progress, model or tenant)?"""
    return (before.submit_time_s == now.submit_time_s and before.min_gpus == now.min_gpus
            and before.max_gpus == now.max_gpus and before.requested_gpus == now.requested_gpus
            and before.gpu_types == now.gpu_types and before.has_requests == now.has_requests)


def _type_of(placement: Placement, snapshot: ClusterSnapshot) -> str:
    return node_types(snapshot).get(placement[0][0], "") if placement else ""


def _stop(queue: _Queue, job_id: str, job: JobInfo) -> bool:
    """``job_id`` no longer runs nor waits as it did: its GPUs back, out of the waiting list."""
    held = queue.running.pop(job_id, None)
    if queue.kept.pop(job_id, None) is not None:
        queue.touched.add(job_id)
    if held is not None:
        for node, indices in held.placement:
            if not queue.free.release(node, indices):
                return False
        return True
    key = (job.submit_time_s, job_id)
    at = bisect.bisect_left(queue.waiting, key)
    if at < len(queue.waiting) and queue.waiting[at] == key:
        del queue.waiting[at]
    return True


def _wait(queue: _Queue, job: JobInfo) -> None:
    bisect.insort(queue.waiting, (job.submit_time_s, job.job_id))
    queue.smallest_wait = min(queue.smallest_wait, job.requested)


def _run(queue: _Queue, job: JobInfo, held: Allocation) -> bool:
    """``job`` runs on ``held``: its GPUs taken (False: one is not free, or not a training GPU)."""
    kept = keep_running(held, queue.free, queue.gpu_type) if job.min_gpus <= held.gpus <= job.max_gpus else None
    if kept is None:
        return False
    queue.running[job.job_id], queue.kept[job.job_id] = held, kept
    queue.touched.add(job.job_id)
    return True


def _build(snapshot: ClusterSnapshot) -> _Queue | None:
    """A queue for ``snapshot`` (None where it would not be followed: see the module docstring)."""
    types = snapshot.gpu_types()
    if len(types) != 1 or snapshot.cached_bytes:
        return None
    gpu_type = types[0]
    queue = _Queue(snapshot.nodes, gpu_type, {}, {}, {}, FreeGpus(snapshot), [], 1 << 30)
    current = snapshot.current.allocations
    for job in snapshot.jobs:
        if job.has_requests or not job.allows(gpu_type):
            return None
        queue.jobs[job.job_id] = job
        held = current.get(job.job_id)
        if held is not None and held.gpus:
            if not _run(queue, job, held):
                return None
        else:
            queue.waiting.append((job.submit_time_s, job.job_id))
            queue.smallest_wait = min(queue.smallest_wait, job.requested)
    queue.waiting.sort()
    queue.seen_jobs, queue.seen_current = snapshot.jobs, current
    return queue


def _plan(placements: Mapping[str, Placement], snapshot: ClusterSnapshot) -> Plan:
    from scheduler.placement import plan_from_placements

    return plan_from_placements(placements, snapshot=snapshot)
