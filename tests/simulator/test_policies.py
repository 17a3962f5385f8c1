"""Every registered policy on a small Pollux-derived workload: plans sound at every round, every job finishes."""

from __future__ import annotations

import math

import pytest

from scheduler.policy import ClusterSnapshot, Plan
from scheduler.registry import get_policy, policy_names
from simulator import Simulator, cluster_from_dict, load_workload, target_samples


class IndependentlyChecked:
    """Wraps a policy and checks its plans without scheduler.invariants (a second opinion)."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.rounds = 0

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        plan = self.inner.schedule(snapshot)
        self.rounds += 1
        jobs = {j.job_id: j for j in snapshot.jobs}
        gpus = {n.name: n.gpus for n in snapshot.nodes}
        held: dict[tuple[str, int], str] = {}
        for job_id, allocation in plan.allocations.items():
            assert job_id in jobs, f"t={snapshot.time_s}: plan for inactive job {job_id}"
            n = allocation.gpus
            if n:
                assert jobs[job_id].min_gpus <= n <= jobs[job_id].max_gpus, f"t={snapshot.time_s}: {job_id} gets {n} GPUs"
            for node, indices in allocation.placement:
                for index in indices:
                    assert 0 <= index < gpus[node], f"{job_id}: no GPU {node}:{index}"
                    assert (node, index) not in held, f"t={snapshot.time_s}: {node}:{index} given to {held.get((node, index))} and {job_id}"
                    held[(node, index)] = job_id
        return plan


@pytest.fixture(scope="module")
def small_workload():
    return load_workload("workload-6").head(20)


@pytest.mark.parametrize("name", policy_names())
def test_policy_plans_are_sound_and_every_job_finishes(name, small_workload):
    cluster = cluster_from_dict({"nodes": 4, "interval_s": 120})  # fewer rounds: the imagenet job runs ~14 h
    policy = IndependentlyChecked(get_policy(name))
    simulator = Simulator(small_workload, policy, cluster)
    result = simulator.run()
    assert result.plans_checked == result.rounds == policy.rounds > 0
    assert len(result.jobs) == 20
    by_name = {j.name: j for j in small_workload.jobs}
    for record in result.jobs:
        spec = by_name[record.name]
        assert math.isfinite(record.finish_s)
        assert record.arrival_s == spec.arrival_s <= record.start_s < record.finish_s
        assert record.jct_s == pytest.approx(record.finish_s - record.arrival_s)
        assert record.attained_gpu_s > 0 and record.mean_gpus <= cluster.total_gpus
        assert record.target_samples == target_samples(spec.application)
        # Nothing finishes faster than alone on the whole cluster would allow... roughly: not before
        # its first round plus the restart cost.
        assert record.finish_s >= record.start_s + cluster.restart_cost_s
