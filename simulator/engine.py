"""Event-driven cluster simulation that runs the live scheduler's policies unchanged.

The engine owns a :class:`~simulator.clock.SimClock` and jumps it from event to event; it
never reads wall time or sleeps. Events:

- **arrival** of a job (from the workload);
- **scheduling round** every ``cluster.interval_s`` (and, with ``schedule_on_events``, also
  at every arrival and completion): the engine builds a :class:`ClusterSnapshot` of frozen
  value objects, calls ``policy.schedule`` (with ``--cache silod`` followed by the live
  scheduler's data step, :func:`scheduler.data_grants.grant`), checks the plan with
  :func:`scheduler.invariants.check_plan` and applies it;
- **restart finished**: a job whose GPU set changed (including its first start) makes no
  progress for ``cluster.restart_cost_s`` (as in the Pollux artifact simulator);
- **completion**: computed exactly, ``max(now, restart end) + remaining / goodput``.

**Measured job overheads.** Where an application's profile has ``overheads.csv``
(:func:`estimator.profiles.loading.read_overheads`, written by a profiler that ran the job
live) and ``cluster.job_overheads`` is on, a (re)placement costs the profile's launch time at
the new world size instead of ``restart_cost_s``, and a job whose work is done holds its GPUs
for the profile's finish time (final checkpoint, exit, the agent's report) before it counts as
finished: what a live job does, and what a policy that starts the next job only at a finish
waits for. Policies see such a job with nothing left to do until then, as the live scheduler
does.

Between events every running job progresses at the goodput given by the rate model
(:mod:`simulator.rates`; one vectorized ``estimator.predict`` call per round for all running
jobs), and holds its GPUs (attained GPU-seconds grow during restarts too). A job that loses
all its GPUs keeps its progress (checkpointed) and pays the restart cost again when it is
placed. ``restarts`` counts placements after the first (the artifact's ``num_restarts``).

**Inference tasks** (DeepBoot, docs/policies.md "the engine call sequence"): the workload's
inference rows (or ``inference_tasks``) run on the cluster's inference-pool nodes. Each round's
snapshot carries ``inference_busy`` (GPUs of RUNNING/PROTECT replicas) and the plan's lent GPUs
end the sleepers on them (``InferencePool.end_lent``). A task that arrives (or is queued when a
task finishes, a training job finishes, or a replica's protect time runs out) is placed by
ATS-I — the policy's ``place_inference`` if it has one, else
:func:`scheduler.deepboot.ats_i.place_inference_tasks` (with a non-lending policy no training
job ever holds an inference GPU, so there is nothing to reclaim). A reclaim replaces the job's
allocation in the plan in force at once and charges it a resize. A new replica pays the
model's cold start before its task's ``duration``.

**Resize costs.** A policy with ``costs`` (:class:`scheduler.deepboot.costs.ResizeCosts`, the
``deepboot`` policy) is charged by them: a job that keeps some of its GPUs pays an AFE resize
(1-5 s; a full restart without AFE), a job that starts or moves entirely pays its full start
(18-103 s). Other policies pay ``cluster.restart_cost_s`` for every change, as before.

**Tenant quotas** (``quotas``, a workload's ``tenant`` column): every round's plan is the
policy's within the tenants' quotas (:func:`scheduler.quotas.schedule`, the live
scheduler's rule); without quotas it is the policy's own plan.

If active jobs make no progress at all for ``cluster.stall_timeout_s`` of simulated time the
run stops with :class:`~simulator.errors.SimulationStuck` naming them: every run either
finishes every job or says why not.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any


from estimator.gpu_types import typed_models
from estimator.job_model import JobModel
from estimator.profiles.loading import JobOverheads, read_overheads
from scheduler import data_grants
from scheduler.policy import Allocation, ClusterSnapshot, Plan, Policy, TenantQuota
from scheduler.registry import get_policy
from simulator.cacheio import CACHE_MODES, CacheIoRates
from simulator.clock import SimClock
from simulator.cluster import ClusterSpec
from simulator.errors import SimulationStuck, SimulatorInputError
from simulator.inference import InferenceTask, LifecycleConfig
from simulator.jobs import SimJob, _Job, max_gpus_for  # noqa: F401 (re-exported: the engine's former names)
from simulator.rates import GoodputRates, RateModel
from simulator.records import (  # noqa: F401 (re-exported: the engine's former names)
    InferenceRecord,
    JobRecord,
    SimProgress,
    SimulationResult,
    TimelinePoint,
)
from simulator.outcome import OutcomeMixin
from simulator.rounds import RoundsMixin
from simulator.serving import InferenceMixin
from simulator.workload import JobSpec, Workload, target_samples, workload_from_jobs

_EPS = 1e-9


class Simulator(RoundsMixin, InferenceMixin, OutcomeMixin):
    """Run ``policy`` over ``workload`` on ``cluster``; :meth:`run` returns the result.

    ``policy`` is a policy object or a registered name; ``clock`` defaults to a clock at 0
    (workload arrival times are offsets from the clock's start); ``rate_model`` defaults to
    :class:`~simulator.rates.GoodputRates`. ``check_invariants`` (default on) checks every
    plan with :func:`scheduler.invariants.plan_problems` and raises
    :class:`~scheduler.invariants.PlanViolation` naming the policy, time and problems.
    ``observer`` is called after every event with a :class:`SimProgress`.
    ``inference_tasks`` (default: the workload's inference rows) run on the cluster's
    inference-pool nodes with replica lifecycle ``lifecycle`` (default: DeepBoot's protect
    times scaled by ``protect_scale``); see the module docstring.
    ``skip_known_rounds`` (default on) leaves out the rounds whose plan the policy promised
    (:mod:`scheduler.steady`; :mod:`simulator.rounds`); ``verify_known_rounds`` runs them anyway
    and raises ``AssertionError`` if one's plan is not the promised one (tests).
    """

    def __init__(
        self,
        workload: Workload | Sequence[JobSpec],
        policy: Policy | str,
        cluster: ClusterSpec | None = None,
        *,
        clock: SimClock | None = None,
        rate_model: RateModel | None = None,
        check_invariants: bool = True,
        observer: Callable[[SimProgress], None] | None = None,
        policy_options: dict[str, Any] | None = None,
        cache_mode: str = "none",
        inference_tasks: Sequence[InferenceTask] | None = None,
        lifecycle: LifecycleConfig | None = None,
        protect_scale: float = 1.0,
        quotas: Mapping[str, TenantQuota] | None = None,
        on_round: Callable[[ClusterSnapshot, Plan], None] | None = None,
        skip_known_rounds: bool = True,
        verify_known_rounds: bool = False,
    ):
        if cache_mode not in CACHE_MODES:
            raise SimulatorInputError(f"--cache: unknown cache mode {cache_mode!r}; known: {', '.join(CACHE_MODES)}")
        self.cache_mode = cache_mode
        if not isinstance(workload, Workload):
            workload = workload_from_jobs(tuple(workload))
        self.workload = workload
        self.cluster = cluster or ClusterSpec()
        if isinstance(policy, str):
            try:
                policy = get_policy(policy, **(policy_options or {}))
            except KeyError as exc:
                raise SimulatorInputError(exc.args[0]) from None
        if cache_mode == "silod":
            policy = _co_designing(policy)
        self.policy = policy
        self.policy_name = str(getattr(policy, "name", type(policy).__name__))
        self.clock = clock or SimClock()
        self.start_s = self.clock.now()
        self.check_invariants = check_invariants
        self.observer = observer
        self.quotas = dict(quotas or {})  # tenant -> quota: every round's plan is bound by scheduler.quotas
        self.on_round = on_round          # called with each round's snapshot and final plan (evaluation)

        self._node_types = {node.name: node.gpu_type for node in self.cluster.nodes}
        self._jobs, models, typed = _sim_jobs(workload, self.cluster)
        if rate_model is None and (cache_mode != "none" or self.cluster.io_limited):
            rate_model = CacheIoRates(cache_mode, self.cluster.nodes, self.cluster.storage_bandwidth_bytes_per_s,
                                      gpus_per_node=self.cluster.gpus_per_node)
        # GPU-only (no cache, unlimited IO) keeps the original rate model: the same numbers as before issue 7.
        self.rate_model: RateModel = rate_model or GoodputRates(
            list(models.values()) + [m for by_type in typed.values() for m in by_type.values()],
            gpus_per_node=self.cluster.gpus_per_node)
        self._epoch_starts = data_grants.EpochStarts()  # --cache silod: snapshot.fresh_bytes, as live
        self._stateful = hasattr(self.rate_model, "advance")  # caches that fill as jobs read (simulator.cacheio)

        self._pending = 0                    # index of the next job to arrive
        self._active: list[SimJob] = []      # arrived, unfinished, in arrival order
        self._running: dict[SimJob, None] = {}  # the active jobs that hold GPUs (a set, in the order they got them)
        self._allocated = 0                  # GPUs they hold
        self._finishing: list[tuple[float, int, SimJob]] = []  # (finish_at, sequence, job) heap; stale entries skipped
        self._sequence = 0
        self._moves = 0                      # allocations changed so far (the GPU check looks again only after one)
        self._checked: tuple | None = None   # (moves, pool version, time with tasks queued) of the last GPU check
        self._finished = 0
        self._round_index = 0                # next round at start + _round_index * interval
        self.rounds = 0
        self.events = 0
        self.plans_checked = 0
        self._stalled_since: float | None = None
        self._timeline: list[TimelinePoint] = []
        self._init_inference(workload.inference if inference_tasks is None else tuple(inference_tasks), lifecycle, protect_scale)
        self._init_known_rounds(skip_known_rounds, verify_known_rounds)

    # --- public ------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.clock.now()

    @property
    def finished(self) -> bool:
        return self._finished == len(self._jobs) and self._inference_done()

    def run(self) -> SimulationResult:
        while self.step():
            pass
        return self.result()

    def step(self) -> bool:
        """Advance to the next event time and handle every event due then; False once all jobs finished."""
        if self.finished:
            return False
        now = self.clock.now()
        t_next = self._next_event_time()
        if not math.isfinite(t_next):  # cannot happen while rounds tick; kept as a guard
            raise SimulationStuck(f"no event left at t={now:.0f}s with {len(self._active)} unfinished jobs")
        self._advance(now, t_next)
        self.clock.advance_to(t_next)
        self.events += 1
        self._pass_known_ticks(t_next)
        completed = self._complete(t_next)
        served = self._finish_tasks(t_next)
        arrived = self._arrive(t_next)
        queued = self._arrive_tasks(t_next)
        reclaimed = self._place_inference(t_next) if self._queue else False  # inference first: a new replica is busy in this instant's round
        changed = completed or reclaimed
        if arrived or reclaimed or (completed and not self._promise_departures):
            self._forget_promise()
        elif served or queued:
            self._inference_moved(t_next)
        tick = t_next >= self._tick(self._round_index) - _EPS
        if tick or (self.cluster.schedule_on_events and (changed or arrived)):
            if self._active:
                if self._known(t_next):
                    self.rounds += 1
                else:
                    self._round(t_next)
                    changed = True
            if tick:
                self._round_index = self._first_tick_after(t_next)
        if self._tasks and self.check_invariants:
            # Holders change only when an allocation or the pool does; a queued task's view, with the clock.
            checked = (self._moves, self._pool_version, t_next if self._queue else None)
            if checked != self._checked:
                self._check_gpus(t_next)
                self._checked = checked
        if changed or arrived or served or queued:
            self._record(t_next)
        if self.observer is not None:
            self.observer(self.progress())
        return not self.finished

    # --- time --------------------------------------------------------------------------

    def _tick(self, index: int) -> float:
        return self.start_s + index * self.cluster.interval_s

    def _first_tick_after(self, t: float) -> int:
        index = max(self._round_index, int(math.floor((t - self.start_s) / self.cluster.interval_s)))
        while self._tick(index) <= t + _EPS:
            index += 1
        return index

    def _first_tick_at_or_after(self, t: float) -> int:
        index = max(self._round_index, int(math.floor((t - self.start_s) / self.cluster.interval_s)))
        while self._tick(index) < t - _EPS:
            index += 1
        return index

    def _next_event_time(self) -> float:
        """The next arrival, completion, inference event or round (a round whose plan is known
        is no event: the clock jumps over it, see :meth:`_pass_known_ticks`)."""
        candidates = []
        if self._pending < len(self._jobs):
            candidates.append(self._arrival(self._jobs[self._pending]))
        candidates.extend(self._inference_events())
        if not self._active:
            return min(candidates, default=math.inf)
        candidates.append(self._next_completion())
        if self._stateful:  # a rate model with state of its own is told of every restart's end, as it always was
            now = self.clock.now()
            candidates.extend(j.restart_until for j in self._running if j.restart_until > now)
        other = min(candidates, default=math.inf)
        tick = self._tick(self._round_index)
        if self._promise_until > tick and math.isfinite(other) and not self._verify_known:
            # (with nothing else to come, rounds tick on: the stall guard; verification runs every round)
            tick = self._tick(self._first_tick_at_or_after(self._promise_until)) if math.isfinite(self._promise_until) else math.inf
        return min(other, tick)

    def _arrival(self, job: SimJob) -> float:
        return self.start_s + job.spec.arrival_s

    # --- events ------------------------------------------------------------------------

    def _advance(self, t: float, t_next: float) -> None:
        """From ``t`` to ``t_next`` (no event in between): running jobs progress by themselves
        (their progress is anchored, :mod:`simulator.jobs`); a rate model with state of its own
        (caches that fill) is told how long each worked; the stall guard."""
        dt = t_next - t
        if self._stateful and self._running:
            working_s: dict[str, float] = {}  # job id -> seconds it worked (not restarting) in this interval
            for job in self._active:
                if job.allocation is None:
                    continue
                begin = max(t, job.restart_until)
                working = t_next - begin
                if job.overheads is not None:  # steps only until its last sample, none in its finish tail
                    working = 0.0 if job.in_tail(t) else min(working, job.work_end - begin)
                working_s[job.spec.name] = max(working, 0.0)
            self.rate_model.advance(working_s)
        if not self._active or self._next_completion() < math.inf:  # some job will finish: progress is made
            self._stalled_since = None
        elif dt > 0:
            if self._stalled_since is None:
                self._stalled_since = t
            if t_next - self._stalled_since > self.cluster.stall_timeout_s:
                self._stuck(t_next)

    def _next_completion(self) -> float:
        """The earliest completion time of a running job (inf if none has one)."""
        heap = self._finishing
        while heap:
            at, _, job = heap[0]
            if job.finish is None and job.allocation is not None and at == job.finish_at:
                return at
            heapq.heappop(heap)
        return math.inf

    def _settle(self, job: SimJob, t: float) -> None:
        """Write ``job``'s progress at ``t`` back (before its allocation or rate changes)."""
        if self._inference_nodes and job.allocation is not None and t > job.base_t:
            self._lent_gpu_s += (t - job.base_t) * self._lent_of(job.allocation)
        job.settle(t)

    def _lent_of(self, allocation: Allocation) -> int:
        return sum(len(ix) for node, ix in allocation.placement if node in self._inference_nodes)

    def _assign(self, job: SimJob, allocation: Allocation | None, t: float) -> None:
        """``job`` holds ``allocation`` (None: nothing) from ``t``; its rate is set by ``_set_rates``."""
        self._settle(job, t)
        self._moves += 1
        if job.allocation is not None:
            self._allocated -= job.allocation.gpus
        if allocation is None:
            job.stop()
            self._running.pop(job, None)
            return
        job.allocation = allocation
        self._allocated += allocation.gpus
        self._running[job] = None

    def _expect_finish(self, job: SimJob) -> None:
        if job.finish_at < math.inf:
            self._sequence += 1
            heapq.heappush(self._finishing, (job.finish_at, self._sequence, job))

    def _stuck(self, t: float) -> None:
        waiting = ", ".join(
            f"{j.spec.name} (needs {j.min_gpus}-{j.max_gpus} GPUs, holds {j.allocation.gpus if j.allocation else 0}, "
            f"rate {j.rate:.3g}/s)" for j in self._active[:5]
        )
        more = f" and {len(self._active) - 5} more" if len(self._active) > 5 else ""
        raise SimulationStuck(
            f"policy {self.policy_name}: no job progressed between t={self._stalled_since:.0f}s and t={t:.0f}s "
            f"(stall_timeout_s={self.cluster.stall_timeout_s:.0f}); unfinished: {waiting}{more}"
        )

    def _complete(self, t: float) -> bool:
        limit = t + _EPS * max(1.0, abs(t))
        heap, done = self._finishing, {}
        while heap and heap[0][0] <= limit:
            at, _, job = heapq.heappop(heap)
            if job.finish is None and job.allocation is not None and at == job.finish_at:
                done[job] = None  # (a job whose time was set twice to the same value has two entries)
        for job in done:
            self._assign(job, None, t)
            job.done = job.target
            job.finish = t
            self._finished += 1
            self._active.remove(job)
        return bool(done)

    def _arrive(self, t: float) -> bool:
        arrived = False
        while self._pending < len(self._jobs) and self._arrival(self._jobs[self._pending]) <= t + _EPS:
            if not self._active:  # the cluster was idle: the next round is the first tick from now
                self._round_index = self._first_tick_at_or_after(t)
            self._active.append(self._jobs[self._pending])
            self._pending += 1
            arrived = True
        return arrived



def _sim_jobs(workload: Workload, cluster: ClusterSpec) -> tuple[
        list[SimJob], dict[str, JobModel], dict[tuple[str, str], dict[str, JobModel]]]:
    """The workload's jobs with their models, and the models: per application, and per
    (application, Gavel job type) for each GPU type of the cluster, shared by the jobs of one
    kind so that rate models and policies price each kind once."""
    cap = cluster.job_gpu_cap
    jobs: list[SimJob] = []
    models: dict[str, JobModel] = {}
    overheads: dict[str, JobOverheads | None] = {}
    typed: dict[tuple[str, str], dict[str, JobModel]] = {}
    gpu_types = cluster.gpu_types
    for spec in workload.jobs:
        if spec.application not in models:
            try:
                models[spec.application] = JobModel.from_profile(spec.application)
            except KeyError as exc:
                raise SimulatorInputError(f"job {spec.name}: {exc.args[0]}") from None
        model = models[spec.application]
        kind = (spec.application, spec.job_type)
        if kind not in typed:
            typed[kind] = typed_models(model, gpu_types, job_type=spec.job_type)
        target = spec.target_samples or target_samples(spec.application)
        jobs.append(SimJob(spec, model, target, max_gpus_for(model, spec.num_replicas, cap), _dataset_of(spec.application),
                           typed[kind]))
        if cluster.job_overheads:
            if spec.application not in overheads:
                overheads[spec.application] = read_overheads(spec.application)
            jobs[-1].overheads = overheads[spec.application]
    return jobs, models, typed


def _dataset_of(application: str) -> str:
    """The dataset a job of ``application`` reads (``datasets.csv``), or ""."""
    from estimator.profiles import dataset_for

    facts = dataset_for(application)
    return facts.name if facts else ""


def _co_designing(policy: Policy) -> Policy:
    """``policy`` with SiloD co-design on (its ``codesign`` option), or an error if it has none."""
    if not dataclasses.is_dataclass(policy) or "codesign" not in {f.name for f in dataclasses.fields(policy)}:
        raise SimulatorInputError(f"--cache silod: policy {getattr(policy, 'name', policy)!r} has no codesign option")
    return dataclasses.replace(policy, codesign=True)
