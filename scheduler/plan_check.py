"""The plan invariants (scheduler.invariants) checked round after round by what changed.

A round checks a plan over 20,000 jobs in which a handful of allocations changed since the last
plan checked. :class:`PlanCheck` keeps what the last check summed (who holds each GPU, cache
quotas, requested cores and memory, remote IO per node and in all) and checks only the
allocations that are not the same objects as last time, against those sums, and only the nodes
they touch. When it finds anything it runs the whole check (scheduler.invariants.plan_problems)
for the message, so a plan is refused with exactly the problems the whole check lists, and a
plan the whole check passes is never refused. A new node tuple, another storage budget, or
every REBUILD_EVERY checks (float sums drift), it checks the whole plan again.

The live planner and the simulator keep one per sequence of plans they check.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from scheduler.invariants import _TOLERANCE, PlanViolation, plan_problems
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo, Plan

REBUILD_EVERY = 256
Gpu = tuple[str, int]


@dataclasses.dataclass
class _Sums:
    nodes: tuple  # the node tuple summed over (identity)
    by_name: dict[str, NodeInfo]
    budget: float
    jobs: dict[str, JobInfo]
    allocations: dict[str, Allocation]
    holder: dict[Gpu, str] = dataclasses.field(default_factory=dict)
    cache: dict[str, float] = dataclasses.field(default_factory=dict)
    requested: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # node -> [cores, bytes]
    nic: dict[str, float] = dataclasses.field(default_factory=dict)
    io_total: float = 0.0
    checks: int = 0
    # The containers last checked, by identity: the snapshot's jobs and the plan's allocations,
    # which a new snapshot's and plan's hints (ClusterSnapshot.jobs_changed, Plan.changed) may follow.
    seen_jobs: tuple = ()
    seen_allocations: object = None
    hints_followed: tuple[bool, bool] = (False, False)  # (jobs, plan) by the last follow (tests)


class PlanCheck:
    def __init__(self) -> None:
        self._sums: _Sums | None = None
        self.last_check = "whole"  # or "changes": how the last plan was checked (tests)

    def check(self, snapshot: ClusterSnapshot, plan: Plan) -> None:
        """Raise PlanViolation listing every problem of ``plan`` (as check_plan does), if any."""
        problems = self.problems(snapshot, plan)
        if problems:
            raise PlanViolation("; ".join(problems))

    def problems(self, snapshot: ClusterSnapshot, plan: Plan) -> list[str]:
        sums = self._sums
        self._sums = None  # kept again only if this plan passes
        if sums is None or sums.nodes is not snapshot.nodes or sums.budget != snapshot.storage_bandwidth_bytes_per_s \
                or sums.checks >= REBUILD_EVERY:
            self.last_check = "whole"
            problems = plan_problems(snapshot, plan)
            if not problems:
                self._sums = _summed(snapshot, plan)
            return problems
        self.last_check = "changes"
        sums.hints_followed = (False, False)
        if not _follow(sums, snapshot, plan):
            return plan_problems(snapshot, plan)  # the whole check names the problems (or finds none)
        sums.checks += 1
        self._sums = sums
        return []


def _summed(snapshot: ClusterSnapshot, plan: Plan) -> _Sums:
    sums = _Sums(snapshot.nodes, {n.name: n for n in snapshot.nodes}, snapshot.storage_bandwidth_bytes_per_s,
                 {j.job_id: j for j in snapshot.jobs}, dict(plan.allocations),
                 seen_jobs=snapshot.jobs, seen_allocations=plan.allocations)
    for job_id, allocation in plan.allocations.items():
        _add(sums, job_id, sums.jobs[job_id], allocation, set())
    return sums


def _follow(sums: _Sums, snapshot: ClusterSnapshot, plan: Plan) -> bool:
    """Bring ``sums`` to ``plan``; False at the first sign of a problem (sums then unusable)."""
    before_jobs = sums.jobs
    rechecked: set[str] = set()  # jobs whose allocation must be checked again: their bounds or requests changed
    # The jobs and allocations to compare: those the hints name, where they follow the last
    # check's; else every one.
    job_hint = snapshot.jobs_changed
    followed_jobs = job_hint is not None and job_hint.follows(sums.seen_jobs, snapshot.jobs)
    if followed_jobs:
        assert job_hint is not None
        jobs = dict(before_jobs)
        for job_id, job in job_hint.entries.items():
            if job is None:
                jobs.pop(job_id, None)
            else:
                jobs[job_id] = job
        compared = ((job_id, job) for job_id, job in job_hint.entries.items() if job is not None)
        left: Iterable[str] = [job_id for job_id, job in job_hint.entries.items() if job is None and job_id in before_jobs]
    else:
        jobs = {job.job_id: job for job in snapshot.jobs}
        compared = iter(jobs.items())
        left = before_jobs.keys() - jobs.keys()
    for job_id, job in compared:
        old = before_jobs.get(job_id)
        if old is not job and old is not None and (old.min_gpus, old.max_gpus, old.cpus_per_rank, old.memory_bytes_per_rank) \
                != (job.min_gpus, job.max_gpus, job.cpus_per_rank, job.memory_bytes_per_rank):
            rechecked.add(job_id)
    allocations, before = plan.allocations, sums.allocations
    plan_hint = plan.changed
    sums.hints_followed = (followed_jobs, plan_hint is not None and plan_hint.follows(sums.seen_allocations, allocations))
    if sums.hints_followed[1]:
        assert plan_hint is not None
        looked = [(job_id, a) for job_id, a in plan_hint.entries.items() if a is not None]
        looked += [(job_id, allocations[job_id]) for job_id in rechecked if job_id in allocations]
        gone = [job_id for job_id, a in plan_hint.entries.items() if a is None and job_id in before]
    else:
        looked = allocations.items()  # type: ignore[assignment]
        gone = [job_id for job_id in before if job_id not in allocations]
    changed: dict[str, None] = {}  # in the order looked at, once each
    for job_id, a in looked:
        held = before.get(job_id)
        if held is a and job_id not in rechecked:
            continue
        if held is not None and held == a and job_id not in rechecked:
            # The same allocation made again (a whole pass, then fifo's queue): counted already;
            # kept by identity, so the next plan that hands the same object on is passed at once.
            before[job_id] = a
            continue
        changed[job_id] = None
    if any(job_id not in jobs for job_id in changed):
        return False  # an allocation of a job that is not active
    if left and any(job_id in allocations for job_id in left):
        return False  # kept for a job that is no longer active
    touched: set[str] = set()
    for job_id in (*gone, *(j for j in changed if j in before)):
        _remove(sums, job_id, before_jobs[job_id], before[job_id], touched)
        del before[job_id]
    sums.jobs = jobs
    for job_id in changed:
        if not _add(sums, job_id, jobs[job_id], allocations[job_id], touched):
            return False
        before[job_id] = allocations[job_id]
    for name in touched:
        if not _node_fits(sums, name):
            return False
    sums.seen_jobs, sums.seen_allocations = snapshot.jobs, allocations
    budget = sums.budget
    return not (math.isfinite(budget) and sums.io_total > budget * (1 + _TOLERANCE) + _TOLERANCE)


def _add(sums: _Sums, job_id: str, job: JobInfo, allocation: Allocation, touched: set[str]) -> bool:
    """Count ``allocation`` in; False if it breaks a rule of its own or takes a GPU someone holds."""
    gpus = allocation.gpus
    ok = not (gpus and not job.min_gpus <= gpus <= job.max_gpus) and allocation.batch_size >= 0
    for name, indices in allocation.placement:
        node = sums.by_name.get(name)
        if node is None:
            return False
        touched.add(name)
        for index in indices:
            if not 0 <= index < node.gpus or (name, index) in sums.holder:
                return False
            sums.holder[(name, index)] = job_id
        if job.cpus_per_rank or job.memory_bytes_per_rank:
            entry = sums.requested.setdefault(name, [0.0, 0.0])
            entry[0] += len(indices) * job.cpus_per_rank
            entry[1] += len(indices) * job.memory_bytes_per_rank
    for name, quota in allocation.cache_bytes.items():
        if not quota >= 0 or name not in sums.by_name:
            return False
        sums.cache[name] = sums.cache.get(name, 0.0) + quota
        touched.add(name)
    io = allocation.remote_io_bytes_per_s
    if not io >= 0:
        return False
    if math.isfinite(io):
        sums.io_total += io
        for name, indices in allocation.placement:
            if gpus and indices:
                sums.nic[name] = sums.nic.get(name, 0.0) + io * len(indices) / gpus
    return ok


def _remove(sums: _Sums, job_id: str, job: JobInfo, allocation: Allocation, touched: set[str]) -> None:
    """Count ``allocation`` (counted in by _add when it passed) out again."""
    gpus = allocation.gpus
    for name, indices in allocation.placement:
        touched.add(name)
        for index in indices:
            if sums.holder.get((name, index)) == job_id:
                del sums.holder[(name, index)]
        if job.cpus_per_rank or job.memory_bytes_per_rank:
            entry = sums.requested[name]
            entry[0] -= len(indices) * job.cpus_per_rank
            entry[1] -= len(indices) * job.memory_bytes_per_rank
    for name, quota in allocation.cache_bytes.items():
        sums.cache[name] -= quota
        touched.add(name)
    io = allocation.remote_io_bytes_per_s
    if math.isfinite(io):
        sums.io_total -= io
        for name, indices in allocation.placement:
            if gpus and indices:
                sums.nic[name] -= io * len(indices) / gpus


def _node_fits(sums: _Sums, name: str) -> bool:
    node = sums.by_name[name]
    if sums.cache.get(name, 0.0) > node.cache_capacity_bytes * (1 + _TOLERANCE) + _TOLERANCE:
        return False
    cores, memory = sums.requested.get(name, (0.0, 0.0))
    if cores > node.cpus * (1 + _TOLERANCE) + _TOLERANCE or memory > node.memory_bytes * (1 + _TOLERANCE) + _TOLERANCE:
        return False
    nic = sums.nic.get(name, 0.0)
    return not (math.isfinite(node.nic_bytes_per_s) and nic > node.nic_bytes_per_s * (1 + _TOLERANCE) + _TOLERANCE)

