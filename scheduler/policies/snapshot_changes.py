"""What changed in a snapshot since the one a policy's memo saw last: the jobs whose JobInfo is
not the object seen, the jobs that left, and the jobs to look at again.

The memos of :mod:`scheduler.policies.fifo_queue` and :mod:`scheduler.policies.ranked_queue`
keep what their last call worked out and follow each snapshot from the one before. Where the
snapshot says which jobs and which current allocations changed (ClusterSnapshot.jobs_changed,
Plan.changed) and the hint follows what the memo saw, only those are named; otherwise every job
is compared with what it was, by identity (the live scheduler and the simulator hand the same
JobInfo and Allocation objects for what did not change).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from scheduler.policy import ClusterSnapshot, JobInfo


@dataclasses.dataclass
class SnapshotChanges:
    jobs: dict[str, JobInfo]  # the snapshot's jobs by id
    changed: list[tuple[str, JobInfo]]  # jobs whose JobInfo is not the object seen (arrivals included)
    left: list[str]  # jobs seen that the snapshot no longer has
    looked: list[tuple[str, JobInfo]]  # jobs whose JobInfo or current allocation may have changed


def changes_since(seen: Mapping[str, JobInfo], seen_jobs: object, seen_current: object,
                  snapshot: ClusterSnapshot) -> SnapshotChanges:
    """``seen``: the jobs by id as last seen; ``seen_jobs`` and ``seen_current``: the snapshot's job
    tuple and current allocations that were (the containers the hints must follow)."""
    hint = snapshot.jobs_changed
    changed_jobs = hint.entries if hint is not None and hint.follows(seen_jobs, snapshot.jobs) else None
    current = snapshot.current.allocations
    held_hint = snapshot.current.changed
    changed_held = held_hint.entries if held_hint is not None and held_hint.follows(seen_current, current) \
        else None
    if changed_jobs is not None:
        jobs = dict(seen)
        for job_id, job in changed_jobs.items():
            if job is None:
                jobs.pop(job_id, None)
            else:
                jobs[job_id] = job
        candidates = [(job_id, job) for job_id, job in changed_jobs.items() if job is not None]
        left = [job_id for job_id, job in changed_jobs.items() if job is None and job_id in seen]
    else:
        jobs = {job.job_id: job for job in snapshot.jobs}
        candidates = list(jobs.items())
        left = [j for j in seen if j not in jobs] if len(jobs) != len(seen) or any(j not in jobs for j in seen) else []
    changed = [(job_id, job) for job_id, job in candidates if seen.get(job_id) is not job]
    if changed_jobs is not None and changed_held is not None:
        # Any other job is as it was, and so is what it holds.
        looked = [(job_id, jobs[job_id]) for job_id in sorted({*changed_jobs, *changed_held}) if job_id in jobs]
    else:
        looked = list(jobs.items())
    return SnapshotChanges(jobs, changed, left, looked)
