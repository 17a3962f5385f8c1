"""The policy's view of the cluster, built from the metadata store: live nodes and their usable
GPUs, active jobs with their models, what each job holds under the plan in force (minus lost
nodes and faulted GPUs), and what the cache servers hold.

Cost: one ListNodes of the nodes changed since the last round (scheduler.live.followed_nodes), one ListJobs of the jobs whose state changed since the last round (every active
job every 30 s, scheduler.live.jobs), one ListTenants (tenant quotas), the job models' calls
(scheduler.live.models), and one Stats per cache server every few seconds (--cache silod).

What the snapshot is made of is made again only where it changed since the last round: the
NodeInfo of a node whose spec changed (heartbeats are all that changes of most nodes, most
rounds), the JobInfo of a job whose message changed or whose fitted model did
(scheduler.live.job_infos, which follows KnownJobs' changes rather than compare every job). The
snapshot says which JobInfos changed since the last one (ClusterSnapshot.jobs_changed). At
20,000 jobs on 5,000 nodes, making everything anew took about a second a round
(benchmarks/snapshot_round.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence

from scheduler.live import convert, data
from scheduler.live.clients import Clients
from scheduler.live.followed_nodes import FollowedNodes
from scheduler.live.gpu_health import UsableGpus, faulted_gpus
from scheduler.live.holdings import Holdings
from scheduler.live.inference import LiveInference
from scheduler.live.job_infos import JobInfos, MinGpus
from scheduler.live.jobs import KnownJobs
from scheduler.live.liveness import NodeLiveness
from scheduler.live.models import JobModels, application_of
from scheduler.live.plans import PlanStore
from scheduler.policy import ClusterSnapshot, NodeInfo
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
        # Of the last snapshot's active jobs, for the planner: no pass over 20,000 to find them again.
        self.inference_jobs: list[common_pb2.Job] = []
        self.training_ids: Collection[str] = ()
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
        matched = self._job_infos.match(jobs, self.jobs)
        if matched.forget:
            self._forget_finished(matched.active_ids())
        if not self._inference_restored:  # replicas the previous scheduler left on the plan
            self.inference.restore(self.plans.latest, {j.id for j in jobs})
            self._inference_restored = True
        self.inference_jobs = list(matched.inference.values())
        self.training_ids = matched.training_ids
        # Only a job new here, or whose message changed, can lack a profile: the others were
        # made with theirs, which stay while the job is active.
        new_or_changed = [job for job, _ in matched.fresh_training]
        await self.models.warm_up({application_of(j.spec) for j in new_or_changed if j.id not in self.models.profiles})
        datasets = await self.models.datasets_of(new_or_changed)
        await self.models.refresh_fitted(list(matched.training_ids))
        self.node_types = nodes.types
        job_infos, jobs_changed = self._job_infos.update(matched, datasets, nodes.gpu_types, self.plans.specs)
        self.current_from = self.plans.latest
        # Inference tasks hold nothing here: LiveInference keeps them.
        current = self._holdings.current(self.current_from, MinGpus(matched.training), alive, self.usable)
        # Tenant quotas, read every round: a SetTenantQuota applies from the next round.
        quotas = quotas_of((await self.clients.md.ListTenants(access_pb2.ListTenantsRequest())).tenants)
        silod = self.cache_mode == "silod"
        probe = self.clients.cached
        cached: dict[tuple[str, str], float] = {}
        if silod and probe is not None and any(i.cache_capacity_bytes > 0 for i in infos):
            cached = await probe.cached_bytes(nodes.with_gpus)
        # What each running job's nodes cached since its epoch began: no hits for it yet (the
        # same rule as the simulator's, scheduler.data_grants.EpochStarts).
        held = current.allocations
        fresh = self._epoch_starts.fresh(cached, (
            (j.id, j.spec.dataset, j.progress.epochs_done, [n for n, _ in held[j.id].placement] if j.id in held else [])
            for j in matched.training_jobs())) if silod and probe is not None else {}
        snap = ClusterSnapshot(
            time_s=time.time(), nodes=infos, jobs=job_infos, current=current,
            restart_cost_s=self.restart_cost_s, interval_s=self.interval_s,
            inference_busy=self.inference.busy(self.inference_jobs),
            storage_bandwidth_bytes_per_s=self.storage_bandwidth_bytes_per_s if silod else math.inf,
            cached_bytes=cached, fresh_bytes=fresh, quotas=quotas, jobs_changed=jobs_changed,
        )
        return snap, jobs


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
