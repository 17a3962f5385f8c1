"""scheduler.data_grants.EpochStarts: which cached bytes a job cannot hit in its current epoch."""

from __future__ import annotations

from scheduler.data_grants import EpochStarts


def test_bytes_cached_during_the_epoch_are_fresh_until_the_next_one_begins():
    starts = EpochStarts()
    # Round 1: first sight, cold cache.
    assert starts.fresh({}, [("a", "ds", 0, ["n0"])]) == {}
    # Round 2: its misses filled 40 bytes in epoch 0: all fresh.
    assert starts.fresh({("n0", "ds"): 40.0}, [("a", "ds", 0, ["n0"])]) == {("a", "n0"): 40.0}
    # Round 3: epoch 1 began since round 2, somewhere after 40 bytes were there: what was there at
    # the last round counts as its start (never fewer fresh bytes than the truth), 60 - 40.
    assert starts.fresh({("n0", "ds"): 60.0}, [("a", "ds", 1, ["n0"])]) == {("a", "n0"): 20.0}
    # Round 4: same epoch, cache full at 100: 60 fresh (the epoch's start is kept).
    assert starts.fresh({("n0", "ds"): 100.0}, [("a", "ds", 1, ["n0"])]) == {("a", "n0"): 60.0}
    # Round 5: epoch 2, nothing added since round 4: all hits.
    assert starts.fresh({("n0", "ds"): 100.0}, [("a", "ds", 2, ["n0"])]) == {}


def test_a_job_new_on_a_node_counts_from_the_last_round_and_is_forgotten_when_gone():
    starts = EpochStarts()
    # Another reader left 70 bytes before "a" came: they are hits for "a" from its first read.
    assert starts.fresh({("n0", "ds"): 70.0}, []) == {}
    assert starts.fresh({("n0", "ds"): 70.0}, [("a", "ds", 0, ["n0"])]) == {}
    # Also on n1 now, which held 5 bytes at the last round: it may have read there since then.
    cached = {("n0", "ds"): 80.0, ("n1", "ds"): 25.0}
    assert starts.fresh(cached, [("a", "ds", 0, ["n0", "n1"])]) == {("a", "n0"): 10.0, ("a", "n1"): 25.0}
    # Evicted below the start on n0: what is left counts from here, nothing fresh.
    assert starts.fresh({("n0", "ds"): 50.0, ("n1", "ds"): 29.0}, [("a", "ds", 0, ["n0", "n1"])]) == {("a", "n1"): 29.0}
    assert starts.fresh({("n0", "ds"): 60.0}, [("a", "ds", 0, ["n0"])]) == {("a", "n0"): 10.0}
    # Paused (no nodes) mid-epoch, then back on n0 in the same epoch: still counted from its start.
    assert starts.fresh({("n0", "ds"): 60.0}, [("a", "ds", 0, [])]) == {}
    assert starts.fresh({("n0", "ds"): 70.0}, [("a", "ds", 0, ["n0"])]) == {("a", "n0"): 20.0}
    # Gone (finished): forgotten; a job of that id later counts from the round before.
    assert starts.fresh({("n0", "ds"): 70.0}, []) == {}
    assert starts.fresh({("n0", "ds"): 90.0}, [("a", "ds", 0, ["n0"])]) == {("a", "n0"): 20.0}
    # A job without a dataset reads nothing from a cache.
    assert starts.fresh({("n0", ""): 90.0}, [("b", "", 0, ["n0"])]) == {}


def test_grant_check_follows_the_plans_hints_to_what_the_whole_check_finds():
    """GrantCheck (the live planner's) sums cache quotas and remote IO plan after plan by the plans'
    hints, and lists exactly what problems() lists: every grant beyond a node's cache or the
    budget, quotas on unknown nodes, and nothing else."""
    import dataclasses
    import math
    import random

    from scheduler.data_grants import GrantCheck, problems
    from scheduler.policy import Allocation, ChangedSince, ClusterSnapshot, NodeInfo, Plan

    rng = random.Random(8)
    nodes = tuple(NodeInfo(f"n{k}", 4, cache_capacity_bytes=1000.0) for k in range(6))
    check = GrantCheck()
    allocations: dict[str, Allocation] = {}
    last: Plan | None = None
    how = []
    found = 0
    for step in range(400):
        for _ in range(rng.randint(1, 3)):
            job = f"j{rng.randrange(25)}"
            if rng.random() < 0.3:
                allocations.pop(job, None)
                continue
            node = rng.choice([n.name for n in nodes] + (["gone"] if rng.random() < 0.03 else []))
            odd = rng.random()
            rate = math.inf if odd < 0.02 else math.nan if odd < 0.03 else rng.choice([10.0, 25.0, 40.0])
            allocations[job] = Allocation(placement=((node, (0,)),), cache_bytes={node: rng.choice([0.0, 100.0, 180.0])},
                                          remote_io_bytes_per_s=rate)
        if step % 50 == 49:  # another node tuple (equal nodes): checked whole
            nodes = tuple(dataclasses.replace(n) for n in nodes)
        plan = Plan(dict(allocations))
        if last is not None and rng.random() < 0.9:
            entries = {j: plan.allocations.get(j) for j in last.allocations.keys() | plan.allocations.keys()
                       if last.allocations.get(j) is not plan.allocations.get(j)}
            plan = Plan(plan.allocations, changed=ChangedSince(last.allocations, plan.allocations, entries))
        snapshot = ClusterSnapshot(time_s=0.0, nodes=nodes, jobs=(), storage_bandwidth_bytes_per_s=700.0)
        expected = problems(snapshot, plan)
        assert check.problems(snapshot, plan) == expected, step
        how.append(check.last_check)
        found += bool(expected)
        last = plan
    assert how.count("changes") > 100 and found > 20, (how.count("changes"), found)
