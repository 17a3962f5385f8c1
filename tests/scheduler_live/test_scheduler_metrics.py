"""How the scheduler's metrics read plans: what a committed plan did to each job, and the GPUs
by state under the plan in force (tests/observability checks them moving in a live cluster)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from scheduler.live import metrics
from scheduler.policy import ClusterSnapshot, NodeInfo
from silod.v1 import plan_pb2


def _entry(job: str, generation: int, *placements: tuple[str, list[int]], fast: bool = False,
           cache: int = 0, io: int = 0) -> plan_pb2.JobAllocation:
    entry = plan_pb2.JobAllocation(job_id=job, generation=generation, fast_resize=fast)
    for node, gpus in placements:
        entry.placements.add(node=node, gpu_indices=gpus)
        entry.cache_grants.add(node=node, cache_quota_bytes=cache, remote_io_bytes_per_s=io)
    return entry


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_each_kind_of_change_is_counted_once() -> None:
    kinds = ("started", "resized_in_place", "resized_by_restart", "preempted")
    before = {k: _value("silod_scheduler_job_changes_total", kind=k) for k in kinds}
    lends, reclaims = _value("silod_scheduler_gpu_lends_total"), _value("silod_scheduler_gpu_reclaims_total")
    old = {e.job_id: e for e in (
        _entry("grows", 1, ("t0", [0])),
        _entry("moves", 1, ("t0", [1])),
        _entry("stops", 1, ("t1", [0])),
        _entry("borrower", 1, ("i0", [0, 1])),
        _entry("same", 3, ("t1", [1])),
    )}
    new = plan_pb2.AllocationPlan(version=7, jobs=[
        _entry("grows", 2, ("t0", [0]), ("i0", [0]), fast=True),   # in place, borrowing inference GPU 0
        _entry("moves", 2, ("t1", [0])),                            # by restart
        _entry("stops", 2),                                         # no GPUs left: preempted
        _entry("borrower", 2),                                      # gives both inference GPUs back
        _entry("same", 3, ("t1", [1])),                             # unchanged
        _entry("new", 1, ("t0", [2])),                              # started
    ])
    metrics.plan_committed(new, old, {"t0": "training", "t1": "training", "i0": "inference"})
    after = {k: _value("silod_scheduler_job_changes_total", kind=k) - before[k] for k in kinds}
    assert after == {"started": 1, "resized_in_place": 1, "resized_by_restart": 1, "preempted": 2}
    # i0's GPUs 0 and 1 were lent; now only GPU 0 is (to another job): one reclaim, no new lend.
    assert _value("silod_scheduler_gpu_lends_total") - lends == 0
    assert _value("silod_scheduler_gpu_reclaims_total") - reclaims == 1


def test_gpus_by_state_grants_and_version_under_the_plan_in_force() -> None:
    snap = ClusterSnapshot(time_s=0.0, jobs=(), nodes=(
        NodeInfo("t0", 4, "training", gpu_type="a100"), NodeInfo("i0", 2, "inference", gpu_type="t4")))
    plan = plan_pb2.AllocationPlan(version=12, jobs=[
        _entry("a", 1, ("t0", [0, 1]), cache=10 << 30, io=50_000_000),
        _entry("b", 1, ("i0", [1]), cache=1 << 30, io=0),
    ], replicas=[plan_pb2.InferenceReplica(node="i0", gpu_index=0, state=plan_pb2.REPLICA_STATE_RUNNING)])
    metrics.plan_in_force(plan, snap, {"t0": frozenset({3})})
    gpus = {(state, gpu_type, pool): _value("silod_scheduler_gpus", state=state, gpu_type=gpu_type, pool=pool)
            for state, gpu_type, pool in (("allocated", "a100", "training"), ("idle", "a100", "training"),
                                          ("faulted", "a100", "training"), ("lent", "t4", "inference"),
                                          ("inference", "t4", "inference"))}
    assert gpus == {("allocated", "a100", "training"): 2, ("idle", "a100", "training"): 1,
                    ("faulted", "a100", "training"): 1, ("lent", "t4", "inference"): 1,
                    ("inference", "t4", "inference"): 1}
    assert _value("silod_scheduler_cache_bytes_granted") == 11 << 30
    assert _value("silod_scheduler_remote_io_bytes_per_second_granted") == 50_000_000
    assert _value("silod_scheduler_plan_version") == 12


def test_jobs_by_state_and_tenant() -> None:
    from silod.v1 import common_pb2

    def job(state: int, tenant: str, created: int) -> common_pb2.Job:
        j = common_pb2.Job(state=state, spec=common_pb2.JobSpec(tenant=tenant))
        j.created_at.seconds = created
        return j

    metrics.jobs_seen([job(common_pb2.JOB_STATE_PENDING, "team-a", 1000), job(common_pb2.JOB_STATE_RUNNING, "team-a", 900),
                       job(common_pb2.JOB_STATE_PENDING, "team-b", 1500)], now_s=2000.0)
    assert _value("silod_scheduler_jobs", state="PENDING", tenant="team-a") == 1
    assert _value("silod_scheduler_jobs", state="PENDING", tenant="team-b") == 1
    assert _value("silod_scheduler_jobs", state="RUNNING", tenant="team-a") == 1
    assert _value("silod_scheduler_oldest_pending_job_age_seconds") == 1000
    metrics.jobs_seen([], now_s=2000.0)  # every job gone: the tenants' series go, each state reads 0
    assert REGISTRY.get_sample_value("silod_scheduler_jobs", {"state": "PENDING", "tenant": "team-a"}) is None
    assert REGISTRY.get_sample_value("silod_scheduler_jobs", {"state": "PENDING", "tenant": ""}) == 0


def test_rounds_are_counted_by_how_the_policy_answered() -> None:
    """kept: from what the policy keeps between rounds; whole: a pass over every job (a policy
    that keeps nothing always)."""
    import dataclasses

    from estimator.job_model import JobModel
    from scheduler.policies.gavel import GavelPolicy
    from scheduler.policies.sjf import SjfPolicy
    from scheduler.policy import JobInfo

    model = JobModel.from_profile("cifar10")
    snap = ClusterSnapshot(time_s=0.0, nodes=(NodeInfo("n0", 8),), jobs=tuple(
        JobInfo(job_id=f"j{k}", model=model, submit_time_s=float(k), min_gpus=1, max_gpus=2, requested_gpus=2,
                target_samples=1e6) for k in range(6)))
    counts = []
    for policy in (SjfPolicy(), GavelPolicy()):
        for _ in range(3):  # a memo is built on the second call on the same nodes, used from the third
            before = {a: _value("silod_scheduler_policy_answers_total", answer=a) for a in ("kept", "whole")}
            snap = dataclasses.replace(snap, current=policy.schedule(snap))
            metrics.policy_answered(policy)
            counts.append(tuple(_value("silod_scheduler_policy_answers_total", answer=a) - before[a]
                                for a in ("kept", "whole")))
    assert counts == [(0, 1), (0, 1), (1, 0)] + [(0, 1)] * 3
