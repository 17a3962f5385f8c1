"""co.spread_for_cache: a new job whose dataset exceeds one node's cache is spread over more
nodes when remote IO is limited (docs/evaluation.md, "A Philly workload that reads its data")."""

from __future__ import annotations

import math

from scheduler import codesign as co
from scheduler.invariants import check_plan
from scheduler.registry import get_policy
from tests.scheduler.conftest import make_job, make_nodes, make_snapshot, model

GB = 1e9


def _snapshot(budget: float = 40e6, cache: float = 32 * GB, dataset_gb: float = 146.0, current=None):
    nodes = make_nodes(4, 4, prefix="node-0", cache_capacity_bytes=cache)
    big = model("imagenet").with_dataset(dataset_gb * GB, 114_000)
    jobs = [make_job("big", model=big, dataset="big", gpus=8, min_gpus=8, max_gpus=8)]
    return make_snapshot(nodes, jobs, storage_bandwidth_bytes_per_s=budget, current=current)


PACKED = {"big": (("node-00", (0, 1, 2, 3)), ("node-01", (0, 1, 2, 3)))}


def _nodes_of(placement):
    return {node for node, ix in placement if ix}


def test_a_big_dataset_is_spread_over_the_nodes_it_needs_gpus_dealt_round_robin():
    snap = _snapshot()
    out = co.spread_for_cache(snap, PACKED, ["big"])
    # ceil(146 / 32) = 5 nodes wanted, 4 exist: 2 GPUs on each, 128 GB of cache instead of 64.
    assert out["big"] == tuple((f"node-0{k}", (0, 1)) for k in range(4))
    plan = co.co_allocate(snap, out, ["big"])
    check_plan(snap, plan)
    assert plan.get("big").total_cache_bytes == 128 * GB


def test_no_spread_without_an_io_limit_without_cache_for_small_datasets_or_in_place():
    assert co.spread_for_cache(_snapshot(budget=math.inf), PACKED, ["big"]) == PACKED
    assert co.spread_for_cache(_snapshot(cache=0.0), PACKED, ["big"]) == PACKED
    assert co.spread_for_cache(_snapshot(dataset_gb=20.0), PACKED, ["big"]) == PACKED
    running = _snapshot(current=PACKED)
    assert co.spread_for_cache(running, PACKED, ["big"]) == PACKED  # a move would cost a restart


def test_spread_uses_only_free_gpus():
    snap = _snapshot()
    others = {"a": (("node-02", (0, 1, 2)),), "b": (("node-03", (0, 1, 2, 3)),)}
    out = co.spread_for_cache(snap, {**PACKED, **others}, ["big", "a", "b"])
    # node-03 is full, node-02 has one free GPU: 3 nodes (4 + 3 + 1 would not deal evenly; 4, 3, 1)
    assert _nodes_of(out["big"]) == {"node-00", "node-01", "node-02"}
    assert sum(len(ix) for _, ix in out["big"]) == 8
    assert dict(out["big"])["node-02"] == (3,)
    assert out["a"] == others["a"] and out["b"] == others["b"]


def test_sjf_with_codesign_spreads_the_big_job_and_the_plan_is_valid():
    snap = _snapshot()
    plan = get_policy("sjf", codesign=True).schedule(snap)
    check_plan(snap, plan)
    assert len(_nodes_of(plan.get("big").placement)) == 4
    gpu_only = get_policy("sjf").schedule(snap)
    assert len(_nodes_of(gpu_only.get("big").placement)) == 2
