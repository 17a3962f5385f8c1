"""Cache quotas and IO rates on the live scheduler's plans, per --cache-mode (scheduler.live.data).

Nodes advertise a cache (disk + memory tiers) and a cache server address that answers
nothing (port 1): the scheduler must then treat the caches as cold, not wait or fail.
"""

from __future__ import annotations

import math

import pytest

from scheduler.live import convert
from silod.v1 import common_pb2, metadata_pb2, plan_pb2

DISK = 96 << 20
MEMORY = 32 << 20
CAPACITY = DISK + MEMORY
# bytes/s of remote reads for the whole cluster: below what 4 cold cifar10 jobs want at
# compute speed (~1300 samples/s of 64-160 KiB each), so IO rates compete
BUDGET = 150 << 20


def _add_cache_node(cluster, name: str, gpus: int = 2) -> None:
    cluster.md.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
        name=name, gpus=gpus, pool=common_pb2.NODE_POOL_TRAINING, gpu_model="emulated",
        agent_address=f"{name}.local:7000", cache_address="127.0.0.1:1",
        cache_capacity_bytes=DISK, memory_cache_bytes=MEMORY)))
    cluster.md.Heartbeat(metadata_pb2.HeartbeatRequest(node=name))


def _register(cluster, name: str, objects: int, size: int) -> None:
    spec = common_pb2.DatasetSpec(name=name, uri=f"file:///data/{name}")
    chunk = [common_pb2.DatasetObject(key=f"{i:06d}", size_bytes=size, etag=f"e{i}") for i in range(objects)]
    cluster.md.RegisterDataset(iter([metadata_pb2.RegisterDatasetRequest(spec=spec, objects=chunk)]))


def _setup(make_cluster, mode: str, **settings):
    cluster = make_cluster(cache_mode=mode, **settings)
    for node in ("n0", "n1"):
        _add_cache_node(cluster, node)
    # Two datasets, each larger than one node's cache, so quotas really compete.
    _register(cluster, "imgs", 3000, 64 << 10)   # 188 MiB
    _register(cluster, "text", 1000, 160 << 10)  # 156 MiB
    jobs = [cluster.submit(f"j{i}", 1, 1, dataset=("imgs", "text")[i % 2], epochs=5) for i in range(4)]
    plan = cluster.round()
    return cluster, plan, jobs


def _check_invariants(plan: plan_pb2.AllocationPlan, budget: float = math.inf) -> None:
    """What every plan must keep: quotas within each node's cache, IO within the budget,
    grants only where the job runs."""
    held: dict[str, int] = {}
    io = 0
    for job in plan.jobs:
        nodes = {p.node for p in job.placements if p.gpu_indices}
        for g in job.cache_grants:
            assert g.node in nodes, f"{job.job_id}: grant on {g.node}, placed on {sorted(nodes)}"
            held[g.node] = held.get(g.node, 0) + g.cache_quota_bytes
            io += g.remote_io_bytes_per_s
    for node, quota in held.items():
        assert quota <= CAPACITY, f"{node}: quotas {quota} > capacity {CAPACITY}"
    assert io <= budget, f"IO {io} > budget {budget}"


def _placed(plan):
    return [j for j in plan.jobs if any(p.gpu_indices for p in j.placements)]


def test_node_info_counts_both_tiers_only_with_a_cache_server():
    spec = common_pb2.NodeSpec(name="n", gpus=1, cache_capacity_bytes=DISK, memory_cache_bytes=MEMORY)
    assert convert.node_info(common_pb2.Node(spec=spec)).cache_capacity_bytes == 0.0
    spec.cache_address = "h:1"
    assert convert.node_info(common_pb2.Node(spec=spec)).cache_capacity_bytes == CAPACITY


def test_silod_grants_quotas_and_io_within_capacity_and_budget(make_cluster):
    cluster, plan, jobs = _setup(make_cluster, "silod", storage_bandwidth_bytes_per_s=BUDGET)
    placed = _placed(plan)
    assert placed, "a cold start with a tight budget still runs jobs"
    assert plan.cache_mode == "silod" and plan.storage_bandwidth_budget_bytes_per_s == BUDGET
    _check_invariants(plan, BUDGET)
    for job in placed:
        assert job.cache_policy == "uniform"
        assert len(job.cache_grants) == 1, "one grant per node the job runs on"
    quotas = sum(g.cache_quota_bytes for j in placed for g in j.cache_grants)
    rates = [sum(g.remote_io_bytes_per_s for g in j.cache_grants) for j in placed]
    nodes_used = {g.node for j in placed for g in j.cache_grants}
    assert quotas > 0.9 * len(nodes_used) * CAPACITY, "the datasets exceed the caches: co_allocate fills them"
    assert 0 < sum(rates) <= BUDGET
    # The node plans carry exactly the plan's grants to the cache servers.
    for node in nodes_used:
        view = convert.node_plan(plan, node, cluster.core.specs, cluster.core.agent_addresses)
        want = {(j.job_id, g.cache_quota_bytes, g.remote_io_bytes_per_s) for j in placed for g in j.cache_grants if g.node == node}
        got = {(q.job_id, q.cache_quota_bytes, q.remote_io_bytes_per_s) for q in view.cache_quotas}
        assert got == want and got
        assert {q.dataset for q in view.cache_quotas} <= {"imgs", "text"}


def test_silod_without_budget_leaves_io_unmanaged(make_cluster):
    _, plan, _ = _setup(make_cluster, "silod")
    _check_invariants(plan)
    placed = _placed(plan)
    assert all(g.remote_io_bytes_per_s == 0 for j in placed for g in j.cache_grants)  # 0 = unlimited
    assert sum(g.cache_quota_bytes for j in placed for g in j.cache_grants) > 0


def test_static_splits_each_nodes_cache_equally(make_cluster):
    _, plan, _ = _setup(make_cluster, "static", storage_bandwidth_bytes_per_s=BUDGET)
    _check_invariants(plan)
    assert plan.storage_bandwidth_budget_bytes_per_s == 0, "only silod manages IO"
    by_node: dict[str, list[int]] = {}
    for job in _placed(plan):
        assert job.cache_policy == "uniform"
        for g in job.cache_grants:
            by_node.setdefault(g.node, []).append(g.cache_quota_bytes)
            assert g.remote_io_bytes_per_s == 0
    for node, quotas in by_node.items():
        assert quotas == [CAPACITY // len(quotas)] * len(quotas), node


@pytest.mark.parametrize("mode", ["lru", "none"])
def test_lru_and_none_send_policy_without_quota(make_cluster, mode):
    cluster, plan, _ = _setup(make_cluster, mode)
    placed = _placed(plan)
    assert placed
    for job in placed:
        assert job.cache_policy == mode
        assert [g.cache_quota_bytes for g in job.cache_grants] == [0] and job.cache_grants[0].remote_io_bytes_per_s == 0
    # The cache servers learn the policy: each node plan names every job placed there.
    for node in ("n0", "n1"):
        view = convert.node_plan(plan, node, cluster.core.specs, cluster.core.agent_addresses)
        on_node = {j.job_id for j in placed if any(p.node == node for p in j.placements)}
        assert {q.job_id for q in view.cache_quotas} == on_node
        assert {q.cache_policy for q in view.cache_quotas} <= {mode}


def test_jobs_without_dataset_get_no_grants(make_cluster):
    cluster = make_cluster(cache_mode="silod", storage_bandwidth_bytes_per_s=BUDGET)
    _add_cache_node(cluster, "n0")
    job = cluster.submit("plain", 1, 1)
    plan = cluster.round()
    entry = next(j for j in plan.jobs if j.job_id == job.id)
    assert entry.placements and not entry.cache_grants and entry.cache_policy == ""


def test_silod_shares_spare_budget_among_readers():
    """co_allocate grants each job its modelled demand b*; the live scheduler hands what is left
    of the budget to the readers, so a job whose (fitted) model underrates it is not held at b*."""
    from estimator.job_model import JobModel
    from scheduler.live import data
    from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo, Plan

    model = JobModel.from_profile("cifar10").with_dataset(1e9, 1000.0)  # ~1.3 MB/s of demand per job
    nodes = (NodeInfo("n0", 2, cache_capacity_bytes=1e8), NodeInfo("n1", 2, cache_capacity_bytes=1e8))
    jobs = tuple(JobInfo(job_id=f"j{i}", model=model, submit_time_s=0, min_gpus=1, max_gpus=1, target_samples=1e6,
                         dataset="d", batch_size=128) for i in range(3))
    jobs += (JobInfo(job_id="plain", model=model, submit_time_s=0, min_gpus=1, max_gpus=1, target_samples=1e6),)
    budget = 100e6
    snap = ClusterSnapshot(time_s=0, nodes=nodes, jobs=jobs, storage_bandwidth_bytes_per_s=budget)
    placements = {"j0": (("n0", (0,)),), "j1": (("n0", (1,)),), "j2": (("n1", (0,)),), "plain": (("n1", (1,)),)}
    plan = Plan({j: Allocation(placement=p) for j, p in placements.items()})
    granted = data.grant("silod", snap, plan, plan, set(placements), policy_co_designs=False)
    rates = {j: a.remote_io_bytes_per_s for j, a in granted.allocations.items()}
    readers = [rates[j] for j in ("j0", "j1", "j2")]
    assert sum(readers) == pytest.approx(budget, rel=1e-9)
    assert max(readers) - min(readers) < 0.05 * budget, "the spare is shared equally"
    assert not data.problems(snap, granted)
    assert granted.get("plain").cache_bytes == {}  # reads no dataset: nothing cached for it


def test_io_bound_measurements_are_not_fitted_as_compute():
    """A job reading at its IO grant measures the grant: Observe must not fit it as compute speed."""
    from estimator.job_model import JobModel
    from scheduler.live.core import SchedulerCore
    from silod.v1 import allocation_pb2

    core = SchedulerCore(None, policy="fifo", interval_s=60, restart_cost_s=1, node_timeout_s=10,
                         cache_mode="silod", storage_bandwidth_bytes_per_s=4e6)
    job = common_pb2.Job(id="job-000000000001", spec=common_pb2.JobSpec(dataset="d"))
    core.models.profiles[job.id] = (JobModel.from_profile("cifar10").with_dataset(1e7, 32768.0), 1e4)
    entry = plan_pb2.JobAllocation(job_id=job.id)
    entry.cache_grants.add(node="n0", cache_quota_bytes=0, remote_io_bytes_per_s=1_000_000)

    def report(hit_ratio: float) -> allocation_pb2.TaskReport:
        return allocation_pb2.TaskReport(progress=common_pb2.JobProgress(cache_hit_ratio=hit_ratio))

    # 30 samples/s of 32 KiB, all misses: 0.98 MB/s of a 1 MB/s grant -> IO-bound
    assert core.feedback.io_bound(job, entry, report(0.0), 30.0)
    # the same rate with 90 % hits uses a tenth of the grant: the GPU (compute) is the limit
    assert not core.feedback.io_bound(job, entry, report(0.9), 30.0)
    # half of it hits: its reads at the grant take half of each step (a slow step of a job
    # waiting for data, e.g. under CPU contention, is not fitted as compute)
    assert core.feedback.io_bound(job, entry, report(0.5), 30.0)
    # no grant under a managed budget: the cache server trickles the misses
    bare = plan_pb2.JobAllocation(job_id=job.id)
    bare.cache_grants.add(node="n0", cache_quota_bytes=1 << 20, remote_io_bytes_per_s=0)
    assert core.feedback.io_bound(job, bare, report(0.0), 1.0)
    # other modes do not manage IO: every measurement is fitted as before
    core.feedback.cache_mode = "lru"
    assert not core.feedback.io_bound(job, entry, report(0.0), 30.0)


def test_silod_does_not_start_a_job_granted_no_io():
    """Several jobs arriving in one round, a budget far below each one's demand: without_starved
    keeps the all-starved plan, srpt gives the budget to one job; the others would sit on GPUs
    reading nothing, so they stay queued (as in the simulator, where they arrive in separate
    rounds). A job already running keeps its GPUs even with 0."""
    from estimator.job_model import JobModel
    from scheduler.live import data
    from scheduler.policies.fifo import FifoPolicy
    from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo, Plan

    model = JobModel.from_profile("cifar10").with_dataset(160 * 131072.0, 131072.0)  # ~150 MB/s of demand each
    nodes = (NodeInfo("n0", 2, cache_capacity_bytes=8 << 20), NodeInfo("n1", 2, cache_capacity_bytes=8 << 20))
    jobs = tuple(JobInfo(job_id=f"j{i}", model=model, submit_time_s=i * 0.01, min_gpus=1, max_gpus=1, target_samples=640,
                         dataset=("a", "b")[i % 2], batch_size=128) for i in range(6))
    snap = ClusterSnapshot(time_s=0, nodes=nodes, jobs=jobs, storage_bandwidth_bytes_per_s=4e6)
    policy_plan = FifoPolicy(codesign=True).schedule(snap)
    assert len(policy_plan.allocations) == 4  # all starved: the policy places them all
    granted = data.grant("silod", snap, policy_plan, policy_plan, {j.job_id for j in jobs}, policy_co_designs=True)
    assert list(granted.allocations) == ["j0"]
    assert granted.get("j0").remote_io_bytes_per_s == pytest.approx(4e6)
    assert granted.get("j0").cache_bytes  # the freed node's quota is not left on a dropped job
    assert not data.problems(snap, granted)
    # j1 already runs: it keeps its GPUs with 0 (its cache server holds its misses).
    running = ClusterSnapshot(time_s=0, nodes=nodes, jobs=jobs, storage_bandwidth_bytes_per_s=4e6,
                              current=Plan({"j0": policy_plan.get("j0"), "j1": Allocation(placement=policy_plan.get("j1").placement)}))
    plan = Plan({j: policy_plan.get(j) for j in ("j0", "j1", "j2")})
    granted = data.grant("silod", running, plan, plan, {j.job_id for j in jobs}, policy_co_designs=False)
    assert sorted(granted.allocations) == ["j0", "j1"]
    assert sum(a.remote_io_bytes_per_s for a in granted.allocations.values()) <= 4e6 * (1 + 1e-9)


def test_silod_snapshot_tells_bytes_cached_in_the_current_epoch_apart(make_cluster):
    """The live snapshot's fresh_bytes: what a job's node cached since the job's current epoch
    began (its reported epochs_done), from the cache servers' Stats, round by round
    (scheduler.data_grants.EpochStarts, as the simulator keeps them)."""
    cluster = make_cluster(cache_mode="silod", storage_bandwidth_bytes_per_s=BUDGET)
    for node in ("n0", "n1"):
        _add_cache_node(cluster, node)
    _register(cluster, "imgs", 3000, 64 << 10)
    job = cluster.submit("j0", 1, 1, dataset="imgs", epochs=5)
    plan = cluster.round()
    node = next(p.node for j in plan.jobs if j.job_id == job.id for p in j.placements if p.gpu_indices)

    class Probe:  # what the node's cache server reports, set by the test
        held = 0.0

        async def cached_bytes(self, nodes):
            return {(node, "imgs"): Probe.held}

        async def close(self):
            pass

    cluster.core.cached = Probe()

    def fresh(held: float, epochs: int) -> dict:
        Probe.held = held
        progress = common_pb2.JobProgress(epochs_done=epochs)
        # As a rank's report does: stored, and kept by the scheduler (scheduler.live.jobs).
        cluster.md.UpdateJobProgress(metadata_pb2.UpdateJobProgressRequest(job_id=job.id, progress=progress))
        cluster.core.jobs.reported(job.id, progress)
        snap, _ = cluster.scheduler.submit(cluster.core.snapshot())
        assert snap.cached_bytes == {(node, "imgs"): held}
        return dict(snap.fresh_bytes)

    assert fresh(10e6, 0) == {(job.id, node): 10e6}  # cached while it read its first epoch: none a hit yet
    assert fresh(30e6, 0) == {(job.id, node): 30e6}
    assert fresh(40e6, 1) == {(job.id, node): 10e6}  # epoch 1 began after the last round's 30 MB
    assert fresh(40e6, 2) == {}                      # a whole epoch on the same content: all hits
