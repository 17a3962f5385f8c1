"""The scheduler's mechanism: scheduling rounds, plan commits, task reports, release tracking.

Release-before-reuse: scheduler.live.releases.

Generations: a job's generation increments whenever its GPU set changes (including to none);
it stays when the placement is unchanged.

Cost of a round: one ListJobs of the active jobs, one ListNodes, one GetDataset per dataset
new to the scheduler, one GetJobModel per job whose fitted model is older than
ESTIMATE_TTL_S (the estimator's answers to our own Observe calls refresh it in between), one
CommitPlan and one TransitionJob per job whose state the plan changes, sent concurrently.
Event-triggered rounds are spaced by at least the last round's duration, so a stream of
submissions cannot keep the scheduler (and the metadata store) busy with back-to-back rounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Iterable


from estimator.job_model import JobModel
from estimator.per_type import is_reference
from scheduler.codesign import is_active as co_active
from scheduler.invariants import check_plan
from scheduler.live import convert, data
from scheduler.live.clients import ACTIVE_STATES, TERMINAL_STATES, Clients  # noqa: F401 (servicers)
from scheduler.live.commit import Committer
from scheduler.live.reports import TaskReports
from scheduler.live.resizes import CrashRestarts, set_generation
from scheduler.live.liveness import NodeLiveness
from scheduler.live.rounds import RoundPacer
from scheduler.live.plans import PlanStore
from scheduler.live.releases import ReleaseTracker, hold_releases
from scheduler.live.feedback import EstimatorFeedback
from scheduler.live.gpu_health import UsableGpus
from scheduler.deepboot.replicas import LifecycleConfig, ProtectSchedule
from scheduler.live.inference import LiveInference, is_inference_job
from scheduler.live.models import JobModels, application_of, known_applications, with_job_batch_bounds  # noqa: F401 (servicers, tests)
from scheduler.placement import node_types, placement_type
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan
from scheduler.registry import get_policy
from silod.v1 import allocation_pb2, common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2

_log = logging.getLogger("silod.scheduler")




class SchedulerCore:
    def __init__(self, metadata: metadata_pb2_grpc.MetadataServiceStub, *, policy: str, interval_s: float,
                 restart_cost_s: float, node_timeout_s: float, cache_mode: str,
                 node_poll_s: float = 1.0, inference_protect_scale: float = 1.0,
                 storage_bandwidth_bytes_per_s: float = 0.0) -> None:
        self.clients = Clients(md=metadata)
        self.models = JobModels(self.clients)
        self.usable = UsableGpus(())  # the GPUs of the last snapshot the policy may use (scheduler.live.gpu_health)
        self._node_task: asyncio.Task[None] | None = None
        self.policy_name = policy
        if cache_mode not in data.CACHE_MODES:
            raise ValueError(f"cache_mode: must be one of {', '.join(data.CACHE_MODES)}, got {cache_mode!r}")
        # --cache silod: the policy prices jobs with T(g, c, b) and grants cache and IO with the
        # GPUs (its codesign option), as in the simulator; a policy without one gets co_allocate's
        # grants after it (scheduler.live.data).
        self.policy = get_policy(policy)
        self.policy_co_designs = False
        if cache_mode == "silod" and dataclasses.is_dataclass(self.policy) \
                and "codesign" in {f.name for f in dataclasses.fields(self.policy)}:
            self.policy = dataclasses.replace(self.policy, codesign=True)
            self.policy_co_designs = True
        # The cluster's remote-read budget; 0 = unlimited. Only a co-designing scheduler is told
        # of it (with an independent cache the scheduler is GPU-only, as in the simulator).
        self.storage_bandwidth_bytes_per_s = float(storage_bandwidth_bytes_per_s) if storage_bandwidth_bytes_per_s > 0 else math.inf
        self._epoch_starts = data.EpochStarts()  # snapshot.fresh_bytes from what the probe saw, round by round
        k = inference_protect_scale
        self.inference = LiveInference(  # inference tasks (DeepBoot ATS-I) beside the policy
            self.policy, LifecycleConfig(protect=ProtectSchedule(30.0 * k, 15.0 * k, 120.0 * k)))
        self._inference_restored = False
        self.interval_s = interval_s
        self.restart_cost_s = restart_cost_s
        self.node_timeout_s = node_timeout_s
        self.cache_mode = cache_mode
        self.plans = PlanStore(self.clients)
        self.releases = ReleaseTracker()
        self.restarts = CrashRestarts()
        self._node_types: dict[str, str] = {}  # node -> GPU type, as of the last snapshot
        self.feedback = EstimatorFeedback(
            self.clients, self.models, cache_mode=cache_mode,
            storage_bandwidth_bytes_per_s=self.storage_bandwidth_bytes_per_s,
            node_types=lambda: self._node_types, spawn=self._spawn)
        self._background: set[asyncio.Task[None]] = set()
        self.rounds: RoundPacer[plan_pb2.AllocationPlan | None] = RoundPacer(
            self._round, interval_s=interval_s, uncounted_s=lambda: self.models.warm_up_s)
        self.committer = Committer(self.clients, self.plans, self.releases, self.restarts, self.trigger)
        self.reports = TaskReports(self.clients, self.plans, self.releases, self.restarts, self.feedback,
                                   transition=self.committer.transition, trigger=self.trigger)
        self.liveness = NodeLiveness(self.clients, node_timeout_s=node_timeout_s, node_poll_s=node_poll_s,
                                     trigger=self.trigger)
        self._loop_task: asyncio.Task[None] | None = None

    # The service sets these once its event loop runs (scheduler.live.clients).
    @property
    def md(self) -> metadata_pb2_grpc.MetadataServiceStub:
        return self.clients.md

    @md.setter
    def md(self, stub: metadata_pb2_grpc.MetadataServiceStub) -> None:
        self.clients.md = stub

    @property
    def estimator(self):  # type: ignore[no-untyped-def]
        return self.clients.estimator

    @estimator.setter
    def estimator(self, stub) -> None:  # type: ignore[no-untyped-def]
        self.clients.estimator = stub

    @property
    def cached(self) -> data.CachedBytesProbe | None:
        return self.clients.cached

    @cached.setter
    def cached(self, probe: data.CachedBytesProbe | None) -> None:
        self.clients.cached = probe

    # ---- the plan in force (scheduler.live.plans) -------------------------------------------
    @property
    def latest(self) -> plan_pb2.AllocationPlan | None:
        return self.plans.latest

    @property
    def latest_version(self) -> int:
        return self.plans.latest_version

    @property
    def specs(self) -> dict[str, common_pb2.JobSpec]:
        return self.plans.specs

    @property
    def agent_addresses(self) -> dict[str, str]:
        return self.plans.agent_addresses

    async def refresh_latest(self) -> plan_pb2.AllocationPlan | None:
        return await self.plans.refresh()

    async def wait_newer(self, version: int, timeout: float) -> None:
        await self.plans.wait_newer(version, timeout)

    async def node_plan(self, plan: plan_pb2.AllocationPlan, node: str) -> plan_pb2.NodePlan:
        return await self.plans.node_plan(plan, node)

    def allocation(self, job_id: str) -> plan_pb2.JobAllocation | None:
        return self.plans.allocation(job_id)

    # ---- rounds (scheduler.live.rounds) ------------------------------------------------------
    def trigger(self, reason: str) -> None:
        self.rounds.trigger(reason)

    async def run_round(self, reason: str = "interval") -> plan_pb2.AllocationPlan | None:
        return await self.rounds.run(reason)

    @property
    def node_set_version(self) -> int:
        return self.liveness.node_set_version

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        # Profiles are fitted when a round first needs them, not here: fitting all of them
        # would compete with serving for seconds after every start.
        await self.plans.refresh()
        await self.releases.recover(self.md, self.plans.latest)
        self._loop_task = asyncio.create_task(self.rounds.loop())
        self._node_task = asyncio.create_task(self.liveness.watch())

    def _spawn(self, call: Awaitable[None]) -> None:
        """Run ``call`` in the background, cancelled by stop()."""
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        for task in (self._loop_task, self._node_task, *self._background):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass

    # ---- snapshot --------------------------------------------------------------------------
    async def _active_jobs(self) -> list[common_pb2.Job]:
        jobs: list[common_pb2.Job] = []
        token = ""
        while True:
            page = await self.md.ListJobs(metadata_pb2.ListJobsRequest(states=ACTIVE_STATES, page_size=1000, page_token=token))
            jobs.extend(page.jobs)
            token = page.next_page_token
            if not token:
                return jobs

    def _forget_finished(self, active: set[str]) -> None:
        self.models.forget_finished(active)
        self.feedback.forget_finished(active)

    async def warm_up(self, applications: Iterable[str] | None = None) -> None:
        await self.models.warm_up(applications)

    async def model_of(self, job: common_pb2.Job) -> tuple[JobModel, float]:
        return await self.models.model_of(job)

    async def snapshot(self) -> tuple[ClusterSnapshot, list[common_pb2.Job]]:
        nodes_resp = await self.md.ListNodes(
            metadata_pb2.ListNodesRequest(alive_only=True, liveness_window_s=self.liveness.window_s())
        )
        self.liveness.metadata_seen()
        nodes = [n for n in nodes_resp.nodes if n.spec.gpus > 0]
        self.usable = UsableGpus(nodes)
        self.plans.remember_nodes(nodes)
        infos = tuple(convert.node_info(n) for n in sorted(nodes, key=lambda n: n.spec.name))
        alive = {n.name: n for n in infos}
        jobs = await self._active_jobs()
        self._forget_finished({j.id for j in jobs})
        if not self._inference_restored:  # replicas the previous scheduler left on the plan
            self.inference.restore(self.latest, {j.id for j in jobs})
            self._inference_restored = True
        inference_jobs = [j for j in jobs if is_inference_job(j)]
        training = [j for j in jobs if not is_inference_job(j)]
        await self.models.warm_up({application_of(j.spec) for j in training if j.id not in self.models.profiles})
        datasets = await self.models.datasets_of(training)
        await self.models.refresh_fitted(training)
        job_infos = []
        node_gpu_types = tuple(sorted({info.gpu_type for info in infos}))
        self._node_types = {info.name: info.gpu_type for info in infos}
        for job in inference_jobs:
            self.specs[job.id] = job.spec
        for job in training:
            self.specs[job.id] = job.spec
            model, target = self.models.model_now(job, datasets)
            type_models = self.models.type_models_now(job, model, node_gpu_types) if any(node_gpu_types) else {}
            if len(node_gpu_types) == 1 and not is_reference(node_gpu_types[0]):
                # One type, not the reference: policies price every job with its model there.
                model, type_models = type_models[node_gpu_types[0]], {}
            spec = job.spec
            job_infos.append(JobInfo(
                job_id=job.id, model=model, submit_time_s=_epoch_s(job.created_at),
                min_gpus=spec.min_gpus, max_gpus=spec.max_gpus, target_samples=target,
                samples_done=min(float(job.progress.samples_done), target * 0.999), requested_gpus=spec.max_gpus,
                batch_size=spec.batch_size, dataset=spec.dataset, priority=spec.priority,
                tenant=spec.tenant or "default", gpu_types=tuple(spec.gpu_types),
                type_models=type_models if len(node_gpu_types) > 1 else {},
            ))
        min_gpus = {j.id: j.spec.min_gpus for j in training}  # inference tasks: LiveInference keeps them
        current: dict[str, Allocation] = {}
        for job_id, alloc in convert.plan_from_proto(self.latest).allocations.items():
            if job_id not in min_gpus:
                continue  # finished or cancelled: holds nothing any more
            # Placements on lost nodes and faulted GPUs are gone; the survivors stay if the job can
            # still run on them.
            survivors = self.usable.without_faulted(tuple(
                (node, idx) for node, idx in alloc.placement if node in alive and all(i < alive[node].gpus for i in idx)))
            if sum(len(idx) for _, idx in survivors) >= max(1, min_gpus[job_id]):
                current[job_id] = Allocation(placement=survivors, batch_size=alloc.batch_size,
                                             cache_bytes={n: b for n, b in alloc.cache_bytes.items() if n in alive},
                                             remote_io_bytes_per_s=alloc.remote_io_bytes_per_s, gpu_type=alloc.gpu_type)
        silod = self.cache_mode == "silod"
        cached: dict[tuple[str, str], float] = {}
        if silod and self.cached is not None and any(i.cache_capacity_bytes > 0 for i in infos):
            cached = await self.cached.cached_bytes(nodes)
        # What each running job's nodes cached since its epoch began: no hits for it yet (the
        # same rule as the simulator's, scheduler.data_grants.EpochStarts).
        fresh = self._epoch_starts.fresh(cached, (
            (j.id, j.spec.dataset, j.progress.epochs_done, [n for n, _ in current[j.id].placement] if j.id in current else [])
            for j in training)) if silod and self.cached is not None else {}
        snap = ClusterSnapshot(
            time_s=time.time(), nodes=infos, jobs=tuple(job_infos), current=Plan(current),
            restart_cost_s=self.restart_cost_s, interval_s=self.interval_s,
            inference_busy=self.inference.busy(inference_jobs),
            storage_bandwidth_bytes_per_s=self.storage_bandwidth_bytes_per_s if silod else math.inf,
            cached_bytes=cached, fresh_bytes=fresh,
        )
        return snap, jobs

    # ---- rounds ----------------------------------------------------------------------------
    async def _round(self, reason: str) -> plan_pb2.AllocationPlan | None:
        await self.refresh_latest()
        snap, jobs = await self.snapshot()
        policy_plan = self.usable.schedule(self.policy, snap)  # on the usable GPUs only
        check_plan(snap, policy_plan)
        inference_jobs = [j for j in jobs if is_inference_job(j)]
        plan = self.inference.place(snap, policy_plan, inference_jobs, unusable=self.usable.faulted)
        plan = hold_releases(plan, snap.current, self.releases.busy(self.plans.latest))
        inference_ids = {j.id for j in inference_jobs}
        # Cache quotas and IO rates of the cache mode, on the placements that survived the
        # release holds and inference reclaims (inference tasks read no dataset).
        training_ids = {j.id for j in jobs} - inference_ids
        plan = data.grant(self.cache_mode, snap, plan, policy_plan, training_ids, self.policy_co_designs)
        training_plan = Plan({k: a for k, a in plan.allocations.items() if k not in inference_ids})
        check_plan(snap, training_plan)
        broken = data.problems(snap, training_plan)
        if broken:  # a bug, not a condition to live with: the cache servers would refuse the plan
            raise AssertionError("data grants exceed the cluster: " + "; ".join(broken))
        managed = self.cache_mode != "silod" or co_active(snap)
        old = {a.job_id: a for a in (self.latest.jobs if self.latest is not None else [])}
        proto = plan_pb2.AllocationPlan(
            version=self.latest_version + 1, policy=self.policy_name, cache_mode=self.cache_mode, reason=reason
        )
        if self.cache_mode == "silod" and math.isfinite(snap.storage_bandwidth_bytes_per_s):
            proto.storage_bandwidth_budget_bytes_per_s = int(snap.storage_bandwidth_bytes_per_s)
        proto.created_at.GetCurrentTime()
        kinds = node_types(snap)
        for job in jobs:
            alloc = plan.get(job.id)
            entry = proto.jobs.add(job_id=job.id)
            if alloc is not None:
                for node, idx in alloc.placement:
                    entry.placements.add(node=node, gpu_indices=list(idx))
                # The type the job runs on, from its nodes (the policy's Allocation may leave it "").
                entry.gpu_type = placement_type(alloc.placement, kinds, None) if alloc.placement else ""
                entry.batch_size = alloc.batch_size or job.spec.batch_size
                if job.spec.batch_size > 0:
                    # The goodput model rounds a batch up to whole per-GPU batches (3 GPUs: 64 -> 66);
                    # the job's own limit is a contract, and its sampler splits 64 over 3 unevenly.
                    entry.batch_size = min(entry.batch_size, max(job.spec.max_batch_size, job.spec.batch_size))
                if job.id in training_ids:
                    data.add_grants(entry, alloc, self.cache_mode, job.spec.dataset, managed)
            else:
                entry.batch_size = job.spec.batch_size
            set_generation(entry, job, old.get(job.id), restarting=job.id in self.restarts.waiting,
                           policy_afe=bool(getattr(self.policy, "afe", False)))
        convert.assign_master_ports(proto, old)
        self.inference.describe(proto, {n.name for n in snap.nodes if n.pool == "inference"})
        return await self.committer.commit(proto, self.latest, {j.id: j for j in jobs}, reason)

    # ---- node feedback ---------------------------------------------------------------------
    def release(self, node: str, jobs: Iterable[str]) -> bool:
        return self.releases.release(node, jobs)

    async def report_tasks(self, request: allocation_pb2.ReportTasksRequest) -> list[str]:
        return await self.reports.report(request)

def _epoch_s(stamp) -> float:
    """Seconds since the epoch of a Timestamp, as the UTC datetime's timestamp() gives them
    (microseconds, one rounding), without building the datetime: once per job per round."""
    return (stamp.seconds * 1_000_000 + stamp.nanos // 1000) / 1_000_000

