"""One round's plan, from a snapshot: the policy on the usable GPUs within the tenants' quotas,
inference tasks beside it, release holds, the cache mode's data grants, the invariants, then
the plan proto with each job's generation and rendezvous port. No I/O: what it reads comes in as arguments, so a
caller may plan from any snapshot (and commit elsewhere).

The data step after the policy is the simulator's too (scheduler.data_grants.grant, as in
simulator/engine.py), and so are the invariants (scheduler.invariants, checked by what changed
since the last plan: scheduler.plan_check).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence

from scheduler.codesign import is_active as co_active
from scheduler.data_grants import GrantCheck
from scheduler.plan_check import PlanCheck
from scheduler.live import data, metrics
from scheduler.live.gpu_health import Placement, UsableGpus
from scheduler.live.inference import LiveInference, is_inference_job
from scheduler.live.entries import EntryBuilder, EntryChanges
from scheduler.live.releases import Gpu, ReleaseHolds
from scheduler.placement import node_types, placement_type
from scheduler.policy import Allocation, ChangedSince, ClusterSnapshot, Plan
from scheduler.quotas import QuotaBounded
from scheduler.registry import get_policy
from silod.v1 import common_pb2, plan_pb2


def configured_policy(name: str, cache_mode: str) -> tuple[object, bool]:
    """The policy ``name`` for ``cache_mode``, and whether it grants cache and IO itself."""
    if cache_mode not in data.CACHE_MODES:
        raise ValueError(f"cache_mode: must be one of {', '.join(data.CACHE_MODES)}, got {cache_mode!r}")
    # --cache silod: the policy prices jobs with T(g, c, b) and grants cache and IO with the
    # GPUs (its codesign option), as in the simulator; a policy without one gets co_allocate's
    # grants after it (scheduler.live.data).
    policy = get_policy(name)
    if cache_mode == "silod" and dataclasses.is_dataclass(policy) \
            and "codesign" in {f.name for f in dataclasses.fields(policy)}:
        return dataclasses.replace(policy, codesign=True), True
    return policy, False


@dataclasses.dataclass
class RoundPlanner:
    policy: object
    policy_name: str
    policy_co_designs: bool
    cache_mode: str
    inference: LiveInference
    # The entries of each plan, built from the plan in force (scheduler.live.entries): what the
    # last plan changed, and each job's placement in it as convert.placement_of gives it, which
    # the caller hands on rather than have them read off 20,000 entries again.
    entries: EntryBuilder = dataclasses.field(default_factory=EntryBuilder)
    # The invariants of the policy's plans and of the plans that go out, each checked by what
    # changed since the last one (scheduler.plan_check; the whole check where anything is wrong).
    policy_check: PlanCheck = dataclasses.field(default_factory=PlanCheck)
    plan_check: PlanCheck = dataclasses.field(default_factory=PlanCheck)
    holds: ReleaseHolds = dataclasses.field(default_factory=ReleaseHolds)  # scheduler.live.releases
    grant_check: GrantCheck = dataclasses.field(default_factory=GrantCheck)  # data grants within the cluster

    @property
    def placements(self) -> dict[str, Placement]:
        return self.entries.placements

    @property
    def changes(self) -> EntryChanges | None:
        """What the last plan built changes of its base (None: it had none)."""
        return self.entries.changes

    def plan(self, snap: ClusterSnapshot, jobs: Sequence[common_pb2.Job], usable: UsableGpus, *,
             base: plan_pb2.AllocationPlan | None, busy: Mapping[Gpu, str], restarting: Collection[str],
             reason: str, inference_jobs: Sequence[common_pb2.Job] | None = None,
             training_ids: Collection[str] | None = None,
             job_changes: ChangedSince[common_pb2.Job] | None = None) -> plan_pb2.AllocationPlan:
        """The plan that follows ``base`` (the plan in force) for ``snap`` and its ``jobs``.
        ``busy``: GPUs not yet released, by owner (ReleaseTracker.busy); ``restarting``: jobs
        that start every rank anew from their checkpoint (CrashRestarts.waiting).
        ``inference_jobs`` and ``training_ids``: ``jobs`` split by kind, where the caller has them
        (SnapshotBuilder keeps them), rather than found again by a pass over every job;
        ``job_changes``: which jobs' messages changed since the last round (KnownJobs.changed_since,
        whose ``after`` ``jobs`` are the values of), for the entries to follow."""
        if inference_jobs is None or training_ids is None:
            inference_jobs = [j for j in jobs if is_inference_job(j)]
            training_ids = {j.id for j in jobs} - {j.id for j in inference_jobs}
        plan = self._allocate(snap, inference_jobs, training_ids, usable, busy)
        return self._proto(snap, jobs, plan, training_ids, base=base, restarting=restarting, reason=reason,
                           job_changes=job_changes)

    def _allocate(self, snap: ClusterSnapshot, inference_jobs: Sequence[common_pb2.Job], training_ids: Collection[str],
                  usable: UsableGpus, busy: Mapping[Gpu, str]) -> Plan:
        # On the usable GPUs only, within the tenants' quotas (the simulator's rule, scheduler.quotas).
        # Checked on the policy's view by usable.schedule, and below as the plan that goes out.
        policy_plan = usable.schedule(QuotaBounded(self.policy), snap, self.policy_check.check)
        metrics.policy_answered(self.policy)
        plan = self.inference.place(snap, policy_plan, list(inference_jobs), unusable=usable.faulted)
        # Without inference tasks the plan is the policy's, which the check above held to one job a GPU.
        plan = self.holds.hold(plan, snap.current, busy, snap, overlap_free=not inference_jobs)
        inference_ids = {j.id for j in inference_jobs}
        # Cache quotas and IO rates of the cache mode, on the placements that survived the
        # release holds and inference reclaims (inference tasks read no dataset).
        plan = data.grant(self.cache_mode, snap, plan, policy_plan, training_ids, self.policy_co_designs)
        training_plan = Plan({k: a for k, a in plan.allocations.items() if k not in inference_ids}) \
            if inference_ids else plan
        self.plan_check.check(snap, training_plan)
        broken = self.grant_check.problems(snap, training_plan)
        if broken:  # a bug, not a condition to live with: the cache servers would refuse the plan
            raise AssertionError("data grants exceed the cluster: " + "; ".join(broken))
        return plan

    def _proto(self, snap: ClusterSnapshot, jobs: Sequence[common_pb2.Job], plan: Plan, training_ids: Collection[str], *,
               base: plan_pb2.AllocationPlan | None, restarting: Collection[str], reason: str,
               job_changes: ChangedSince[common_pb2.Job] | None) -> plan_pb2.AllocationPlan:
        managed = self.cache_mode != "silod" or co_active(snap)
        proto = plan_pb2.AllocationPlan(
            version=(base.version if base is not None else 0) + 1, policy=self.policy_name,
            cache_mode=self.cache_mode, reason=reason,
        )
        if self.cache_mode == "silod" and math.isfinite(snap.storage_bandwidth_bytes_per_s):
            proto.storage_bandwidth_budget_bytes_per_s = int(snap.storage_bandwidth_bytes_per_s)
        proto.created_at.GetCurrentTime()
        kinds = node_types(snap)

        def fill(entry: plan_pb2.JobAllocation, job: common_pb2.Job, alloc: Allocation | None,
                 placement: Placement) -> None:
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

        # What every entry depends on beyond its job and allocation: a change rebuilds them all
        # (a node's GPU type: those on that node).
        self.entries.build(proto, jobs, plan, base=base, restarting=restarting, context=(managed,), node_types=kinds,
                           policy_afe=bool(getattr(self.policy, "afe", False)), fill=fill, job_changes=job_changes)
        self.inference.describe(proto, {n.name for n in snap.nodes if n.pool == "inference"})
        return proto
