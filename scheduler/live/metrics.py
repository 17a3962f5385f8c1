"""What the live scheduler exports to Prometheus (default registry, on --metrics-port).

Labels are fixed small sets (a phase, a job state, a GPU state, type and pool, a change's
kind), except the per-node acknowledged plan version, which has one series per node as a
node exporter would. The figures are set from what a round already computed: the snapshot,
the active jobs and the committed plan; nothing here calls a service.

docs/operators.md lists them; deploy/prometheus/alerts.yaml alerts on them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge, Histogram

from scheduler.live import convert
from scheduler.policy import ClusterSnapshot
from silod.v1 import common_pb2, plan_pb2

T = TypeVar("T")

ROUND_SECONDS = Histogram(
    "silod_scheduler_round_duration_seconds", "A scheduling round's wall time, by phase: snapshot (metadata reads "
    "and models), policy (the pure planning step), commit (plan commit and job state moves), total",
    ["phase"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4, 8, 16, 32))
ROUNDS = Counter("silod_scheduler_rounds_total", "Rounds by outcome: committed (a new plan version), unchanged "
                 "(the plan in force still holds), lost_race (another commit won; retried), failed", ["outcome"])
JOBS = Gauge("silod_scheduler_jobs", "Active jobs by state and tenant, as the last round saw them (tenants are the "
             "ones an admin made, a bounded set; \"\" for jobs that name none)", ["state", "tenant"])
OLDEST_PENDING = Gauge("silod_scheduler_oldest_pending_job_age_seconds",
                       "Age of the longest-waiting PENDING job at the last round (0 when none waits)")
GPUS = Gauge("silod_scheduler_gpus", "GPUs of live nodes by state under the plan in force: allocated (training on "
             "its own pool), lent (an inference-pool GPU training), inference, idle, faulted; by type and pool",
             ["state", "gpu_type", "pool"])
CACHE_GRANTED = Gauge("silod_scheduler_cache_bytes_granted", "Cache bytes the plan in force reserves for jobs, all nodes")
IO_GRANTED = Gauge("silod_scheduler_remote_io_bytes_per_second_granted",
                   "Remote-storage read rate the plan in force grants jobs, all nodes (bytes/s)")
PLAN_VERSION = Gauge("silod_scheduler_plan_version", "Version of the plan in force")
NODE_ACKED = Gauge("silod_scheduler_node_acked_plan_version",
                   "Last plan version a node's worker agent acknowledged (lag: silod_scheduler_plan_version minus this)",
                   ["node"])
JOB_CHANGES = Counter(
    "silod_scheduler_job_changes_total", "What committed plans did to jobs: started, resized_in_place, "
    "resized_by_restart, preempted (all GPUs taken; requeued), restarted_after_crash (a rank was killed)", ["kind"])
LENDS = Counter("silod_scheduler_gpu_lends_total", "Inference-pool GPUs given to training jobs by committed plans")
RECLAIMS = Counter("silod_scheduler_gpu_reclaims_total", "Lent inference-pool GPUs taken back from training jobs")
ESTIMATOR_SECONDS = Histogram("silod_scheduler_estimator_call_duration_seconds",
                              "Calls to the estimator service by method (the count is the number of calls)",
                              ["method", "outcome"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))

LEADER = Gauge("silod_scheduler_leader", "1 while this scheduler leads (runs rounds, commits plans, serves the "
               "nodes), 0 while it stands by (--leader-election); always 1 without --leader-election")
LEADERSHIP_EPOCH = Gauge("silod_scheduler_leadership_epoch", "The leadership lease's epoch as this scheduler last "
                         "saw it (0 without --leader-election); it increments at each change of leader")

_STATES = ("PENDING", "SCHEDULED", "RUNNING", "RESIZING")
_PHASES = ("snapshot", "policy", "commit", "total")


class RoundTimer:
    """The phases of one round (``timed``, around each phase's coroutine);
    ``done(outcome)`` adds the total and counts the round."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}  # phase -> seconds, "total" once done

    async def timed(self, phase: str, call: Awaitable[T]) -> T:
        started = time.monotonic()
        try:
            return await call
        finally:
            self.seconds[phase] = time.monotonic() - started
            ROUND_SECONDS.labels(phase).observe(self.seconds[phase])

    def done(self, outcome: str) -> None:
        self.seconds["total"] = time.monotonic() - self.started
        ROUND_SECONDS.labels("total").observe(self.seconds["total"])
        ROUNDS.labels(outcome).inc()


def jobs_seen(jobs: Iterable[common_pb2.Job], now_s: float) -> None:
    counts: dict[tuple[str, str], int] = {}
    oldest = 0.0
    for job in jobs:
        state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
        key = (state, job.spec.tenant)
        counts[key] = counts.get(key, 0) + 1
        if job.state == common_pb2.JOB_STATE_PENDING and job.created_at.seconds:
            oldest = max(oldest, now_s - job.created_at.ToSeconds())
    JOBS.clear()  # a tenant with no active job left has no series
    for state in _STATES:
        JOBS.labels(state, "").set(0)  # every state has a series, so a sum over them is never empty
    for (state, tenant), count in counts.items():
        JOBS.labels(state, tenant).set(count)
    OLDEST_PENDING.set(max(oldest, 0.0))


def plan_in_force(plan: plan_pb2.AllocationPlan | None, snap: ClusterSnapshot,
                  faulted: Mapping[str, frozenset[int]]) -> None:
    """GPUs by state, grants and version under ``plan``, on the nodes of ``snap`` (live ones)."""
    jobs = list(plan.jobs) if plan is not None else []
    training: dict[tuple[str, int], bool] = {}
    for entry in jobs:  # every GPU a rank holds; their order does not matter here
        for placement in entry.placements:
            for index in placement.gpu_indices:
                training[(placement.node, index)] = True
    inference = {(r.node, r.gpu_index) for r in (plan.replicas if plan is not None else [])
                 if r.state in (plan_pb2.REPLICA_STATE_RUNNING, plan_pb2.REPLICA_STATE_PROTECT)}
    counts: dict[tuple[str, str, str], int] = {}
    for node in snap.nodes:
        bad = faulted.get(node.name, frozenset())
        for index in range(node.gpus):  # every GPU of the node: the policy's narrower view is made later
            if index in bad:
                state = "faulted"
            elif (node.name, index) in training:
                state = "lent" if node.pool == "inference" else "allocated"
            elif (node.name, index) in inference:
                state = "inference"
            else:
                state = "idle"
            key = (state, node.gpu_type, node.pool)
            counts[key] = counts.get(key, 0) + 1
    GPUS.clear()
    for (state, gpu_type, pool), count in counts.items():
        GPUS.labels(state, gpu_type, pool).set(count)
    CACHE_GRANTED.set(sum(g.cache_quota_bytes for e in jobs for g in e.cache_grants))
    IO_GRANTED.set(sum(g.remote_io_bytes_per_s for e in jobs for g in e.cache_grants))
    PLAN_VERSION.set(plan.version if plan is not None else 0)


def plan_committed(new: plan_pb2.AllocationPlan, old: Mapping[str, plan_pb2.JobAllocation],
                   pools: Mapping[str, str]) -> None:
    """Count what ``new`` did to each job against ``old`` (the plan it replaced)."""
    lent_before = {(n, i) for e in old.values() for n, i in convert.ranks_of(e) if pools.get(n) == "inference"}
    lent_now = set()
    for entry in new.jobs:
        ranks = convert.ranks_of(entry)
        previous = old.get(entry.job_id)
        before = convert.ranks_of(previous) if previous is not None else ()
        lent_now |= {(n, i) for n, i in ranks if pools.get(n) == "inference"}
        if ranks and not before:
            JOB_CHANGES.labels("started").inc()
        elif before and not ranks:
            JOB_CHANGES.labels("preempted").inc()
        elif ranks and previous is not None and entry.generation != previous.generation:
            JOB_CHANGES.labels("resized_in_place" if entry.fast_resize else "resized_by_restart").inc()
    LENDS.inc(len(lent_now - lent_before))
    RECLAIMS.inc(len(lent_before - lent_now))


def restarted_after_crash() -> None:
    JOB_CHANGES.labels("restarted_after_crash").inc()


def node_acked(node: str, version: int) -> None:
    NODE_ACKED.labels(node).set(version)


class TimedEstimator:
    """An estimator stub whose unary calls are timed (silod_scheduler_estimator_call_duration_seconds)."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub

    def __getattr__(self, method: str) -> Any:
        call = getattr(self._stub, method)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            started, outcome = time.monotonic(), "ok"
            try:
                return await call(*args, **kwargs)
            except Exception:
                outcome = "error"
                raise
            finally:
                ESTIMATOR_SECONDS.labels(method, outcome).observe(time.monotonic() - started)

        return timed
