"""The policy's view of the cluster, built from the metadata store: live nodes and their usable
GPUs, active jobs with their models, what each job holds under the plan in force (minus lost
nodes and faulted GPUs), and what the cache servers hold.

Cost: one ListNodes, one ListJobs of the jobs whose state changed since the last round (every active
job every 30 s, scheduler.live.jobs), one ListTenants (tenant quotas), the job models' calls
(scheduler.live.models), and one Stats per cache server every few seconds (--cache silod).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from estimator.per_type import is_reference
from scheduler.live import convert, data
from scheduler.live.clients import Clients
from scheduler.live.gpu_health import UsableGpus
from scheduler.live.inference import LiveInference, is_inference_job
from scheduler.live.jobs import KnownJobs
from scheduler.live.liveness import NodeLiveness
from scheduler.live.models import JobModels, application_of
from scheduler.live.plans import PlanStore
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan
from scheduler.quotas_proto import quotas_of
from silod.v1 import access_pb2, common_pb2, metadata_pb2, plan_pb2


class SnapshotBuilder:
    def __init__(self, clients: Clients, plans: PlanStore, liveness: NodeLiveness, models: JobModels,
                 inference: LiveInference, jobs: KnownJobs, *, forget_finished: Callable[[set[str]], None], cache_mode: str,
                 restart_cost_s: float, interval_s: float, storage_bandwidth_bytes_per_s: float) -> None:
        self.clients = clients
        self.plans = plans
        self.liveness = liveness
        self.models = models
        self.inference = inference
        self.jobs = jobs  # the active jobs, read incrementally
        self._forget_finished = forget_finished  # of every part that keeps something per job
        self.cache_mode = cache_mode
        self.restart_cost_s = restart_cost_s
        self.interval_s = interval_s
        self.storage_bandwidth_bytes_per_s = storage_bandwidth_bytes_per_s
        self.usable = UsableGpus(())  # the GPUs of the last snapshot the policy may use (scheduler.live.gpu_health)
        self.node_types: dict[str, str] = {}  # node -> GPU type, as of the last snapshot
        self._epoch_starts = data.EpochStarts()  # snapshot.fresh_bytes from what the probe saw, round by round
        self._inference_restored = False
        self._in_force: tuple[plan_pb2.AllocationPlan | None, Plan] = (None, Plan())
        # (plan in force, live nodes' sizes and faulted GPUs, job -> what it keeps): see _current
        self._kept: tuple[plan_pb2.AllocationPlan | None, tuple, dict[str, Allocation | None]] = (None, (), {})
        # job id -> (its Job message, model, target, type models, the JobInfo made of them)
        self._job_infos: dict[str, tuple[common_pb2.Job, object, float, dict, JobInfo]] = {}

    async def build(self) -> tuple[ClusterSnapshot, list[common_pb2.Job]]:
        nodes_resp = await self.clients.md.ListNodes(
            metadata_pb2.ListNodesRequest(alive_only=True, liveness_window_s=self.liveness.window_s())
        )
        self.liveness.metadata_seen()
        self.liveness.saw_nodes(nodes_resp.nodes)
        nodes = [n for n in nodes_resp.nodes if n.spec.gpus > 0]
        self.usable = UsableGpus(nodes)
        self.plans.remember_nodes(nodes)
        infos = tuple(convert.node_info(n) for n in sorted(nodes, key=lambda n: n.spec.name))
        alive = {n.name: n for n in infos}
        jobs = await self.jobs.refresh()
        self._forget_finished({j.id for j in jobs})
        if not self._inference_restored:  # replicas the previous scheduler left on the plan
            self.inference.restore(self.plans.latest, {j.id for j in jobs})
            self._inference_restored = True
        inference_jobs = [j for j in jobs if is_inference_job(j)]
        training = [j for j in jobs if not is_inference_job(j)]
        await self.models.warm_up({application_of(j.spec) for j in training if j.id not in self.models.profiles})
        datasets = await self.models.datasets_of(training)
        await self.models.refresh_fitted(training)
        job_infos = []
        node_gpu_types = tuple(sorted({info.gpu_type for info in infos}))
        self.node_types = {info.name: info.gpu_type for info in infos}
        specs = self.plans.specs
        for job in inference_jobs:
            specs[job.id] = job.spec
        infos_before, self._job_infos = self._job_infos, {}
        for job in training:
            specs[job.id] = job.spec
            model, target = self.models.model_now(job, datasets)
            type_models = self.models.type_models_now(job, model, node_gpu_types) if any(node_gpu_types) else {}
            if len(node_gpu_types) == 1 and not is_reference(node_gpu_types[0]):
                # One type, not the reference: policies price every job with its model there.
                model, type_models = type_models[node_gpu_types[0]], {}
            type_models = type_models if len(node_gpu_types) > 1 else {}
            # Last round's JobInfo while nothing it is made of changed: the job's message (a new
            # one on any change: KnownJobs), its model and target. Most of 5,000 jobs, most rounds.
            kept = infos_before.get(job.id)
            if kept is not None and kept[0] is job and kept[1] is model and kept[2] == target and kept[3] == type_models:
                job_infos.append(kept[4])
                self._job_infos[job.id] = kept
                continue
            spec = job.spec
            job_infos.append(JobInfo(
                job_id=job.id, model=model, submit_time_s=_epoch_s(job.created_at),
                min_gpus=spec.min_gpus, max_gpus=spec.max_gpus, target_samples=target,
                samples_done=min(float(job.progress.samples_done), target * 0.999), requested_gpus=spec.max_gpus,
                batch_size=spec.batch_size, dataset=spec.dataset, priority=spec.priority,
                tenant=spec.tenant or "default", gpu_types=tuple(spec.gpu_types), type_models=type_models,
                cpus_per_rank=spec.cpus_per_rank, memory_bytes_per_rank=spec.memory_bytes_per_rank,
            ))
            self._job_infos[job.id] = (job, model, target, type_models, job_infos[-1])
        current = self._current(training, alive)
        # Tenant quotas, read every round: a SetTenantQuota applies from the next round.
        quotas = quotas_of((await self.clients.md.ListTenants(access_pb2.ListTenantsRequest())).tenants)
        silod = self.cache_mode == "silod"
        probe = self.clients.cached
        cached: dict[tuple[str, str], float] = {}
        if silod and probe is not None and any(i.cache_capacity_bytes > 0 for i in infos):
            cached = await probe.cached_bytes(nodes)
        # What each running job's nodes cached since its epoch began: no hits for it yet (the
        # same rule as the simulator's, scheduler.data_grants.EpochStarts).
        fresh = self._epoch_starts.fresh(cached, (
            (j.id, j.spec.dataset, j.progress.epochs_done, [n for n, _ in current[j.id].placement] if j.id in current else [])
            for j in training)) if silod and probe is not None else {}
        snap = ClusterSnapshot(
            time_s=time.time(), nodes=infos, jobs=tuple(job_infos), current=Plan(current),
            restart_cost_s=self.restart_cost_s, interval_s=self.interval_s,
            inference_busy=self.inference.busy(inference_jobs),
            storage_bandwidth_bytes_per_s=self.storage_bandwidth_bytes_per_s if silod else math.inf,
            cached_bytes=cached, fresh_bytes=fresh, quotas=quotas,
        )
        return snap, jobs

    def _current(self, training: list[common_pb2.Job], alive: dict) -> dict[str, Allocation]:
        """What each training job holds under the plan in force and can still run on."""
        min_gpus = {j.id: j.spec.min_gpus for j in training}  # inference tasks: LiveInference keeps them
        current: dict[str, Allocation] = {}
        latest = self.plans.latest
        if self._in_force[0] is not latest:  # the plan in force as value objects, once per plan
            self._in_force = (latest, convert.plan_from_proto(latest))
        # What a job keeps depends on the plan, the live nodes' sizes and the faulted GPUs only:
        # while those are as last round, last round's answer per job stands (most rounds).
        nodes = (tuple((name, info.gpus) for name, info in alive.items()), tuple(sorted(self.usable.faulted.items())))
        if self._kept[0] is not latest or self._kept[1] != nodes:
            self._kept = (latest, nodes, {})
        kept = self._kept[2]
        for job_id, alloc in self._in_force[1].allocations.items():
            if job_id not in min_gpus:
                continue  # finished or cancelled: holds nothing any more
            if job_id not in kept:
                kept[job_id] = self._surviving(alloc, alive, min_gpus[job_id])
            if kept[job_id] is not None:
                current[job_id] = kept[job_id]
        return current

    def _surviving(self, alloc: Allocation, alive: dict, min_gpus: int) -> Allocation | None:
        """``alloc`` without its placements on lost nodes and faulted GPUs, if the job can still run
        on what is left."""
        survivors = self.usable.without_faulted(tuple(
            (node, idx) for node, idx in alloc.placement if node in alive and all(i < alive[node].gpus for i in idx)))
        if sum(len(idx) for _, idx in survivors) < max(1, min_gpus):
            return None
        return Allocation(placement=survivors, batch_size=alloc.batch_size,
                          cache_bytes={n: b for n, b in alloc.cache_bytes.items() if n in alive},
                          remote_io_bytes_per_s=alloc.remote_io_bytes_per_s, gpu_type=alloc.gpu_type)


def _epoch_s(stamp) -> float:
    """Seconds since the epoch of a Timestamp, as the UTC datetime's timestamp() gives them
    (microseconds, one rounding), without building the datetime: once per job per round."""
    return (stamp.seconds * 1_000_000 + stamp.nanos // 1000) / 1_000_000
