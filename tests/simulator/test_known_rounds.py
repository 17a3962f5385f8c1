"""Rounds whose plan a policy promised (scheduler.steady) are counted, not run, and nothing else changes.

With ``verify_known_rounds`` the engine runs every promised round anyway and fails if its plan is
not the plan in force; without skipping it runs every round as it always did. Both give the same
jobs, to the bit, as the run that leaves the promised rounds out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator import Simulator, SimulationStuck, cluster_from_dict, load_cluster, load_workload
from simulator.workload import JobSpec

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("fifo", "sjf", "tiresias", "themis", "gavel", "pollux", "deepboot")


def run(workload, policy, cluster=None, **options):
    return Simulator(workload, policy, cluster or load_cluster(None), **options).run()


@pytest.mark.parametrize("policy", POLICIES)
def test_promised_rounds_return_the_plan_in_force_and_change_nothing(policy):
    workload = load_workload("workload-6").head(80)
    skipped = run(workload, policy)
    verified = run(workload, policy, verify_known_rounds=True)
    every = run(workload, policy, skip_known_rounds=False)
    assert skipped.jobs == verified.jobs == every.jobs
    assert skipped.rounds == verified.rounds == every.rounds
    assert every.rounds_computed == every.rounds
    assert skipped.rounds_computed < skipped.rounds
    assert skipped.events < every.events  # the clock jumps over the promised rounds


def test_deepboot_with_inference_keeps_its_promises():
    workload = load_workload("workloads-deepboot/workload-6-diurnal").head(60)
    cluster = load_cluster(ROOT / "simulator/clusters/deepboot-half-inference.yaml")
    skipped = run(workload, "deepboot", cluster)
    verified = run(workload, "deepboot", cluster, verify_known_rounds=True)
    assert skipped.jobs == verified.jobs and skipped.inference == verified.inference
    assert skipped.rounds_computed < skipped.rounds


def test_every_round_runs_with_quotas_or_a_round_observer():
    workload = load_workload("workload-6").head(30)
    seen = []
    result = run(workload, "fifo", on_round=lambda snapshot, plan: seen.append(snapshot.time_s))
    assert result.rounds_computed == result.rounds == len(seen)


def test_a_stuck_run_is_still_caught_while_its_plan_is_promised():
    # A job for GPUs the cluster does not have: fifo never places it, and promises so (for ever).
    stranded = JobSpec("stranded", "cifar10", 0.0, 1, 128, gpu_types=("a100",))
    cluster = cluster_from_dict({"nodes": 2, "gpus_per_node": 4, "gpu_type": "v100", "stall_timeout_s": 3600})
    with pytest.raises(SimulationStuck, match="stranded"):
        run([stranded], "fifo", cluster)
