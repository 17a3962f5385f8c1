"""Validation of allocation plans: field ranges, and that no GPU has two holders."""

from __future__ import annotations

from collections.abc import Container, Mapping

from silod.v1 import plan_pb2

from services.metadata.validation.common import (
    MAX_BYTES,
    check_enum,
    check_int,
    check_identifier,
    check_text,
    check_timestamp,
)
from services.metadata.validation.jobs import check_job_id
from services.runtime.errors import InvalidArgument, Problems
from silod.rpc.identifiers import JOB_ID, NODE_NAME, REPLICA_ID

MAX_GPU_INDEX = 1023
CACHE_POLICIES = ("", "uniform", "lru", "lrfu-cost", "none")  # "none": pass-through (cache mode none)
CACHE_MODES = ("", "silod", "lru", "static", "none")

Gpu = tuple[str, int]  # (node, device index)


def check_plan_changes(changes: plan_pb2.PlanChanges, field: str = "changes") -> None:
    """The fields of each changed entry and removed job id (the whole plan they make is checked
    by check_plan after, without checking the unchanged entries' fields again)."""
    problems = Problems()
    check = problems.check
    check(check_int, changes.base_version, f"{field}.base_version", minimum=1, maximum=2**63 - 1)
    seen: set[str] = set()
    for index, job in enumerate(changes.jobs):
        check(_check_job_allocation, job, f"{field}.jobs[{index}]")
        if job.job_id in seen:
            problems.add(f"{field}.jobs[{index}].job_id", f"{job.job_id!r} appears twice in the changes")
        seen.add(job.job_id)
    for index, job_id in enumerate(changes.removed_job_ids):
        check(check_job_id, job_id, f"{field}.removed_job_ids[{index}]")
        if job_id in seen:
            problems.add(f"{field}.removed_job_ids[{index}]", f"{job_id!r} is both changed and removed")
    problems.raise_if_any()


def check_plan(plan: plan_pb2.AllocationPlan, field: str = "plan", *, checked: Container[str] = ()) -> None:
    """Refused with every problem of the plan's fields (the first of each job, replica and loan)
    at once; then, if the fields are sound, that no GPU has two holders. ``checked``: jobs whose
    entries were checked before (unchanged since a committed plan): their fields are not again."""
    problems = Problems()
    check = problems.check
    check(check_int, plan.version, f"{field}.version", minimum=1, maximum=2**63 - 1)
    if plan.HasField("created_at"):
        check(check_timestamp, plan.created_at, f"{field}.created_at")
    check(check_text, plan.policy, f"{field}.policy", max_chars=128)
    if plan.cache_mode not in CACHE_MODES:
        problems.add(f"{field}.cache_mode", f"must be one of {CACHE_MODES[1:]} or empty, got {plan.cache_mode[:40]!r}")
    check(check_text, plan.reason, f"{field}.reason", max_chars=256)
    budget_ok = check(check_int, plan.storage_bandwidth_budget_bytes_per_s, f"{field}.storage_bandwidth_budget_bytes_per_s",
                      minimum=0, maximum=MAX_BYTES)

    granted_remote_io = 0
    seen_jobs: set[str] = set()
    for index, job in enumerate(plan.jobs):
        job_field = f"{field}.jobs[{index}]"
        if job.job_id not in checked:
            check(_check_job_allocation, job, job_field)
        if job.job_id in seen_jobs:
            problems.add(f"{job_field}.job_id", f"{job.job_id!r} appears twice in the plan")
        seen_jobs.add(job.job_id)
        granted_remote_io += sum(grant.remote_io_bytes_per_s for grant in job.cache_grants)

    budget = plan.storage_bandwidth_budget_bytes_per_s
    if budget_ok and budget and granted_remote_io > budget:
        problems.add(f"{field}.storage_bandwidth_budget_bytes_per_s",
                     f"jobs are granted {granted_remote_io} bytes/s of remote IO in total, more than this budget of {budget}")
    seen_replicas: set[str] = set()
    for index, replica in enumerate(plan.replicas):
        replica_field = f"{field}.replicas[{index}]"
        check(_check_replica, replica, replica_field)
        if replica.replica_id in seen_replicas:
            problems.add(f"{replica_field}.replica_id", f"{replica.replica_id!r} appears twice in the plan")
        seen_replicas.add(replica.replica_id)
    for index, loan in enumerate(plan.loans):
        loan_field = f"{field}.loans[{index}]"
        check(check_identifier, loan.node, NODE_NAME, f"{loan_field}.node")
        check(check_int, loan.gpu_index, f"{loan_field}.gpu_index", minimum=0, maximum=MAX_GPU_INDEX)
        check(check_job_id, loan.job_id, f"{loan_field}.job_id")
    problems.raise_if_any()
    _check_gpus_held_once(plan, field)


def _check_job_allocation(job: plan_pb2.JobAllocation, field: str) -> None:
    check_job_id(job.job_id, f"{field}.job_id")
    for index, placement in enumerate(job.placements):
        check_identifier(placement.node, NODE_NAME, f"{field}.placements[{index}].node")
        for gpu_index in placement.gpu_indices:
            check_int(gpu_index, f"{field}.placements[{index}].gpu_indices", minimum=0, maximum=MAX_GPU_INDEX)
    check_int(job.batch_size, f"{field}.batch_size", minimum=0, maximum=2**31 - 1)
    check_int(job.generation, f"{field}.generation", minimum=0, maximum=2**63 - 1)
    for index, grant in enumerate(job.cache_grants):
        grant_field = f"{field}.cache_grants[{index}]"
        check_identifier(grant.node, NODE_NAME, f"{grant_field}.node")
        check_int(grant.cache_quota_bytes, f"{grant_field}.cache_quota_bytes", minimum=0, maximum=MAX_BYTES)
        check_int(grant.remote_io_bytes_per_s, f"{grant_field}.remote_io_bytes_per_s", minimum=0, maximum=MAX_BYTES)
    if job.cache_policy not in CACHE_POLICIES:
        raise InvalidArgument(
            f"must be one of {CACHE_POLICIES[1:]} or empty, got {job.cache_policy[:40]!r}", field=f"{field}.cache_policy"
        )


def _check_replica(replica: plan_pb2.InferenceReplica, field: str) -> None:
    check_identifier(replica.replica_id, REPLICA_ID, f"{field}.replica_id")
    check_text(replica.application, f"{field}.application", max_chars=128)
    check_identifier(replica.node, NODE_NAME, f"{field}.node")
    check_int(replica.gpu_index, f"{field}.gpu_index", minimum=0, maximum=MAX_GPU_INDEX)
    check_enum(replica.state, plan_pb2.ReplicaState.DESCRIPTOR, f"{field}.state")
    check_identifier(replica.task_id, JOB_ID, f"{field}.task_id", required=False)
    check_int(replica.reuse_count, f"{field}.reuse_count", minimum=0, maximum=2**31 - 1)
    if replica.HasField("protect_until"):
        check_timestamp(replica.protect_until, f"{field}.protect_until")


def _check_gpus_held_once(plan: plan_pb2.AllocationPlan, field: str) -> None:
    """A GPU has one holder: a job placed on it, or a live replica on it.

    Lending is the one sanctioned overlap (DeepBoot): a SLEEP replica's GPU may be lent to a
    training job, which then also places ranks on it; the loan must name that same job.
    """
    holder: dict[Gpu, str] = {}
    for job_index, job in enumerate(plan.jobs):
        for placement_index, placement in enumerate(job.placements):
            for gpu_index in placement.gpu_indices:
                gpu = (placement.node, gpu_index)
                if gpu in holder:
                    raise InvalidArgument(
                        f"GPU {_show(gpu)} already held by {holder[gpu]}",
                        field=f"{field}.jobs[{job_index}].placements[{placement_index}].gpu_indices",
                    )
                holder[gpu] = job.job_id
    check_loans_and_replicas(plan, holder, field)


def check_loans_and_replicas(plan: plan_pb2.AllocationPlan, holder: Mapping[Gpu, str], field: str = "plan") -> None:
    """The plan's loans and live replicas against each other and against ``holder``, the job on
    each GPU the plan's jobs hold (the rule of _check_gpus_held_once)."""
    lent_to: dict[Gpu, str] = {}
    for index, loan in enumerate(plan.loans):
        gpu = (loan.node, loan.gpu_index)
        if gpu in lent_to:
            raise InvalidArgument(f"GPU {_show(gpu)} already lent to {lent_to[gpu]}", field=f"{field}.loans[{index}]")
        if gpu in holder and holder[gpu] != loan.job_id:
            raise InvalidArgument(f"GPU {_show(gpu)} already held by {holder[gpu]}", field=f"{field}.loans[{index}]")
        lent_to[gpu] = loan.job_id

    replica_on: dict[Gpu, str] = {}
    for index, replica in enumerate(plan.replicas):
        if replica.state == plan_pb2.REPLICA_STATE_END:
            continue  # torn down: holds nothing
        gpu = (replica.node, replica.gpu_index)
        replica_field = f"{field}.replicas[{index}]"
        if gpu in replica_on:
            raise InvalidArgument(f"GPU {_show(gpu)} already held by replica {replica_on[gpu]}", field=replica_field)
        replica_on[gpu] = replica.replica_id
        sleeping_and_lent = replica.state == plan_pb2.REPLICA_STATE_SLEEP and gpu in lent_to
        # A running replica is placed as its task's job, so that job holds the same GPU.
        serving_its_task = replica.state == plan_pb2.REPLICA_STATE_RUNNING and holder.get(gpu) == replica.task_id
        if gpu in holder and not sleeping_and_lent and not serving_its_task:
            raise InvalidArgument(f"GPU {_show(gpu)} already held by {holder[gpu]}", field=replica_field)
        if gpu in lent_to and not sleeping_and_lent:
            raise InvalidArgument(
                f"GPU {_show(gpu)} is lent to {lent_to[gpu]}; only a SLEEP replica may stay on a lent GPU",
                field=replica_field,
            )


def _show(gpu: Gpu) -> str:
    return f"{gpu[0]}:{gpu[1]}"
