"""Shared placement: keeps running jobs in place, packs, prefers cached nodes, never double-books."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scheduler.placement import FreeGpus, place, plan_from_placements
from scheduler.policy import Allocation, NodeInfo
from tests.scheduler.conftest import allocation, make_job, make_nodes, make_snapshot, snapshots


def gpus_of(placement) -> int:
    return sum(len(indices) for _, indices in placement)


def test_running_job_keeps_its_gpus_even_when_placed_after_others():
    nodes = make_nodes(2, 4)
    jobs = [make_job("new", gpus=4, submit=1), make_job("old", gpus=2)]
    snap = make_snapshot(nodes, jobs, current={"old": [("n0", (1, 2))]})
    result = place(snap, {"new": 4, "old": 2}, order=["new", "old"])
    assert result.placements["old"] == (("n0", (1, 2)),)
    assert result.placements["new"] == (("n1", (0, 1, 2, 3)),)
    assert result.unplaced == ()


def test_shrinking_job_keeps_a_subset_on_the_fewest_nodes():
    nodes = make_nodes(3, 4)
    snap = make_snapshot(nodes, [make_job("j", gpus=3, min_gpus=1, max_gpus=8)], current={"j": [("n0", (0,)), ("n1", (0, 1, 2)), ("n2", (3,))]})
    result = place(snap, {"j": 3})
    assert result.placements["j"] == (("n1", (0, 1, 2)),)
    result = place(snap, {"j": 4})
    assert gpus_of(result.placements["j"]) == 4 and dict(result.placements["j"])["n1"] == (0, 1, 2)


def test_job_on_a_lost_node_is_moved():
    snap = make_snapshot(make_nodes(1, 4), [make_job("j", gpus=2)], current={"j": [("gone", (0, 1))]})
    assert place(snap, {"j": 2}).placements["j"] == (("n0", (0, 1)),)


def test_a_malformed_current_placement_is_replaced_not_trusted():
    twice = Allocation(placement=(("n0", (0,)), ("n0", (0,))))
    snap = make_snapshot(make_nodes(1, 4), [make_job("j", gpus=2)], current={"j": twice})
    assert place(snap, {"j": 2}).placements["j"] == (("n0", (0, 1)),)


def test_single_node_job_takes_the_tightest_hole():
    nodes = (NodeInfo("a", 8), NodeInfo("b", 4), NodeInfo("c", 8))
    jobs = [make_job("x", gpus=6), make_job("y", gpus=2, submit=1)]
    snap = make_snapshot(nodes, jobs, current={"x": [("c", range(6))]})
    # free: a 8, b 4, c 2 -> the 2-GPU job fills c's hole and leaves a and b whole.
    assert place(snap, {"x": 6, "y": 2}).placements["y"] == (("c", (6, 7)),)


def test_multi_node_job_uses_fewest_nodes_and_the_tightest_last_node():
    nodes = (NodeInfo("a", 8), NodeInfo("b", 8), NodeInfo("c", 4), NodeInfo("d", 2))
    snap = make_snapshot(nodes, [make_job("big", gpus=10)])
    placement = place(snap, {"big": 10}).placements["big"]
    assert len(placement) == 2
    assert dict(placement) == {"a": tuple(range(8)), "d": (0, 1)}  # b stays whole
    placement = place(snap, {"big": 20}).placements["big"]
    assert dict(placement) == {"a": tuple(range(8)), "b": tuple(range(8)), "c": (0, 1, 2, 3)}


def test_prefers_nodes_caching_the_jobs_dataset():
    nodes = make_nodes(3, 4)
    job = make_job("j", gpus=2, dataset="imagenet")
    cached = {("n2", "imagenet"): 5e10, ("n1", "other"): 1e12}
    snap = make_snapshot(nodes, [job], cached_bytes=cached)
    assert place(snap, {"j": 2}).placements["j"] == (("n2", (0, 1)),)
    # Across nodes: among equally free nodes, the cached ones come first.
    snap = make_snapshot(nodes, [make_job("j", gpus=8, dataset="imagenet")], cached_bytes={("n2", "imagenet"): 1.0, ("n1", "imagenet"): 2.0})
    assert [node for node, _ in place(snap, {"j": 8}).placements["j"]] == ["n1", "n2"]
    # No dataset: cache is ignored, the first name wins among equals.
    snap = make_snapshot(nodes, [make_job("j", gpus=2)], cached_bytes=cached)
    assert place(snap, {"j": 2}).placements["j"] == (("n0", (0, 1)),)


def test_inference_nodes_only_when_asked():
    nodes = make_nodes(1, 2) + make_nodes(1, 4, pool="inference")
    snap = make_snapshot(nodes, [make_job("j", gpus=4)])
    assert place(snap, {"j": 4}).unplaced == ("j",)
    assert place(snap, {"j": 4}, pools=("training", "inference")).placements["j"] == (("i0", (0, 1, 2, 3)),)


def test_order_decides_who_fits_and_the_rest_are_unplaced():
    snap = make_snapshot(make_nodes(1, 4), [make_job("a", gpus=3), make_job("b", gpus=2), make_job("c", gpus=1)])
    result = place(snap, {"a": 3, "b": 2, "c": 1}, order=["b", "a", "c"])
    assert set(result.placements) == {"b", "c"} and result.unplaced == ("a",)


def test_jobs_missing_from_order_are_still_placed():
    snap = make_snapshot(make_nodes(1, 4), [make_job("a", gpus=1), make_job("b", gpus=1)])
    result = place(snap, {"a": 1, "b": 1}, order=["b"])
    assert set(result.placements) == {"a", "b"}


def test_zero_counts_are_ignored_and_plan_from_placements_sets_batches():
    snap = make_snapshot(make_nodes(1, 4), [make_job("a", gpus=1), make_job("b", gpus=1)], current={"b": [("n0", (0,))]})
    result = place(snap, {"a": 1, "b": 0})
    assert set(result.placements) == {"a"} and result.placements["a"] == (("n0", (0,)),)
    plan = plan_from_placements(result.placements, {"a": 256})
    assert plan.get("a").batch_size == 256 and plan.get("a").gpus == 1 and plan.get("b") is None


def test_free_gpus_refuses_to_hand_out_a_gpu_twice():
    free = FreeGpus(make_snapshot(make_nodes(1, 2) + make_nodes(1, 2, pool="inference"), []))
    assert free.total == 2 and free.nodes() == ["n0"]
    assert free.reserve("n0", [1]) == (1,)
    assert not free.has("n0", [1]) and free.has("n0", [0])
    with pytest.raises(ValueError):
        free.reserve("n0", [1])


@st.composite
def placement_cases(draw):
    snap = draw(snapshots(max_nodes=6, max_jobs=12))
    counts = {job.job_id: draw(st.sampled_from([0, job.min_gpus, job.requested, job.max_gpus])) for job in snap.jobs}
    order = draw(st.permutations([job.job_id for job in snap.jobs]))
    return snap, counts, list(order)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placement_cases(), st.booleans())
def test_random_placements_never_double_book(case, lend):
    snap, counts, order = case
    pools = ("training", "inference") if lend else ("training",)
    result = place(snap, counts, order, pools=pools)
    sizes = {n.name: n.gpus for n in snap.nodes if n.pool in pools}
    taken: set[tuple[str, int]] = set()
    for job_id, placement in result.placements.items():
        assert gpus_of(placement) == counts[job_id]
        assert [node for node, _ in placement] == sorted(node for node, _ in placement)
        for node, indices in placement:
            assert indices and node in sizes
            for index in indices:
                assert 0 <= index < sizes[node]
                assert (node, index) not in taken
                taken.add((node, index))
    wanted = {job_id for job_id, n in counts.items() if n > 0}
    assert set(result.placements) | set(result.unplaced) == wanted
    assert not set(result.placements) & set(result.unplaced)
    if sum(counts.values()) <= sum(sizes.values()):
        assert result.unplaced == ()  # any set of counts that fits the pool places (jobs may span nodes)
    # A job keeping its count whose current GPUs are valid and contested by no other job stays put.
    holders: dict[tuple[str, int], int] = {}
    for a in snap.current.allocations.values():
        for node, indices in a.placement:
            for index in indices:
                holders[(node, index)] = holders.get((node, index), 0) + 1
    for job_id, count in counts.items():
        current = snap.current.get(job_id)
        if not count or current is None or current.gpus != count:
            continue
        valid = all(node in sizes and all(0 <= i < sizes[node] and holders[(node, i)] == 1 for i in idx) for node, idx in current.placement)
        if valid:
            assert result.placements[job_id] == current.placement


def test_placement_is_deterministic():
    snap = make_snapshot(make_nodes(4, 4), [make_job(f"j{k}", gpus=k % 3 + 1, dataset="d") for k in range(6)], cached_bytes={("n3", "d"): 1.0})
    counts = {job.job_id: job.requested for job in snap.jobs}
    assert place(snap, counts) == place(snap, counts)
    assert allocation(("n1", [2, 0])).placement == (("n1", (0, 2)),)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=8), st.lists(st.tuples(st.integers(0, 7), st.integers(1, 8)), max_size=12), st.integers(1, 9))
def test_tightest_matches_a_brute_force_scan(sizes, takes, count):
    nodes = tuple(NodeInfo(f"n{k}", gpus) for k, gpus in enumerate(sizes))
    free = FreeGpus(make_snapshot(nodes, []))
    for node, n in takes:
        name = f"n{node % len(sizes)}"
        free.reserve_any(name, min(n, free.count(name)))
    assert free.total == sum(free.count(n.name) for n in nodes)
    holding = [n.name for n in nodes if free.count(n.name) >= count]
    expected = min(holding, key=lambda n: (free.count(n), n)) if holding else None
    assert free.tightest(count) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=8), st.lists(st.tuples(st.integers(0, 7), st.integers(1, 8)), max_size=12))
def test_widest_matches_a_brute_force_scan(sizes, takes):
    nodes = tuple(NodeInfo(f"n{k}", gpus) for k, gpus in enumerate(sizes))
    free = FreeGpus(make_snapshot(nodes, []))
    for node, n in takes:
        name = f"n{node % len(sizes)}"
        free.reserve_any(name, min(n, free.count(name)))
    holding = [n.name for n in nodes if free.count(n.name)]
    assert free.widest() == (min(holding, key=lambda n: (-free.count(n), n)) if holding else None)


def _spread_by_sorting(count: int, free: FreeGpus) -> tuple:
    """A multi-node fresh placement as a sort of every node with a free GPU lays it out: the
    largest holes until the rest fits on one node, then the tightest node that holds the rest."""
    sizes = free.counts()
    ranked = sorted(sizes, key=lambda n: (-sizes[n], n))
    chosen, remaining = [], count
    for position, node in enumerate(ranked):
        if sizes[node] >= remaining:
            last = min((n for n in ranked[position:] if sizes[n] >= remaining), key=lambda n: (sizes[n], n))
            chosen.append((last, free.reserve_any(last, remaining)))
            break
        chosen.append((node, free.reserve_any(node, sizes[node])))
        remaining -= sizes[node]
    return tuple(sorted(chosen))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=2, max_size=12), st.lists(st.tuples(st.integers(0, 11), st.integers(1, 8)), max_size=20),
       st.integers(2, 24))
def test_a_job_spread_over_nodes_gets_what_a_sort_of_every_node_gives(sizes, takes, count):
    """fresh_placement asks the free view for the widest and tightest nodes instead of sorting
    every node with a free GPU for each job; the placement is the same."""
    from scheduler.placement import fresh_placement

    nodes = tuple(NodeInfo(f"n{k:02d}", gpus) for k, gpus in enumerate(sizes))
    free = FreeGpus(make_snapshot(nodes, []))
    for node, n in takes:
        name = f"n{node % len(sizes):02d}"
        free.reserve_any(name, min(n, free.count(name)))
    assume(free.total >= count and free.tightest(count) is None)  # spread: no one node holds it, all of them do
    expected, reference = free.copy(), free.copy()
    placement = fresh_placement(make_job("j", gpus=count), count, free, {})
    assert placement == _spread_by_sorting(count, reference)
    assert free.total == reference.total == expected.total - count
