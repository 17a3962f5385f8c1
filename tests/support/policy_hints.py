"""Change hints as the live scheduler hands them (ClusterSnapshot.jobs_changed, Plan.changed), for
the tests of the policies' memos (scheduler.policies.fifo_queue, scheduler.policies.ranked_queue)."""

from __future__ import annotations

import dataclasses
import random

from scheduler.policy import ChangedSince, ClusterSnapshot, Plan


def diff(before: dict, after: dict, rng: random.Random) -> dict:
    """A ChangedSince's entries from ``before`` to ``after``: every key whose object differs, and
    (as a maker may) a few that do not."""
    entries = {k: after.get(k) for k in before.keys() | after.keys() if before.get(k) is not after.get(k)}
    entries.update((k, after[k]) for k in rng.sample(sorted(after), min(3, len(after))))
    return entries


def hinted(last: ClusterSnapshot | None, snapshot: ClusterSnapshot, rng: random.Random) -> ClusterSnapshot:
    """``snapshot`` with the hints the live scheduler gives (ClusterSnapshot.jobs_changed, Plan.changed)."""
    if last is None:
        return snapshot
    jobs_before = {j.job_id: j for j in last.jobs}
    jobs_after = {j.job_id: j for j in snapshot.jobs}
    current = snapshot.current.allocations
    return dataclasses.replace(
        snapshot, jobs_changed=ChangedSince(last.jobs, snapshot.jobs, diff(jobs_before, jobs_after, rng)),
        current=Plan(current, changed=ChangedSince(last.current.allocations, current,
                                                   diff(dict(last.current.allocations), dict(current), rng))))


def check_plan_hint(last: Plan | None, plan: Plan) -> None:
    """``plan.changed``, where given, names every allocation that is not ``last``'s object."""
    if last is None or plan.changed is None:
        return
    assert plan.changed.follows(last.allocations, plan.allocations)
    for job_id in last.allocations.keys() | plan.allocations.keys():
        if job_id in plan.changed.entries:
            assert plan.changed.entries[job_id] is plan.allocations.get(job_id)
        else:
            assert last.allocations.get(job_id) is plan.allocations.get(job_id), job_id


def settled(policy, snapshot: ClusterSnapshot, rounds: int = 3) -> ClusterSnapshot:  # type: ignore[no-untyped-def]
    """``snapshot`` with ``policy``'s own plan in force after ``rounds`` calls (a policy's memo is
    built on the second call on the same nodes and answers the third)."""
    for _ in range(rounds):
        snapshot = dataclasses.replace(snapshot, current=policy.schedule(snapshot))
    return snapshot
