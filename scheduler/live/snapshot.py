"""The policy's view of the cluster, built from the metadata store: live nodes and their usable
GPUs, active jobs with their models, what each job holds under the plan in force (minus lost
nodes and faulted GPUs), and what the cache servers hold.

Cost: one ListNodes of the nodes changed since the last round (scheduler.live.followed_nodes), one ListJobs of the jobs whose state changed since the last round (every active
job every 30 s, scheduler.live.jobs), one ListTenants (tenant quotas), the job models' calls
(scheduler.live.models), and one Stats per cache server every few seconds (--cache silod).

What the snapshot is made of is made again only where it changed since the last round: the
NodeInfo of a node whose spec changed (heartbeats are all that changes of most nodes, most
rounds), the JobInfo of a job whose message changed (KnownJobs hands out a new one on any
change) or whose fitted model did (JobModels.watch_changes). What is left per round is a walk
over the listed nodes and one over the active jobs, comparing; at 20,000 jobs on 5,000 nodes,
making everything anew took about a second a round (benchmarks/snapshot_round.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

from estimator.per_type import is_reference
from scheduler.live import convert, data
from scheduler.live.clients import Clients
from scheduler.live.followed_nodes import FollowedNodes
from scheduler.live.gpu_health import UsableGpus, faulted_gpus
from scheduler.live.holdings import Holdings
from scheduler.live.inference import LiveInference, is_inference_job
from scheduler.live.jobs import KnownJobs
from scheduler.live.liveness import NodeLiveness
from scheduler.live.models import JobModels, application_of
from scheduler.live.plans import PlanStore
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo, Plan
from scheduler.quotas_proto import quotas_of
from silod.v1 import access_pb2, common_pb2, plan_pb2


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
        # What jobs hold under the plan in force, followed from plan to plan by their changes.
        self._holdings = Holdings(plans.changes_from)
        self._listed = FollowedNodes()  # every node, by the changes since the last round's listing
        self._nodes = LiveNodes()
        self._rank_room: frozenset[tuple[float, int]] | None = None  # of the nodes of the last listing
        self._job_infos = JobInfos(models)
        self.current_from: plan_pb2.AllocationPlan | None = None  # the plan the last snapshot's current was read off

    async def build(self) -> tuple[ClusterSnapshot, list[common_pb2.Job]]:
        request = self._listed.request(self.liveness.window_s())
        listed_changed = self._listed.take(request, await self.clients.md.ListNodes(request))
        self.liveness.metadata_seen()
        nodes = self._nodes
        if listed_changed and nodes.update(self._listed.alive):  # a node came, went or changed its spec
            self.liveness.saw_nodes(nodes.listed)
            self.plans.remember_nodes(nodes.changed_with_gpus)
            self._rank_room = self.liveness.rank_room
        else:
            # What ranks may request is as the last listing said; the node watch may have set
            # what its own listing said since, and saw_nodes would set this one's.
            self.liveness.rank_room = self._rank_room
        self.usable = nodes.usable
        infos, alive = nodes.infos, nodes.alive
        jobs = await self.jobs.refresh()
        matched = self._job_infos.match(jobs)
        if matched.left:
            self._forget_finished(matched.active_ids())
        if not self._inference_restored:  # replicas the previous scheduler left on the plan
            self.inference.restore(self.plans.latest, {j.id for j in jobs})
            self._inference_restored = True
        inference_jobs, training = matched.inference, matched.training
        # Only a job new here, or whose message changed, can lack a profile: the others were
        # made with theirs, which stay while the job is active.
        new_or_changed = [job for _, job in matched.fresh_training]
        await self.models.warm_up({application_of(j.spec) for j in new_or_changed if j.id not in self.models.profiles})
        datasets = await self.models.datasets_of(new_or_changed)
        await self.models.refresh_fitted(matched.training_ids)
        self.node_types = nodes.types
        job_infos = self._job_infos.update(matched, datasets, nodes.gpu_types, self.plans.specs)
        current = self._current(training, alive)
        # Tenant quotas, read every round: a SetTenantQuota applies from the next round.
        quotas = quotas_of((await self.clients.md.ListTenants(access_pb2.ListTenantsRequest())).tenants)
        silod = self.cache_mode == "silod"
        probe = self.clients.cached
        cached: dict[tuple[str, str], float] = {}
        if silod and probe is not None and any(i.cache_capacity_bytes > 0 for i in infos):
            cached = await probe.cached_bytes(nodes.with_gpus)
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
        self.current_from = self.plans.latest
        return self._holdings.current(self.current_from, min_gpus, alive, self.usable)


class LiveNodes:
    """The live nodes of the last ListNodes answer as the policy sees them (NodeInfo, usable
    GPUs, GPU types), each node's made again only when its spec changed.

    The nodes' specs are kept as copies: a part of an answer keeps the whole answer alive (upb
    messages share their arena), and a node's spec may stay unchanged for months."""

    def __init__(self) -> None:
        self.listed: list[common_pb2.Node] = []  # copies (spec only) of the last answer's nodes, in its order
        self._specs: list[common_pb2.NodeSpec] | None = None  # their specs, in the same order; None before the first
        self._by_name: dict[str, tuple[common_pb2.Node, NodeInfo | None]] = {}  # with the NodeInfo of one with GPUs
        self.with_gpus: list[common_pb2.Node] = []  # copies of the nodes with GPUs
        self.changed_with_gpus: list[common_pb2.Node] = []  # those new or changed in the last answer
        self.infos: tuple[NodeInfo, ...] = ()  # of the nodes with GPUs, by name
        self.alive: dict[str, NodeInfo] = {}  # node -> its NodeInfo
        self.types: dict[str, str] = {}  # node -> GPU type
        self.gpu_types: tuple[str, ...] = ()  # the distinct types, sorted
        self.usable = UsableGpus(())

    def update(self, answer: Sequence[common_pb2.Node]) -> bool:
        """Take a ListNodes answer; whether a node came, went or changed its spec since the last."""
        listed = list(answer)  # each node's message made once, for the two looks below
        # Compared in the answer's order, which is the last one's unless nodes came or went.
        same = self._specs is not None and [node.spec for node in listed] == self._specs
        if not same:
            self._take(listed)
        faulty = [node for node in listed if node.gpu_faults]  # faults are not part of the spec
        if not same or faulted_gpus(faulty) != self.usable.faulted:
            self.usable = UsableGpus(faulty)  # only nodes with faults matter to it
        return not same

    def _take(self, answer: Sequence[common_pb2.Node]) -> None:
        by_name: dict[str, tuple[common_pb2.Node, NodeInfo | None]] = {}
        changed: list[common_pb2.Node] = []
        for node in answer:
            spec = node.spec
            known = self._by_name.get(spec.name)
            if known is None or known[0].spec != spec:
                copy = common_pb2.Node(spec=spec)
                known = (copy, convert.node_info(copy) if spec.gpus > 0 else None)
                if spec.gpus > 0:
                    changed.append(copy)
            by_name[spec.name] = known
        with_gpus = {name: info for name, (_, info) in by_name.items() if info is not None}
        # Sorted by name again only when nodes came or went: otherwise the order of last time stands.
        names = sorted(with_gpus) if with_gpus.keys() != self.alive.keys() else list(self.alive)
        self.infos = tuple(with_gpus[name] for name in names)
        self.alive = {info.name: info for info in self.infos}
        self.types = {info.name: info.gpu_type for info in self.infos}
        self.gpu_types = tuple(sorted(set(self.types.values())))
        self.listed = [node for node, _ in by_name.values()]
        self.with_gpus = [node for node, info in by_name.values() if info is not None]
        self.changed_with_gpus = changed
        self._by_name = by_name
        self._specs = [node.spec for node in self.listed]


@dataclasses.dataclass(slots=True)
class _Known:
    """An active job as the last snapshot saw it."""

    job: common_pb2.Job  # the message its info was made of
    job_id: str
    info: JobInfo | None  # None: an inference job (LiveInference places those, not the policy)


@dataclasses.dataclass
class _Matched:
    """The active jobs of a round, matched against the last round's (JobInfos.match)."""

    training: list[common_pb2.Job]
    training_ids: list[str]
    infos: list[JobInfo | None]  # per training job: last round's, None where it has to be made
    fresh_training: list[tuple[int, common_pb2.Job]]  # (index in training, job): new, or its message changed
    inference: list[common_pb2.Job]
    fresh_inference: list[common_pb2.Job]
    left: bool  # a job of last round's is no longer active (or this is the first round)
    _active_ids: set[str] | None = None

    def active_ids(self) -> set[str]:
        if self._active_ids is None:
            self._active_ids = set(self.training_ids).union(job.id for job in self.inference)
        return self._active_ids


class JobInfos:
    """Each active job as the policy sees it (JobInfo), made again only when something it is
    made of changed: the job's message (KnownJobs hands out a new one on any change), its
    model (JobModels.watch_changes) or the GPU types of the nodes (its model per type).

    A round first matches its jobs against the last round's by message (:meth:`match`), then,
    once the models are up to date, makes the infos that changed (:meth:`update`)."""

    def __init__(self, models: JobModels) -> None:
        self.models = models
        self._model_changes = models.watch_changes()
        # The jobs of the last round, by their message and by id. An entry holds its message,
        # so no other message can have that id() while it is here.
        self._by_message: dict[int, _Known] = {}
        self._by_id: dict[str, _Known] = {}
        self._gpu_types: tuple[str, ...] | None = None  # the node GPU types the infos were made for
        self._first = True

    def match(self, jobs: list[common_pb2.Job]) -> _Matched:
        matched = _Matched([], [], [], [], [], [], left=False)
        training, training_ids, infos = matched.training, matched.training_ids, matched.infos
        by_message = self._by_message
        arrived = 0
        for job in jobs:
            known = by_message.get(id(job))
            if known is None:
                arrived += job.id not in self._by_id
                if is_inference_job(job):
                    matched.inference.append(job)
                    matched.fresh_inference.append(job)
                else:
                    matched.fresh_training.append((len(training), job))
                    training.append(job)
                    training_ids.append(job.id)
                    infos.append(None)
            elif known.info is None:
                matched.inference.append(job)
            else:
                training.append(job)
                training_ids.append(known.job_id)
                infos.append(known.info)
        # The first round forgets too: the parts may know jobs from before it (reports, a restart).
        matched.left = len(jobs) - arrived < len(self._by_id) or self._first
        return matched

    def update(self, matched: _Matched, datasets: dict[str, common_pb2.Dataset | None],
               gpu_types: tuple[str, ...], specs: dict[str, common_pb2.JobSpec]) -> list[JobInfo]:
        """The round's JobInfos, in the order of its training jobs; ``specs`` (job -> spec, for
        the nodes' plans) learns those of the jobs new or changed."""
        changed = set(self._model_changes)  # changes made while this runs are for the next round
        self._model_changes.difference_update(changed)
        retyped = gpu_types != self._gpu_types
        try:
            remake = dict(matched.fresh_training)  # index -> job
            if retyped:
                remake = dict(enumerate(matched.training))
            elif changed.difference(matched.training_ids[index] for index in remake):  # not only jobs made anyway
                for index, job_id in enumerate(matched.training_ids):
                    if job_id in changed and index not in remake:
                        remake[index] = matched.training[index]
            for index, job in remake.items():
                job_id = matched.training_ids[index]
                before = self._by_id.get(job_id)
                info = self._made(job, before, retyped or job_id in changed, datasets, gpu_types)
                matched.infos[index] = info
                self._keep(_Known(job, job_id, info), before, specs)
            for job in matched.fresh_inference:
                self._keep(_Known(job, job.id, None), self._by_id.get(job.id), specs)
            if matched.left:
                for job_id in self._by_id.keys() - matched.active_ids():
                    del self._by_message[id(self._by_id.pop(job_id).job)]
        except BaseException:
            # Half done: the next round makes every info anew rather than trust these.
            self._by_message, self._by_id, self._gpu_types = {}, {}, None
            raise
        self._gpu_types = gpu_types
        self._first = False
        return matched.infos  # type: ignore[return-value]

    def _keep(self, known: _Known, before: _Known | None, specs: dict[str, common_pb2.JobSpec]) -> None:
        if before is not None and before.job is not known.job:
            del self._by_message[id(before.job)]
        if before is None or before.job is not known.job:
            specs[known.job_id] = known.job.spec
        self._by_message[id(known.job)] = known
        self._by_id[known.job_id] = known

    def _made(self, job: common_pb2.Job, before: _Known | None, model_changed: bool,
              datasets: dict[str, common_pb2.Dataset | None], gpu_types: tuple[str, ...]) -> JobInfo:
        """``job``'s info: ``before``'s again if it comes out the same."""
        kept, old = (before.info, before.job) if before is not None else (None, None)
        if kept is not None and not model_changed and job.spec == old.spec:  # type: ignore[union-attr]
            # Its model is made of its spec, profile and fitted model only; its info, of those and
            # its creation time and progress. A state move, or KnownJobs' periodic whole read
            # (every job's message new), changes neither.
            progress_same = job.progress.samples_done == old.progress.samples_done  # type: ignore[union-attr]
            if progress_same and job.created_at == old.created_at:  # type: ignore[union-attr]
                return kept
            model, target, type_models = kept.model, kept.target_samples, kept.type_models
        else:
            model, target = self.models.model_now(job, datasets)
            type_models = self.models.type_models_now(job, model, gpu_types) if any(gpu_types) else {}
            if len(gpu_types) == 1 and not is_reference(gpu_types[0]):
                # One type, not the reference: policies price every job with its model there.
                model, type_models = type_models[gpu_types[0]], {}
            type_models = type_models if len(gpu_types) > 1 else {}
        info = _job_info(job, model, target, type_models)
        return kept if info == kept else info


def _job_info(job: common_pb2.Job, model: object, target: float, type_models: dict) -> JobInfo:
    spec = job.spec
    return JobInfo(
        job_id=job.id, model=model, submit_time_s=_epoch_s(job.created_at),  # type: ignore[arg-type]
        min_gpus=spec.min_gpus, max_gpus=spec.max_gpus, target_samples=target,
        samples_done=min(float(job.progress.samples_done), target * 0.999), requested_gpus=spec.max_gpus,
        batch_size=spec.batch_size, dataset=spec.dataset, priority=spec.priority,
        tenant=spec.tenant or "default", gpu_types=tuple(spec.gpu_types), type_models=type_models,
        cpus_per_rank=spec.cpus_per_rank, memory_bytes_per_rank=spec.memory_bytes_per_rank,
    )


def _epoch_s(stamp) -> float:
    """Seconds since the epoch of a Timestamp, as the UTC datetime's timestamp() gives them
    (microseconds, one rounding), without building the datetime: once per JobInfo made."""
    return (stamp.seconds * 1_000_000 + stamp.nanos // 1000) / 1_000_000
