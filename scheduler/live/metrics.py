"""What the live scheduler exports to Prometheus (default registry, on --metrics-port).

Labels are fixed small sets (a phase, a job state, a GPU state, type and pool, a change's
kind), except the per-node acknowledged plan version, which has one series per node as a
node exporter would. The figures are set from what a round already computed: the snapshot,
the active jobs and the committed plan; nothing here calls a service.

docs/operators.md lists them; deploy/prometheus/alerts.yaml alerts on them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge, Histogram

from scheduler.live import convert
from scheduler.live.entries import EntryChanges
from scheduler.policies.memo import memo_of
from scheduler.policy import ClusterSnapshot, NodeInfo
from silod.v1 import common_pb2, plan_pb2

T = TypeVar("T")

ROUND_SECONDS = Histogram(
    "silod_scheduler_round_duration_seconds", "A scheduling round's wall time, by phase: snapshot (metadata reads "
    "and models), policy (the pure planning step), commit (plan commit and job state moves), total",
    ["phase"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4, 8, 16, 32))
ROUNDS = Counter("silod_scheduler_rounds_total", "Rounds by outcome: committed (a new plan version), unchanged "
                 "(the plan in force still holds), lost_race (another commit won; retried), failed", ["outcome"])
POLICY_ANSWERS = Counter("silod_scheduler_policy_answers_total", "Rounds by how the policy answered: kept (from what it "
                         "keeps between rounds: fifo's queue, sjf's and tiresias' ranked jobs) or whole (a pass over "
                         "every job; always, for the policies that keep nothing)", ["answer"])
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


def policy_answered(policy: object) -> None:
    """Count how ``policy`` answered its last call (scheduler.policies.memo)."""
    memo = memo_of(policy)
    POLICY_ANSWERS.labels("kept" if memo is not None and memo.last_call == "queue" else "whole").inc()


_STATE_NAMES = {number: name.removeprefix("JOB_STATE_") for name, number in common_pb2.JobState.items()}


class _JobCounts:
    """The active jobs per (state, tenant) and the pending jobs' submission times, kept from round
    to round: passed over whole when KnownJobs says any job may have changed (a whole read,
    every 30 s), else followed by the jobs it says changed."""

    def __init__(self) -> None:
        # job -> (the message last seen, its (state, tenant) series, its submission time if pending)
        self.seen: dict[str, tuple[common_pb2.Job, tuple[str, str], float | None]] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self.pending: dict[str, float] = {}  # pending job -> its submission time (s)
        self.refresh: int | None = None  # KnownJobs.refreshes of the jobs last taken in

    def whole(self, jobs: Iterable[common_pb2.Job], now_s: float) -> float:
        """Every active job; the oldest pending job's age (s)."""
        before, self.seen, self.counts, self.pending = self.seen, {}, {}, {}
        counts, oldest = self.counts, 0.0
        for job in jobs:
            job_id = job.id
            known = before.get(job_id)
            if known is None or known[0] is not job:
                known = _entry(job)
            self.seen[job_id] = known
            counts[known[1]] = counts.get(known[1], 0) + 1
            if known[2] is not None:
                self.pending[job_id] = known[2]
                oldest = max(oldest, now_s - known[2])
        return oldest

    def follow(self, changes: Iterable[str], active: Mapping[str, common_pb2.Job], now_s: float) -> float:
        """The jobs of ``changes`` as ``active`` now has them (absent: no longer active)."""
        seen, counts, pending = self.seen, self.counts, self.pending
        for job_id in changes:
            old = seen.pop(job_id, None)
            if old is not None:
                left = counts[old[1]] - 1
                if left:
                    counts[old[1]] = left
                else:
                    del counts[old[1]]  # a tenant with no active job left has no series
                pending.pop(job_id, None)
            job = active.get(job_id)
            if job is not None:
                known = old if old is not None and old[0] is job else _entry(job)
                seen[job_id] = known
                counts[known[1]] = counts.get(known[1], 0) + 1
                if known[2] is not None:
                    pending[job_id] = known[2]
        return max(now_s - min(pending.values()), 0.0) if pending else 0.0


def _entry(job: common_pb2.Job) -> tuple[common_pb2.Job, tuple[str, str], float | None]:
    state = job.state
    submitted = job.created_at.ToSeconds() if state == common_pb2.JOB_STATE_PENDING and job.created_at.seconds else None
    return job, (_STATE_NAMES.get(state, str(state)), job.spec.tenant), submitted


_counts = _JobCounts()


def jobs_seen(jobs: Iterable[common_pb2.Job], now_s: float, *, changes: Iterable[str] | None = None,
              active: Mapping[str, common_pb2.Job] | None = None, refresh: int | None = None) -> None:
    """The job gauges for a round's active ``jobs``. Given KnownJobs' ``changes`` since its
    refresh before, ``active`` (``jobs`` by id) and the number of the ``refresh`` they came from,
    only the changed jobs are looked at, if the last call took in the refresh before (a round
    that failed after its snapshot skipped this call, and its changes with it)."""
    follows = changes is not None and active is not None and refresh is not None \
        and _counts.refresh is not None and refresh == _counts.refresh + 1
    _counts.refresh = refresh
    if follows:
        oldest = _counts.follow(changes, active, now_s)  # type: ignore[arg-type]
    else:
        oldest = _counts.whole(jobs, now_s)
    JOBS.clear()
    for state in _STATES:
        JOBS.labels(state, "").set(0)  # every state has a series, so a sum over them is never empty
    for (state, tenant), count in _counts.counts.items():
        JOBS.labels(state, tenant).set(count)
    OLDEST_PENDING.set(max(oldest, 0.0))


@dataclasses.dataclass
class _PlanGpus:
    """What plan_in_force reads off a plan: worked out once per plan in force, which every round
    reports and only a commit changes, and carried from one plan to the next by its changes."""

    training: dict[str, dict[int, int]]  # node -> GPU index -> how many ranks hold it (one, in a sound plan)
    inference: dict[str, frozenset[int]]  # node -> GPU indices of serving (RUNNING, PROTECT) replicas
    cache_bytes: int
    io_bytes_per_s: int

    @classmethod
    def of(cls, plan: plan_pb2.AllocationPlan | None) -> _PlanGpus:
        gpus = cls({}, {}, 0, 0)
        if plan is not None:
            gpus._add(plan.jobs, 1)
            gpus._replicas(plan)
        return gpus

    def follow(self, plan: plan_pb2.AllocationPlan, changes: EntryChanges) -> set[str]:
        """Turn this (the plan before ``plan``'s) into ``plan``'s by what ``plan`` changed; the
        nodes whose GPUs may have changed state."""
        touched: set[str] = set()
        self._add(changes.previous.values(), -1, touched)
        self._add(changes.upserts.values(), 1, touched)
        serving = self.inference
        self._replicas(plan)
        touched.update(n for n in serving.keys() | self.inference.keys() if serving.get(n) != self.inference.get(n))
        return touched

    def _add(self, entries: Iterable[plan_pb2.JobAllocation], sign: int, touched: set[str] | None = None) -> None:
        training = self.training
        for entry in entries:
            for node, indices in convert.placement_of(entry):  # known for a committed plan's entries
                if touched is not None:
                    touched.add(node)
                held = training.setdefault(node, {})
                for i in indices:
                    count = held.get(i, 0) + sign
                    if count:
                        held[i] = count
                    else:
                        del held[i]
            for g in entry.cache_grants:
                self.cache_bytes += sign * g.cache_quota_bytes
                self.io_bytes_per_s += sign * g.remote_io_bytes_per_s

    def _replicas(self, plan: plan_pb2.AllocationPlan) -> None:
        inference: dict[str, set[int]] = {}
        for r in plan.replicas:
            if r.state in (plan_pb2.REPLICA_STATE_RUNNING, plan_pb2.REPLICA_STATE_PROTECT):
                inference.setdefault(r.node, set()).add(r.gpu_index)
        self.inference = {n: frozenset(i) for n, i in inference.items()}


_in_force: tuple[plan_pb2.AllocationPlan | None, _PlanGpus] = (None, _PlanGpus.of(None))


@dataclasses.dataclass
class _Counted:
    """GPUs by (state, type, pool) under a plan on a snapshot's nodes, with each node's share, so
    that a plan that changes a few nodes recounts those only (5,000 nodes a commit otherwise)."""

    plan: plan_pb2.AllocationPlan | None = None
    nodes: tuple = ()
    faulted: dict[str, frozenset[int]] = dataclasses.field(default_factory=dict)
    by_node: dict[str, list[tuple[tuple[str, str, str], int]]] = dataclasses.field(default_factory=dict)
    counts: dict[tuple[str, str, str], int] = dataclasses.field(default_factory=dict)

    def recount(self, gpus: _PlanGpus, nodes: Iterable[NodeInfo], faulted: Mapping[str, frozenset[int]]) -> None:
        counts = self.counts
        for node in nodes:
            for key, count in self.by_node.get(node.name, ()):
                counts[key] -= count
                if not counts[key]:
                    del counts[key]
            share = self.by_node[node.name] = _node_share(gpus, node, faulted)
            for key, count in share:
                counts[key] = counts.get(key, 0) + count


_counted = _Counted()


def plan_in_force(plan: plan_pb2.AllocationPlan | None, snap: ClusterSnapshot,
                  faulted: Mapping[str, frozenset[int]],
                  changes_from: Callable[[plan_pb2.AllocationPlan | None], EntryChanges | None] = lambda _: None,
                  ) -> None:
    """GPUs by state, grants and version under ``plan``, on the nodes of ``snap`` (live ones).
    ``changes_from(p)``: what ``plan`` changed of ``p``, where known (scheduler.live.plans)."""
    global _in_force, _counted
    touched: set[str] | None = None  # the nodes to recount; None: every node
    if _in_force[0] is not plan:
        changes = changes_from(_in_force[0]) if plan is not None and _in_force[0] is not None else None
        if changes is not None:
            followed = _in_force[1].follow(plan, changes)
            touched = followed if _counted.plan is _in_force[0] else None
            _in_force = (plan, _in_force[1])
        else:
            _in_force = (plan, _PlanGpus.of(plan))
    elif _counted.plan is plan:
        touched = set()
    gpus = _in_force[1]
    if touched is None or _counted.nodes is not snap.nodes or _counted.faulted != faulted:
        _counted = _Counted(plan, snap.nodes, dict(faulted))
        _counted.recount(gpus, snap.nodes, faulted)
    elif touched:
        _counted.recount(gpus, (n for n in snap.nodes if n.name in touched), faulted)
        _counted.plan = plan
    GPUS.clear()
    for (state, gpu_type, pool), count in _counted.counts.items():
        GPUS.labels(state, gpu_type, pool).set(count)
    CACHE_GRANTED.set(gpus.cache_bytes)
    IO_GRANTED.set(gpus.io_bytes_per_s)
    PLAN_VERSION.set(plan.version if plan is not None else 0)


def _node_share(gpus: _PlanGpus, node: NodeInfo, faulted: Mapping[str, frozenset[int]]) -> list[tuple[tuple[str, str, str], int]]:
    """Every GPU of the node, each in one state, the first that holds of: faulted, held by a rank
    (lent on an inference node), serving inference, idle."""
    none: frozenset[int] = frozenset()
    present = range(node.gpus)
    bad = {i for i in faulted.get(node.name, none) if i in present}
    held = {i for i in gpus.training.get(node.name, {}) if i in present} - bad
    serving = {i for i in gpus.inference.get(node.name, none) if i in present} - bad - held
    return [((state, node.gpu_type, node.pool), count)
            for state, count in (("faulted", len(bad)), ("lent" if node.pool == "inference" else "allocated", len(held)),
                                 ("inference", len(serving)), ("idle", node.gpus - len(bad) - len(held) - len(serving)))
            if count]


def plan_committed(new: plan_pb2.AllocationPlan, old: Mapping[str, plan_pb2.JobAllocation],
                   pools: Mapping[str, str], changes: EntryChanges | None = None) -> None:
    """Count what ``new`` did to each job against ``old`` (the plan it replaced: its entries by
    job, at least those of the jobs ``changes`` names). ``changes``: what ``new`` changed, where
    known; only those entries are read (an entry not in it is unchanged)."""
    lending = "inference" in pools.values()  # no inference pool: no GPU to lend, no pass for it
    if changes is not None:
        entries: Iterable[plan_pb2.JobAllocation] = changes.upserts.values()
        # Unchanged entries lend the same GPUs before and after: only the changed ones count.
        before: Iterable[plan_pb2.JobAllocation] = [old[j] for j in changes.previous if j in old]
    else:
        entries, before = new.jobs, old.values()
    lent_before = {(n, i) for e in before for n, i in convert.ranks_of(e) if pools.get(n) == "inference"} \
        if lending else set()
    lent_now = set()
    for entry in entries:
        previous = old.get(entry.job_id)
        ranks = convert.ranks_of(entry)
        if lending:
            lent_now |= {(n, i) for n, i in ranks if pools.get(n) == "inference"}
        if previous is not None and entry.generation == previous.generation \
                and convert.placement_of(entry) == convert.placement_of(previous):
            continue  # unchanged: nothing to count (most of 5,000 entries, most rounds)
        before_ranks = convert.ranks_of(previous) if previous is not None else ()
        if ranks and not before_ranks:
            JOB_CHANGES.labels("started").inc()
        elif before_ranks and not ranks:
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
