"""Node plans name a multi-node job's other nodes as the peers of its cache quota, so the cache
servers of its nodes serve each other's misses (cache_server/peers.py)."""

from __future__ import annotations

from scheduler.live import convert
from silod.v1 import common_pb2, plan_pb2


def test_a_quota_names_the_jobs_other_nodes_with_their_cache_addresses() -> None:
    plan = plan_pb2.AllocationPlan(version=3)
    job = plan.jobs.add(job_id="job-two-nodes", cache_policy="uniform")
    job.placements.add(node="n1", gpu_indices=[0])
    job.placements.add(node="n0", gpu_indices=[0, 1])
    job.cache_grants.add(node="n0", cache_quota_bytes=100)
    job.cache_grants.add(node="n1", cache_quota_bytes=50)
    job.cache_grants.add(node="n2", cache_quota_bytes=10)  # cache only, no GPU there: a peer all the same
    single = plan.jobs.add(job_id="job-one-node")
    single.placements.add(node="n0", gpu_indices=[2])
    single.cache_grants.add(node="n0", cache_quota_bytes=10)
    specs = {"job-two-nodes": common_pb2.JobSpec(dataset="ds")}
    caches = {"n0": "10.0.0.1:7002", "n1": "10.0.0.2:7002"}  # n2's unknown: the cache server looks it up

    view = convert.node_plan(plan, "n0", specs, {}, caches)
    quotas = {q.job_id: q for q in view.cache_quotas}
    assert [(p.node, p.cache_address) for p in quotas["job-two-nodes"].peers] == [("n1", "10.0.0.2:7002"),
                                                                                  ("n2", "")]
    assert list(quotas["job-one-node"].peers) == []
    on_n1 = convert.node_plan(plan, "n1", specs, {}, caches).cache_quotas[0]
    assert [(p.node, p.cache_address) for p in on_n1.peers] == [("n0", "10.0.0.1:7002"), ("n2", "")]
    # Callers that know no cache addresses (older call sites) still get the peers by name.
    assert [p.node for p in convert.node_plan(plan, "n0", specs, {}).cache_quotas[0].peers] == ["n1", "n2"]
