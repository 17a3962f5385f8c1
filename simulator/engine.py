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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from estimator.gpu_types import typed_models
from estimator.job_model import JobModel
from estimator.profiles.loading import JobOverheads, read_overheads
from scheduler import data_grants
from scheduler import quotas as quota_rule
from scheduler.plan_changes import changes_between
from scheduler.placement import placement_type
from scheduler.invariants import PlanViolation, plan_problems
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan, Policy
from scheduler.quotas import TenantQuota
from scheduler.registry import get_policy
from simulator.clock import SimClock
from simulator.cluster import ClusterSpec
from simulator.errors import SimulationStuck, SimulatorInputError
from simulator.cacheio import CACHE_MODES, CacheIoRates
from simulator.rates import GoodputRates, RateModel
from simulator.workload import JobSpec, Workload, target_samples, workload_from_jobs
from scheduler.deepboot.ats_i import place_inference_tasks
from scheduler.deepboot.state import ReplicaState
from simulator.inference import InferencePool, InferenceTask, LifecycleConfig, ProtectSchedule

_EPS = 1e-9


@dataclass(frozen=True)
class SimProgress:
    """What an observer sees after every event."""

    time_s: float
    finished: int
    total: int
    active: int       # arrived and not finished
    running: int      # holding GPUs
    rounds: int


@dataclass(frozen=True)
class JobRecord:
    """One finished job (a row of jobs.csv)."""

    name: str
    application: str
    arrival_s: float
    start_s: float            # first time it held GPUs
    finish_s: float
    jct_s: float              # finish - arrival
    restarts: int             # placements after the first
    attained_gpu_s: float     # GPU-seconds held (restarts included)
    mean_gpus: float          # attained_gpu_s / (finish - start)
    requested_gpus: int
    batch_size: int
    target_samples: float
    isolated_jct_s: float     # alone on the cluster with its requested GPUs (see docs/evaluation.md)
    tenant: str = "default"   # the job's tenant (workload column ``tenant``)


@dataclass(frozen=True)
class InferenceRecord:
    """One finished inference task (a row of inference.csv)."""

    name: str
    application: str
    arrival_s: float
    start_s: float            # placed on a GPU (its replica starts, or is reused)
    ready_s: float            # start + cold start (the task runs from here)
    finish_s: float
    wait_s: float             # start - arrival: time queued for a GPU
    cold_start: bool          # a new replica (free GPU, an evicted sleeper, or a reclaimed lent GPU)
    kind: str                 # ATS-I decision: reuse, free, sleep or reclaim


@dataclass(frozen=True)
class TimelinePoint:
    time_s: float
    allocated_gpus: int
    active_jobs: int
    running_jobs: int
    lent_gpus: int = 0        # training GPUs on inference-pool nodes
    inference_gpus: int = 0   # inference GPUs held by RUNNING/PROTECT replicas


@dataclass(frozen=True)
class SimulationResult:
    policy: str
    workload: str
    cluster: ClusterSpec
    jobs: tuple[JobRecord, ...]           # in arrival order
    timeline: tuple[TimelinePoint, ...]   # after every event that changed allocations or the job set
    rounds: int
    events: int
    plans_checked: int
    start_s: float                        # the clock's start
    wall_time_s: float = 0.0              # filled by :func:`simulator.runner.simulate`
    policy_options: dict = field(default_factory=dict)  # the policy's constructor options, for reproducibility
    cache_mode: str = "none"              # see simulator.cacheio
    remote_bytes_read: float = 0.0        # bytes read from remote storage by all jobs (IO utilization)
    inference: tuple[InferenceRecord, ...] = ()  # inference tasks, in arrival order
    lent_gpu_s: float = 0.0               # GPU-seconds training held on inference-pool nodes
    reclaims: int = 0                     # lent GPUs ATS-I took back from training
    protect_scale: float = 1.0            # the replicas' protect times were scaled by this
    restart_charges: dict = field(default_factory=dict)  # "afe"/"full"/"fixed"/"launch" -> [count, seconds] charged to jobs


class _Job:
    """Mutable per-job state inside the engine."""

    __slots__ = (
        "spec", "model", "type_models", "dataset", "target", "min_gpus", "max_gpus", "requested", "done", "attained", "restarts",
        "start", "finish", "allocation", "restart_until", "rate", "finish_at", "_info", "_info_at",
        "overheads", "work_done_at",
    )

    def __init__(self, spec: JobSpec, model: JobModel, target: float, max_gpus: int, dataset: str = "",
                 type_models: Mapping[str, JobModel] | None = None):
        self.spec = spec
        self.model = model
        self.type_models = type_models or {}
        self.dataset = dataset
        self.target = target
        self.min_gpus = 1
        self.max_gpus = max_gpus
        self.requested = min(spec.num_replicas, max_gpus)
        self.done = 0.0
        self.attained = 0.0
        self.restarts = 0
        self.start: float | None = None
        self.finish: float | None = None
        self.allocation: Allocation | None = None
        self.restart_until = -math.inf
        self.rate = 0.0
        self.finish_at = math.inf
        self._info: JobInfo | None = None
        self._info_at: tuple[float, float, int] | None = None
        self.overheads: JobOverheads | None = None  # measured launch/finish times (None: restart_cost_s, no tail)
        self.work_done_at: float | None = None      # with overheads: when its last step ended

    def info(self) -> JobInfo:
        # Only progress, attained service and restarts change while a job is active: a job that
        # waits keeps its JobInfo from round to round.
        state = (self.done, self.attained, self.restarts)
        if self._info is None or self._info_at != state:
            self._info, self._info_at = self._new_info(), state
        return self._info

    def _new_info(self) -> JobInfo:
        if self._info is not None:  # only the progress fields change: copy the rest (JobInfo has no __post_init__)
            info = object.__new__(JobInfo)
            info.__dict__.update(self._info.__dict__)
            info.__dict__.update(samples_done=min(self.done, self.target), attained_gpu_s=self.attained,
                                 restarts=self.restarts)
            return info
        s = self.spec
        return JobInfo(
            job_id=s.name,
            model=self.model,
            submit_time_s=s.arrival_s,
            min_gpus=self.min_gpus,
            max_gpus=self.max_gpus,
            target_samples=self.target,
            samples_done=min(self.done, self.target),
            requested_gpus=self.requested,
            batch_size=s.batch_size,
            attained_gpu_s=self.attained,
            restarts=self.restarts,
            dataset=self.dataset,
            gpu_types=s.gpu_types,
            type_models=self.type_models,
            tenant=s.tenant,
            cpus_per_rank=s.cpus_per_rank,
            memory_bytes_per_rank=s.memory_bytes_per_rank,
        )


def max_gpus_for(model: JobModel, requested: int, cap: int) -> int:
    """A job's largest world size: what its batch limits allow (``max_batch // min_local``), at
    least what its owner asked for, at most ``cap`` (the cluster, or ``max_gpus_per_job``)."""
    by_batch = max(1, model.bounds.max_batch_size // model.bounds.min_local_bsz)
    return max(1, min(cap, max(by_batch, requested)))


class Simulator:
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

        cap = self.cluster.job_gpu_cap
        self._node_types = {node.name: node.gpu_type for node in self.cluster.nodes}
        self._jobs: list[_Job] = []
        models: dict[str, JobModel] = {}
        overheads: dict[str, JobOverheads | None] = {}
        # (application, Gavel job type) -> the job's model per GPU type of the cluster; shared by
        # the jobs of one kind, so rate models and policies price each kind once.
        typed: dict[tuple[str, str], dict[str, JobModel]] = {}
        gpu_types = self.cluster.gpu_types
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
            self._jobs.append(_Job(spec, model, target, max_gpus_for(model, spec.num_replicas, cap), _dataset_of(spec.application),
                                   typed[kind]))
            if self.cluster.job_overheads:
                if spec.application not in overheads:
                    overheads[spec.application] = read_overheads(spec.application)
                self._jobs[-1].overheads = overheads[spec.application]
        if rate_model is None and (cache_mode != "none" or self.cluster.io_limited):
            rate_model = CacheIoRates(cache_mode, self.cluster.nodes, self.cluster.storage_bandwidth_bytes_per_s,
                                      gpus_per_node=self.cluster.gpus_per_node)
        # GPU-only (no cache, unlimited IO) keeps the original rate model: the same numbers as before issue 7.
        self.rate_model: RateModel = rate_model or GoodputRates(
            list(models.values()) + [m for by_type in typed.values() for m in by_type.values()],
            gpus_per_node=self.cluster.gpus_per_node)
        self._epoch_starts = data_grants.EpochStarts()  # --cache silod: snapshot.fresh_bytes, as live

        self._pending = 0                    # index of the next job to arrive
        self._active: list[_Job] = []        # arrived, unfinished, in arrival order
        self._finished = 0
        self._round_index = 0                # next round at start + _round_index * interval
        self.rounds = 0
        self.events = 0
        self.plans_checked = 0
        self._stalled_since: float | None = None
        self._timeline: list[TimelinePoint] = []
        self._init_inference(workload.inference if inference_tasks is None else tuple(inference_tasks), lifecycle, protect_scale)

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
        changed = self._complete(t_next)
        served = self._finish_tasks(t_next)
        arrived = self._arrive(t_next)
        queued = self._arrive_tasks(t_next)
        if self._queue:  # inference first: a new replica is busy in this instant's round
            changed |= self._place_inference(t_next)
        tick = t_next >= self._tick(self._round_index) - _EPS
        if tick or (self.cluster.schedule_on_events and (changed or arrived)):
            if self._active:
                self._round(t_next)
                changed = True
            if tick:
                self._round_index = self._first_tick_after(t_next)
        if self._tasks and self.check_invariants:
            self._check_gpus(t_next)
        if changed or arrived or served or queued:
            self._record(t_next)
        if self.observer is not None:
            self.observer(self.progress())
        return not self.finished

    def progress(self) -> SimProgress:
        return SimProgress(
            time_s=self.clock.now(),
            finished=self._finished,
            total=len(self._jobs),
            active=len(self._active),
            running=sum(1 for j in self._active if j.allocation is not None),
            rounds=self.rounds,
        )

    def result(self) -> SimulationResult:
        if not self.finished:
            raise RuntimeError("the simulation has not finished")
        isolated = self._isolated_jcts()
        records = []
        for job, iso in zip(self._jobs, isolated):
            s = job.spec
            assert job.start is not None and job.finish is not None
            run_time = job.finish - job.start
            records.append(JobRecord(
                name=s.name, application=s.application, arrival_s=s.arrival_s + self.start_s,
                start_s=job.start, finish_s=job.finish, jct_s=job.finish - (s.arrival_s + self.start_s),
                restarts=job.restarts, attained_gpu_s=job.attained,
                mean_gpus=job.attained / run_time if run_time > 0 else 0.0,
                requested_gpus=job.requested, batch_size=s.batch_size, target_samples=job.target,
                isolated_jct_s=iso, tenant=s.tenant,
            ))
        return SimulationResult(
            policy=self.policy_name, workload=self.workload.name, cluster=self.cluster, jobs=tuple(records),
            policy_options=_options_of(self.policy),
            timeline=tuple(self._timeline), rounds=self.rounds, events=self.events,
            plans_checked=self.plans_checked, start_s=self.start_s,
            cache_mode=self.cache_mode, remote_bytes_read=float(getattr(self.rate_model, "bytes_read", 0.0)),
            inference=self._inference_records(), lent_gpu_s=self._lent_gpu_s, reclaims=self._reclaims,
            protect_scale=self._protect_scale, restart_charges={k: list(v) for k, v in sorted(self._charges.items())},
        )

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
        candidates = []
        if self._pending < len(self._jobs):
            candidates.append(self._arrival(self._jobs[self._pending]))
        candidates.extend(self._inference_events())
        if self._active:
            candidates.append(self._tick(self._round_index))
            now = self.clock.now()
            for job in self._active:
                if job.allocation is not None:
                    candidates.append(job.finish_at)
                    if job.restart_until > now:
                        candidates.append(job.restart_until)
        return min(candidates, default=math.inf)

    def _arrival(self, job: _Job) -> float:
        return self.start_s + job.spec.arrival_s

    # --- events ------------------------------------------------------------------------

    def _advance(self, t: float, t_next: float) -> None:
        """Progress every running job from ``t`` to ``t_next`` (no event in between)."""
        dt = t_next - t
        progressed = False
        working_s: dict[str, float] = {}  # job id -> seconds it worked (not restarting) in this interval
        for job in self._active:
            allocation = job.allocation
            if allocation is None:
                continue
            job.attained += allocation.gpus * dt
            if self._inference_nodes:
                self._lent_gpu_s += dt * sum(len(ix) for node, ix in allocation.placement if node in self._inference_nodes)
            working = t_next - max(t, job.restart_until)
            if job.overheads is not None:
                working = self._steps_until_done(job, t, working)
                progressed |= job.work_done_at is not None  # its finish tail is progress towards the end
            working_s[job.spec.name] = max(working, 0.0)
            if working > 0 and job.rate > 0:
                job.done = min(job.done + job.rate * working, job.target) if job.work_done_at is not None \
                    else job.done + job.rate * working
                progressed = True
        advance = getattr(self.rate_model, "advance", None)
        if advance is not None and working_s:
            advance(working_s)
        if progressed or not self._active:
            self._stalled_since = None
        elif dt > 0:
            if self._stalled_since is None:
                self._stalled_since = t
            if t_next - self._stalled_since > self.cluster.stall_timeout_s:
                self._stuck(t_next)

    @staticmethod
    def _steps_until_done(job: _Job, t: float, working: float) -> float:
        """Of ``working`` seconds of running from ``t``, those ``job`` still steps: none in its
        finish tail; up to its last sample otherwise, recording when that is (``work_done_at``)."""
        if job.work_done_at is not None:
            return 0.0
        if working <= 0 or job.rate <= 0:
            return working
        need = (job.target - job.done) / job.rate
        if working < need - _EPS * max(1.0, need):
            return working
        job.work_done_at = max(t, job.restart_until) + need
        return need

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
        done = [j for j in self._active if j.allocation is not None and j.finish_at <= t + _EPS * max(1.0, abs(t))]
        for job in done:
            job.done = job.target
            job.finish = t
            job.allocation = None
            job.finish_at = math.inf
            self._finished += 1
        if done:
            self._active = [j for j in self._active if j.finish is None]
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

    def _snapshot(self, t: float) -> ClusterSnapshot:
        infos = tuple(job.info() for job in self._active)
        current = Plan({j.spec.name: j.allocation for j in self._active if j.allocation is not None})
        # Only a co-designing scheduler (--cache silod) is told about the storage budget and
        # what is cached; with an independent cache the scheduler is GPU-only.
        silod = self.cache_mode == "silod"
        cached = self.rate_model.cached_bytes() if silod and hasattr(self.rate_model, "cached_bytes") else {}
        fresh = self._epoch_starts.fresh(cached, (
            (j.spec.name, j.dataset, self.rate_model.epochs_done(j.spec.name),
             [n for n, _ in j.allocation.placement] if j.allocation is not None else [])
            for j in self._active)) if silod and hasattr(self.rate_model, "epochs_done") else {}
        return ClusterSnapshot(
            time_s=t,
            nodes=self.cluster.nodes,
            jobs=infos,
            current=current,
            restart_cost_s=self.cluster.restart_cost_s,
            interval_s=self.cluster.interval_s,
            storage_bandwidth_bytes_per_s=self.cluster.storage_bandwidth_bytes_per_s if silod else math.inf,
            cached_bytes=cached,
            fresh_bytes=fresh,
            inference_busy=self._pool.busy(t) if self._tasks else {},
            quotas=self.quotas,
        )

    def _round(self, t: float) -> None:
        self.rounds += 1
        snapshot = self._snapshot(t)
        infos = snapshot.jobs
        plan = quota_rule.schedule(self.policy, snapshot)  # the policy itself when there are no quotas
        if self.cache_mode == "silod":
            # The live scheduler's data step after its policy (which jobs start without IO, the
            # spare budget): one rulebook for both worlds. The other modes' grants only label
            # quotas for the cache servers; here cacheio models those caches itself.
            plan = data_grants.grant("silod", snapshot, plan, plan, {job.job_id for job in infos}, policy_co_designs=True)
        if self.check_invariants:
            self.plans_checked += 1
            problems = plan_problems(snapshot, plan)
            if problems:
                raise PlanViolation(f"policy {self.policy_name} at t={t:.0f}s: " + "; ".join(problems))
        if self.on_round is not None:
            self.on_round(snapshot, plan)
        if self._tasks:
            self._pool.end_lent(plan, t)  # sleepers whose GPU the plan lends to training end
        # Only what the plan changes is carried out (the live scheduler commits the same changes).
        changes = changes_between(snapshot.current.allocations, plan.allocations)
        stopped = set(changes.removals)
        for job, info in zip(self._active, infos):
            if job.spec.name not in changes.upserts and job.spec.name not in stopped:
                continue  # holds what it held (or still nothing)
            new = plan.get(job.spec.name)
            if new is None or new.gpus == 0:
                job.allocation = None
                job.rate = 0.0
                job.finish_at = math.inf
                continue
            if not new.same_gpus(job.allocation):
                job.restart_until = t + self._resize_cost(job, info, new)
                if job.start is None:
                    job.start = t
                else:
                    job.restarts += 1
            # The job runs at the speed of the GPUs it got, whatever type the plan names.
            kind = self._node_types.get(new.placement[0][0], "") if len(new.placement) == 1 else \
                placement_type(new.placement, self._node_types, info)
            if new.gpu_type != kind:
                new = dataclasses.replace(new, gpu_type=kind)
            if new != job.allocation:  # an unchanged allocation keeps its object (and what it has cached)
                job.allocation = new
        self._set_rates(t)

    def _resize_cost(self, job: _Job, info: JobInfo, new: Allocation) -> float:
        """Seconds without progress after ``job`` moves to ``new`` (see the module docstring)."""
        if self._costs is None:
            if job.overheads is not None:
                return self._charge("launch", job.overheads.launch(new.gpus))
            return self._charge("fixed", self.cluster.restart_cost_s)
        old = job.allocation
        kept = old is not None and bool(_gpu_set(old) & _gpu_set(new))
        cost = self._costs.cost_s(info, starting=not kept, default_s=self.cluster.restart_cost_s)
        return self._charge("afe" if kept and self._costs.afe else "full", cost)

    def _charge(self, kind: str, seconds: float) -> float:
        """Count a restart cost (summary.json ``restart_charges``: what the resize model cost the jobs)."""
        entry = self._charges.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        return seconds

    def _set_rates(self, t: float) -> None:
        """Rates and completion times of every running job from ``t`` (after their allocations changed)."""
        running_jobs = [j for j in self._active if j.allocation is not None]
        running_infos = [j.info() for j in running_jobs]  # unchanged since the round's snapshot: the same objects
        if running_jobs:
            rates = np.asarray(self.rate_model.rates(running_infos, [j.allocation for j in running_jobs]), dtype=float)
            if rates.shape != (len(running_jobs),) or not np.all(np.isfinite(rates)) or np.any(rates < 0):
                bad = next((j.spec.name for j, r in zip(running_jobs, np.atleast_1d(rates)) if not (r >= 0 and math.isfinite(r))), "?")
                raise ValueError(f"rate model returned an invalid rate (job {bad}): {rates!r}")
            for job, rate in zip(running_jobs, rates.tolist()):
                job.rate = rate
                begin = max(t, job.restart_until)
                if job.overheads is None:
                    job.finish_at = begin + (job.target - job.done) / rate if rate > 0 else math.inf
                    continue
                tail = job.overheads.finish(job.allocation.gpus)
                if job.work_done_at is not None:  # in its finish tail (re-placed since: after the launch)
                    job.finish_at = max(job.work_done_at, job.restart_until) + tail
                else:
                    job.finish_at = begin + (job.target - job.done) / rate + tail if rate > 0 else math.inf

    def _record(self, t: float) -> None:
        allocated = sum(j.allocation.gpus for j in self._active if j.allocation is not None)
        running = sum(1 for j in self._active if j.allocation is not None)
        lent = busy = 0
        if self._tasks:
            lent = sum(len(ix) for j in self._active if j.allocation is not None
                       for node, ix in j.allocation.placement if node in self._inference_nodes)
            busy = sum(map(len, self._pool.busy(t).values()))
        point = TimelinePoint(t, allocated, len(self._active), running, lent, busy)
        if self._timeline and self._timeline[-1].time_s == t:
            self._timeline[-1] = point
        else:
            self._timeline.append(point)

    # --- inference (DeepBoot) ----------------------------------------------------------

    def _init_inference(self, tasks: tuple[InferenceTask, ...], lifecycle: LifecycleConfig | None, protect_scale: float) -> None:
        if not (math.isfinite(protect_scale) and protect_scale >= 0):
            raise SimulatorInputError(f"--inference-protect-scale: expected a number >= 0, got {protect_scale!r}")
        self._protect_scale = protect_scale
        self._tasks = tuple(sorted(tasks, key=lambda task: task.arrival_s))
        self._inference_nodes = {n.name for n in self.cluster.nodes if n.pool == "inference"}
        if self._tasks and not self._inference_nodes:
            raise SimulatorInputError(
                f"workload {self.workload.name}: {len(self._tasks)} inference tasks but the cluster has no inference-pool "
                "nodes (a node list entry with 'pool: inference')"
            )
        if lifecycle is None:
            p = ProtectSchedule()
            lifecycle = LifecycleConfig(protect=ProtectSchedule(p.base_s * protect_scale, p.per_reuse_s * protect_scale,
                                                                p.max_s * protect_scale))
        self._pool = InferencePool(lifecycle)
        self._costs = getattr(self.policy, "costs", None)   # ResizeCosts of a DeepBoot-style policy
        self._task_next = 0                                  # index of the next task to arrive
        self._queue: list[int] = []                          # arrived, not placed (task indices, FIFO)
        self._serving: dict[str, tuple[float, int]] = {}     # replica id -> (task finish time, task index)
        self._placed: dict[int, tuple[float, float, bool, str]] = {}  # task -> (start, ready, cold, kind)
        self._task_finish: dict[int, float] = {}
        self._lent_gpu_s = 0.0
        self._reclaims = 0
        self._charges: dict[str, list] = {}

    def _inference_done(self) -> bool:
        return self._task_next == len(self._tasks) and not self._queue and not self._serving

    def _inference_events(self) -> list[float]:
        events = []
        if self._task_next < len(self._tasks):
            events.append(self.start_s + self._tasks[self._task_next].arrival_s)
        events.extend(finish for finish, _ in self._serving.values())
        if self._queue:  # PROTECT -> SLEEP frees a GPU for a queued task
            events.append(self._pool.next_change_s())
        return events

    def _arrive_tasks(self, t: float) -> bool:
        first = self._task_next
        while self._task_next < len(self._tasks) and self.start_s + self._tasks[self._task_next].arrival_s <= t + _EPS:
            self._queue.append(self._task_next)
            self._task_next += 1
        return self._task_next > first

    def _finish_tasks(self, t: float) -> bool:
        done = [rid for rid, (finish, _) in self._serving.items() if finish <= t + _EPS * max(1.0, abs(t))]
        for replica_id in sorted(done, key=lambda rid: self._serving[rid]):
            _, index = self._serving.pop(replica_id)
            self._task_finish[index] = t
            self._pool.finish(replica_id, t)
        return bool(done)

    def _place_inference(self, t: float) -> bool:
        """ATS-I for the queued tasks; applies reclaims to the training plan. True if training allocations changed."""
        snapshot = self._snapshot(t)
        tasks = [self._tasks[i] for i in self._queue]
        applications = [task.application for task in tasks]
        place = getattr(self.policy, "place_inference", None)
        if place is not None:
            result = place(snapshot, applications, self._pool.views(t))
        else:  # a non-lending policy: ATS-I on the inference pool, nothing lent so nothing to reclaim
            result = place_inference_tasks(snapshot, applications, self._pool.views(t))
        jobs = {job.spec.name: (job, info) for job, info in zip(self._active, snapshot.jobs)}
        waiting, resized = [], False
        for index, task, decision in zip(self._queue, tasks, result.decisions):
            if decision.kind == "wait":
                waiting.append(index)
                continue
            if decision.kind == "reclaim":
                job, info = jobs[decision.job_id]
                self._reclaims += 1
                resized = True
                new = decision.job_allocation
                if new is None or not new.placement:  # below its minimum: the job stops (checkpointed)
                    job.allocation, job.rate, job.finish_at = None, 0.0, math.inf
                else:
                    cost = self._charge("afe" if self._costs.afe else "full",
                                        self._costs.cost_s(info, starting=False, default_s=self.cluster.restart_cost_s)) \
                        if self._costs is not None else self._resize_cost(job, info, new)
                    job.restart_until = max(job.restart_until, t + cost)
                    job.allocation = dataclasses.replace(
                        new, gpu_type=placement_type(new.placement, self._node_types, info))
                    job.restarts += 1  # a stopped job counts when it is placed again
            replica_id, finish = self._pool.start(decision, task, t)
            self._serving[replica_id] = (finish, index)
            cold = self._pool.config.cold_start(task.application) if decision.cold_start else 0.0
            self._placed[index] = (t, t + cold, decision.cold_start, decision.kind)
        self._queue = waiting
        if resized:
            self._set_rates(t)
        return resized

    def _check_gpus(self, t: float) -> None:
        """No GPU has two holders (training jobs and live replicas), and a queued task sees no lendable GPU."""
        holders: dict[tuple[str, int], str] = {}
        replicas = self._pool.views(t)
        claims = [(f"replica {v.replica_id}", ((v.node, (v.gpu,)),)) for v in replicas]
        claims += [(f"job {j.spec.name}", j.allocation.placement) for j in self._active if j.allocation is not None]
        for who, placement in claims:
            for node, indices in placement:
                for i in indices:
                    if (node, i) in holders:
                        raise PlanViolation(f"policy {self.policy_name} at t={t:.0f}s: GPU {node}/{i} held by both "
                                            f"{holders[(node, i)]} and {who}")
                    holders[(node, i)] = who
        if self._queue:  # ATS-I ends another application's idle PROTECT replica before a task waits
            busy = {(v.node, v.gpu) for v in replicas if v.state is ReplicaState.RUNNING}
            idle = [(n.name, i) for n in self.cluster.nodes if n.pool == "inference" for i in range(n.gpus) if (n.name, i) not in busy]
            if idle:
                raise PlanViolation(f"policy {self.policy_name} at t={t:.0f}s: {len(self._queue)} inference tasks wait "
                                    f"while inference GPU {idle[0][0]}/{idle[0][1]} is not RUNNING")

    def _inference_records(self) -> tuple[InferenceRecord, ...]:
        records = []
        for index, task in enumerate(self._tasks):
            start, ready, cold, kind = self._placed[index]
            arrival = self.start_s + task.arrival_s
            records.append(InferenceRecord(task.name, task.application, arrival, start, ready, self._task_finish[index],
                                           start - arrival, cold, kind))
        return tuple(records)

    # --- results -----------------------------------------------------------------------

    def _isolated_jcts(self) -> list[float]:
        """Restart cost + target / goodput of each job alone with its requested GPUs, packed."""
        nodes = sorted(self.cluster.nodes, key=lambda n: (-n.gpus, n.name))
        allocations = []
        for job in self._jobs:
            placement, remaining = [], job.requested
            for node in nodes:
                take = min(node.gpus, remaining)
                placement.append((node.name, tuple(range(take))))
                remaining -= take
                if remaining == 0:
                    break
            allocations.append(Allocation(placement=tuple(sorted(placement))))
        infos = [job.info() for job in self._jobs]
        isolated = getattr(self.rate_model, "isolated_rates", self.rate_model.rates)
        rates = np.asarray(isolated(infos, allocations), dtype=float)
        return [
            self.cluster.restart_cost_s + job.target / rate if rate > 0 else math.inf
            for job, rate in zip(self._jobs, rates.tolist())
        ]


def _gpu_set(allocation: Allocation) -> set[tuple[str, int]]:
    return {(node, i) for node, indices in allocation.placement for i in indices}


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


def _options_of(policy: object) -> dict:
    """A dataclass policy's options as plain values (what summary.json records)."""
    if not dataclasses.is_dataclass(policy):
        return {}
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
