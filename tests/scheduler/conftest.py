"""Shared builders for scheduler tests: nodes, jobs, allocations, snapshots, and a hypothesis strategy.

Import them explicitly (``from tests.scheduler.conftest import make_job, make_snapshot``);
the fixtures at the bottom expose the same things to tests that prefer fixtures.

Conventions: node names ``n0, n1, ...`` (inference nodes ``i0, ...``); every job defaults to
a rigid 1-GPU cifar10 job with 1e6 efficiency-weighted samples to go, submitted at time 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import pytest
from hypothesis import strategies as st

from estimator.job_model import JobModel
from scheduler.invariants import check_plan
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo, Plan, Pool

APPLICATIONS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")


def model(application: str = "cifar10") -> JobModel:
    """The profile model of ``application`` (one cached object per application)."""
    return JobModel.from_profile(application)


def make_nodes(
    count: int,
    gpus: int = 4,
    *,
    prefix: str | None = None,
    pool: Pool = "training",
    cache_capacity_bytes: float = 0.0,
    start: int = 0,
) -> tuple[NodeInfo, ...]:
    """``count`` identical nodes named ``{prefix}{start}...``; prefix ``n`` (training) or ``i`` (inference)."""
    prefix = prefix if prefix is not None else ("n" if pool == "training" else "i")
    return tuple(
        NodeInfo(name=f"{prefix}{k}", gpus=gpus, pool=pool, cache_capacity_bytes=cache_capacity_bytes)
        for k in range(start, start + count)
    )


def make_job(
    job_id: str,
    application: str = "cifar10",
    *,
    gpus: int = 1,
    min_gpus: int | None = None,
    max_gpus: int | None = None,
    submit: float = 0.0,
    remaining: float | None = None,
    target_samples: float = 1e6,
    samples_done: float = 0.0,
    **fields,
) -> JobInfo:
    """A job asking for ``gpus`` GPUs; rigid unless ``min_gpus``/``max_gpus`` widen it.

    ``remaining`` (efficiency-weighted samples still to go) overrides ``target_samples``.
    Other ``JobInfo`` fields (``attained_gpu_s``, ``priority``, ``dataset``, ``batch_size``...)
    pass through.
    """
    low = gpus if min_gpus is None else min_gpus
    high = gpus if max_gpus is None else max_gpus
    if remaining is not None:
        target_samples = samples_done + remaining
    fields.setdefault("requested_gpus", gpus)
    return JobInfo(
        job_id=job_id,
        model=fields.pop("model", None) or model(application),
        submit_time_s=submit,
        min_gpus=low,
        max_gpus=high,
        target_samples=target_samples,
        samples_done=samples_done,
        **fields,
    )


def allocation(*placement: tuple[str, Iterable[int]], batch_size: int = 0, **fields) -> Allocation:
    """``allocation(("n0", (0, 1)), ("n1", [2]))``: nodes sorted, indices sorted tuples."""
    normalized = tuple(sorted((node, tuple(sorted(indices))) for node, indices in placement))
    return Allocation(placement=normalized, batch_size=batch_size, **fields)


def plan_of(allocations: Mapping[str, Allocation | Sequence[tuple[str, Iterable[int]]]] | None = None) -> Plan:
    """A plan from ``{job_id: Allocation}`` or ``{job_id: [(node, indices), ...]}``."""
    result = {}
    for job_id, value in (allocations or {}).items():
        result[job_id] = value if isinstance(value, Allocation) else allocation(*value)
    return Plan(result)


def make_snapshot(
    nodes: Sequence[NodeInfo],
    jobs: Sequence[JobInfo],
    *,
    time: float = 0.0,
    current: Plan | Mapping | None = None,
    **fields,
) -> ClusterSnapshot:
    """A snapshot at ``time``; jobs sorted into arrival order; ``current`` as for :func:`plan_of`."""
    current_plan = current if isinstance(current, Plan) else plan_of(current)
    ordered = tuple(sorted(jobs, key=lambda j: (j.submit_time_s, j.job_id)))
    return ClusterSnapshot(time_s=time, nodes=tuple(nodes), jobs=ordered, current=current_plan, **fields)


def running(plan: Plan) -> set[str]:
    """Ids of the jobs holding GPUs under ``plan``."""
    return {job_id for job_id, a in plan.allocations.items() if a.gpus > 0}


def assert_sound(snapshot: ClusterSnapshot, plan: Plan, *, rigid: bool = False) -> None:
    """``check_plan`` plus: only training-pool GPUs unless lent, and (``rigid``) every running job has ``job.requested`` GPUs."""
    check_plan(snapshot, plan)
    jobs = {job.job_id: job for job in snapshot.jobs}
    for job_id, a in plan.allocations.items():
        assert a.gpus == 0 or jobs[job_id].min_gpus <= a.gpus <= jobs[job_id].max_gpus
        if rigid and a.gpus:
            assert a.gpus == jobs[job_id].requested, (job_id, a.gpus, jobs[job_id].requested)


# ---------------------------------------------------------------------------------------
# Random snapshots
# ---------------------------------------------------------------------------------------


@st.composite
def snapshots(
    draw,
    *,
    max_nodes: int = 5,
    max_gpus_per_node: int = 8,
    max_jobs: int = 10,
    inference_nodes: bool = True,
    stale_current: bool = True,
    requests: bool = False,
) -> ClusterSnapshot:
    """Random but well-formed snapshots.

    Training nodes of 1..``max_gpus_per_node`` GPUs (optionally a few inference nodes),
    jobs of every profiled application with random bounds, progress, attained service,
    priorities and datasets, some cached bytes, and a current plan that never double-books
    but (with ``stale_current``) may mention finished jobs, lost nodes or GPUs that no
    longer exist — what a scheduler sees after a node failure.

    With ``requests`` nodes offer a random number of cores and bytes of memory (none, a few,
    no limit) and jobs request some per rank (or none); the current plan may then already
    overflow a node, as after a node re-registers smaller.
    """
    n_training = draw(st.integers(1, max_nodes))
    nodes = [
        NodeInfo(name=f"n{k}", gpus=draw(st.integers(1, max_gpus_per_node)), cache_capacity_bytes=draw(st.sampled_from([0.0, 1e9, 1e11])))
        for k in range(n_training)
    ]
    if inference_nodes:
        nodes += [NodeInfo(name=f"i{k}", gpus=draw(st.integers(1, 4)), pool="inference") for k in range(draw(st.integers(0, 2)))]
    if requests:
        nodes = [dataclasses.replace(node, cpus=draw(st.sampled_from([math.inf, 0.0, 3.0, 8.0, 32.0])),
                                     memory_bytes=draw(st.sampled_from([math.inf, 0.0, 16e9, 64e9])))
                 for node in nodes]
    time = draw(st.floats(0.0, 1e5))
    n_jobs = draw(st.integers(0, max_jobs))
    jobs = []
    for k in range(n_jobs):
        low = draw(st.integers(1, 6))
        high = draw(st.integers(low, low + draw(st.sampled_from([0, 0, 3, 12]))))
        requested = draw(st.integers(0, high + 2))  # 0 = max; outside the bounds gets clamped
        target = draw(st.floats(1.0, 1e8))
        jobs.append(
            JobInfo(
                job_id=f"j{k:02d}",
                model=model(draw(st.sampled_from(APPLICATIONS))),
                submit_time_s=draw(st.floats(0.0, time)),
                min_gpus=low,
                max_gpus=high,
                target_samples=target,
                samples_done=draw(st.floats(0.0, target)),
                requested_gpus=requested,
                attained_gpu_s=draw(st.sampled_from([0.0, 100.0, 3250.0, 6e4, 1e6])),
                restarts=draw(st.integers(0, 3)),
                dataset=draw(st.sampled_from(["", "d0", "d1"])),
                priority=draw(st.integers(0, 2)),
            )
        )
    if requests:
        jobs = [dataclasses.replace(job, cpus_per_rank=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 4.0])),
                                    memory_bytes_per_rank=draw(st.sampled_from([0, 0, 4 * 10**9, 20 * 10**9])))
                for job in jobs]
    # A current plan that never double-books.
    free = {node.name: list(range(node.gpus)) for node in nodes}
    if stale_current:
        free["lost"] = [0, 1, 2, 3]  # a node that left the cluster
    current: dict[str, Allocation] = {}
    holders = [job.job_id for job in jobs] + (["gone"] if stale_current else [])
    for job_id in holders:
        if not draw(st.booleans()):
            continue
        job = next((j for j in jobs if j.job_id == job_id), None)
        count = draw(st.integers(job.min_gpus, job.max_gpus)) if job else draw(st.integers(1, 4))
        placement: dict[str, list[int]] = {}
        for _ in range(count):
            choices = [name for name, left in free.items() if left]
            if not choices:
                break
            name = draw(st.sampled_from(choices))
            placement.setdefault(name, []).append(free[name].pop(0))
        if placement and sum(map(len, placement.values())) == count:
            current[job_id] = allocation(*placement.items())
    if stale_current and current and draw(st.booleans()):
        # A GPU index beyond a node's size (the node came back smaller).
        victim = draw(st.sampled_from(sorted(current)))
        node, indices = current[victim].placement[0]
        bumped = ((node, tuple(sorted(set(indices[:-1]) | {99}))),) + current[victim].placement[1:]
        current[victim] = Allocation(placement=bumped)
    cached = {
        (node.name, dataset): draw(st.sampled_from([0.0, 1e8, 1e10]))
        for node in nodes
        for dataset in ("d0", "d1")
        if draw(st.booleans())
    }
    return ClusterSnapshot(
        time_s=time,
        nodes=tuple(nodes),
        jobs=tuple(sorted(jobs, key=lambda j: (j.submit_time_s, j.job_id))),
        current=Plan(current),
        restart_cost_s=draw(st.sampled_from([0.0, 30.0, 100.0])),
        interval_s=draw(st.sampled_from([0.0, 60.0, 360.0])),
        cached_bytes=cached,
    )


# ---------------------------------------------------------------------------------------
# Fixtures (the same builders, for tests that prefer injection)
# ---------------------------------------------------------------------------------------


@pytest.fixture
def small_cluster() -> tuple[NodeInfo, ...]:
    """Two training nodes of 4 GPUs."""
    return make_nodes(2, 4)
