"""gavel's promise across departures (scheduler.policies.gavel_fits): on a cluster with room for every
job's best candidate, rounds after a job leaves are known, and running them gives the same plans."""

from __future__ import annotations

from scheduler.policies.gavel import GavelPolicy
from simulator import Simulator, cluster_from_dict, load_workload


def test_gavel_keeps_its_plan_across_departures_on_a_roomy_cluster(monkeypatch):
    workload = load_workload("workload-6").head(60)
    cluster = cluster_from_dict({"nodes": 32, "gpus_per_node": 8})
    promises = []
    stable_until = GavelPolicy.stable_until

    def watched(policy, snapshot, plan):
        promises.append(stable_until(policy, snapshot, plan))
        return promises[-1]

    monkeypatch.setattr(GavelPolicy, "stable_until", watched)
    skipped = Simulator(workload, "gavel", cluster, check_invariants=True).run()
    assert any(p.departures for p in promises)
    verified = Simulator(workload, "gavel", cluster, check_invariants=True, verify_known_rounds=True).run()
    every = Simulator(workload, "gavel", cluster, skip_known_rounds=False).run()
    assert skipped.jobs == verified.jobs == every.jobs
    assert skipped.rounds == verified.rounds == every.rounds
    assert skipped.rounds_computed < every.rounds_computed
