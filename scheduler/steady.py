"""When a policy's plan can next change: the promise a policy may make beside its plan.

A policy is a pure function of the snapshot, and from one round to the next most of a
snapshot does not change: between arrivals and departures only the clock moves, running jobs
make progress and gain attained service. Many policies ignore those, or only care when they
cross a line (Tiresias' queue thresholds). A policy that knows this may say so with
``stable_until(snapshot, plan)``, where ``plan`` is what ``schedule(snapshot)`` returned: a
:class:`Steadiness` whose ``until`` is a time before which ``schedule`` is certain to return
``plan`` again for every snapshot that differs from ``snapshot`` only by

- ``time_s`` (later, before ``until``);
- ``current`` being ``plan`` (the plan was carried out unchanged);
- the progress of the jobs ``plan`` gives GPUs: ``samples_done`` not decreasing (it may stand
  still, as during a restart), ``attained_gpu_s`` growing by the job's GPUs under ``plan``
  every second; the other jobs' progress and service unchanged;

and, with ``departures``, also by jobs having left (finished), the plan then being ``plan``
without them. Anything else (a job arrives, a node or quota changes, caches fill, inference
replicas come and go) voids the promise. ``until`` <= ``snapshot.time_s`` promises nothing.

The simulator uses it to leave out rounds whose plan is known (docs/evaluation.md, "How the
simulation works"); it is pure, like the policies, and checked by tests that run every round
and compare (``tests/simulator/test_steady_rounds.py``). The helpers here are the pieces the
policies' promises are made of.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.policy import ClusterSnapshot, JobInfo, Plan


@dataclass(frozen=True)
class Steadiness:
    until: float                  # schedule() returns the plan at every time before this
    departures: bool = False      # ... and also after jobs finish (the plan without them)


NO_PROMISE = Steadiness(-math.inf)
FOREVER = Steadiness(math.inf)
FOREVER_DEPARTURES = Steadiness(math.inf, departures=True)


def unchanged(snapshot: ClusterSnapshot, plan: Plan) -> bool:
    """Is ``plan`` the plan in force (a fixed point: the policy, shown its own plan, keeps it)?"""
    current = snapshot.current.allocations
    allocations = plan.allocations
    if len(current) != len(allocations):
        return False
    for job_id, allocation in allocations.items():
        held = current.get(job_id)
        if held is not allocation and held != allocation:
            return False
    return True


def everyone_placed(snapshot: ClusterSnapshot, plan: Plan) -> bool:
    """Does every active job hold GPUs under ``plan``?"""
    allocations = plan.allocations
    return all(job.job_id in allocations for job in snapshot.jobs)


def everyone_holds_requested(snapshot: ClusterSnapshot, plan: Plan) -> bool:
    """Does every active job hold exactly its requested count under ``plan``? Rigid admission
    (:func:`scheduler.policies.estimates.admit_typed`) then admits every job whatever the order,
    and placement keeps each where it runs: nobody waits, so no order can change the plan."""
    allocations = plan.allocations
    for job in snapshot.jobs:
        allocation = allocations.get(job.job_id)
        if allocation is None or allocation.gpus != job.requested:
            return False
    return True


def _safely_before(time_s: float) -> float:
    """``time_s`` less a margin for the rounding of accumulated progress (a millisecond, more
    for late times): a line is never crossed at a time the promise still covers."""
    return time_s - 1e-3 - 1e-9 * abs(time_s)


def threshold_crossing(snapshot: ClusterSnapshot, plan: Plan, thresholds: Sequence[float]) -> float:
    """The earliest time a job holding GPUs under ``plan`` reaches the next of ``thresholds``
    (ascending attained GPU-seconds), less a margin; inf if none will."""
    earliest = math.inf
    allocations = plan.allocations
    for job in snapshot.jobs:
        allocation = allocations.get(job.job_id)
        if allocation is None:
            continue
        gpus = allocation.gpus
        if gpus <= 0:
            continue
        above = next((t for t in thresholds if t > job.attained_gpu_s), None)
        if above is not None:
            earliest = min(earliest, snapshot.time_s + (above - job.attained_gpu_s) / gpus)
    return _safely_before(earliest) if math.isfinite(earliest) else math.inf


def attained_order_change(snapshot: ClusterSnapshot, plan: Plan, jobs: Sequence[JobInfo] | None = None) -> float:
    """The earliest time the order of ``jobs`` (default: the snapshot's) by ``(attained_gpu_s,
    submit_time_s, job_id)`` can change while ``plan`` holds, less a margin; inf if never.

    Attained service grows at each job's GPUs under ``plan``; two jobs first swap places when a
    faster-growing job catches up with the next one above it (kinetic sorting: the first swap
    of any sequence is between neighbours), so the neighbours' meeting times bound it.
    """
    jobs = snapshot.jobs if jobs is None else jobs
    if len(jobs) < 2:
        return math.inf
    allocations = plan.allocations
    ranked = sorted(jobs, key=lambda j: (j.attained_gpu_s, j.submit_time_s, j.job_id))
    growth = [allocations[j.job_id].gpus if j.job_id in allocations else 0 for j in ranked]
    earliest = math.inf
    for k in range(len(ranked) - 1):
        faster = growth[k] - growth[k + 1]
        if faster > 0:
            meet = (ranked[k + 1].attained_gpu_s - ranked[k].attained_gpu_s) / faster
            earliest = min(earliest, meet)
    if not math.isfinite(earliest):
        return math.inf
    return _safely_before(snapshot.time_s + earliest)
