"""gavel on typed clusters: effective throughput per type, max-min and makespan objectives, type-blind baseline."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from estimator.gpu_types import on_type, typed_models
from scheduler.policies.gavel import GavelPolicy
from tests.scheduler.conftest import assert_sound, make_job, make_nodes, make_snapshot, model


def typed(nodes, gpu_type):
    return tuple(dataclasses.replace(n, gpu_type=gpu_type) for n in nodes)


NODES = typed(make_nodes(1, 4, prefix="k"), "k80") + typed(make_nodes(1, 4, prefix="v"), "v100")


def tjob(job_id, application, **fields):
    return make_job(job_id, application, type_models=typed_models(model(application), ["k80", "v100"]), **fields)


def job_types(snapshot, plan):
    return {j: {snapshot.node(n).gpu_type for n, _ in a.placement} for j, a in plan.allocations.items()}


def test_each_job_gets_the_type_it_gains_most_on():
    # imagenet runs 7x faster on a V100 than a K80; Gavel's recommendation model runs faster on the K80.
    snap = make_snapshot(NODES, [tjob("resnet", "imagenet", gpus=4), tjob("rec", "ncf", gpus=4)])
    plan = GavelPolicy().schedule(snap)
    assert_sound(snap, plan, rigid=True)
    assert job_types(snap, plan) == {"resnet": {"v100"}, "rec": {"k80"}}
    assert {a.gpu_type for a in plan.allocations.values()} == {"k80", "v100"}


def test_heterogeneity_aware_max_min_lifts_every_job_above_its_equal_share():
    # "a" runs 4x faster on a V100 than on a K80; "b" 1.2x faster on the K80 (like Gavel's
    # recommendation model). The equal share (half of each type's time for each) is beaten for
    # both by giving "a" the V100 and "b" the K80: max-min over effective throughput finds it.
    base = model("cifar10")
    a = make_job("a", model=base, type_models={"k80": on_type(base, "k80", 0.25), "v100": base})
    b = make_job("b", model=base, type_models={"k80": on_type(base, "k80", 1.2), "v100": base})
    nodes = typed(make_nodes(1, 1, prefix="k"), "k80") + typed(make_nodes(1, 1, prefix="v"), "v100")
    snap = make_snapshot(nodes, [a, b])
    aware = GavelPolicy().solve(snap)
    by_type = {(aware.jobs[aware.job[c]].job_id, aware.type_of(c)): aware.fraction[c] for c in range(aware.job.size)}
    assert by_type[("a", "v100")] == pytest.approx(1, abs=1e-4) and by_type[("b", "k80")] == pytest.approx(1, abs=1e-4)
    assert aware.level == pytest.approx(1.2 / 1.1, rel=1e-3)  # b: 1.2 over its equal share 0.5 x 1.2 + 0.5 x 1
    plan = GavelPolicy().schedule(snap)
    assert job_types(snap, plan) == {"a": {"v100"}, "b": {"k80"}}
    # Type-blind, the LP sees one pool of 2 GPUs priced at the reference speed.
    blind = GavelPolicy(heterogeneity_aware=False).solve(snap)
    assert blind.types == ("",) and blind.gpus.tolist() == [1, 1]
    on_v100 = next(aware.throughput[c] for c in range(aware.job.size) if aware.type_of(c) == "v100")
    assert blind.throughput[0] == blind.throughput[1] == pytest.approx(on_v100)


def test_makespan_objective_gives_more_to_the_job_with_more_work():
    snap = make_snapshot(NODES, [tjob("long", "cifar10", gpus=4, remaining=4e6), tjob("short", "cifar10", gpus=4, remaining=1e6)])
    solved = GavelPolicy(objective="makespan", elastic=False).solve(snap)
    on_v100 = {j.job_id: sum(solved.fraction[c] for c in range(solved.job.size)
                             if solved.job[c] == k and solved.type_of(c) == "v100") for k, j in enumerate(solved.jobs)}
    assert on_v100["long"] > 0.7 > 0.3 > on_v100["short"]
    # level = 1 / makespan: the long job finishes at 1 / level, no later.
    rate = np.bincount(solved.job, weights=solved.fraction * solved.throughput, minlength=2)
    finish = np.array([4e6, 1e6]) / rate
    assert finish.max() == pytest.approx(1 / solved.level, rel=1e-3)
    with pytest.raises(ValueError, match="objective"):
        GavelPolicy(objective="fastest")


def test_makespan_lp_is_solved_in_a_time_unit_that_does_not_change_its_answer():
    # Finishing rates of ~1e-8 per second (large remaining work) are handed to the LP in units
    # of a typical job's time alone: the allocation is the same whatever the work's scale, and
    # the level is still 1 / the makespan in seconds.
    jobs = [tjob(f"j{k}", app, gpus=g, min_gpus=1, max_gpus=8, remaining=w)
            for k, (app, g, w) in enumerate([("imagenet", 2, 3e6), ("ncf", 4, 1e6), ("bert", 2, 2e6), ("cifar10", 1, 5e5)])]
    policy = GavelPolicy(objective="makespan")
    small = policy.solve(make_snapshot(NODES, jobs))
    large = policy.solve(make_snapshot(NODES, [dataclasses.replace(j, target_samples=j.target_samples * 1e4) for j in jobs]))
    assert large.level == pytest.approx(small.level / 1e4, rel=1e-5)
    assert np.allclose(small.fraction, large.fraction, atol=1e-6)
    rate = np.bincount(large.job, weights=large.fraction * large.throughput, minlength=len(jobs))
    assert (np.array([j.remaining_samples for j in large.jobs]) / rate).max() == pytest.approx(1 / large.level, rel=1e-3)


def test_type_constraints_and_one_type_per_job_hold_under_both_modes():
    jobs = [tjob(f"j{k}", app, gpus=g, min_gpus=1, max_gpus=8, submit=k)
            for k, (app, g) in enumerate([("imagenet", 2), ("ncf", 4), ("bert", 2), ("cifar10", 1)])]
    jobs[0] = dataclasses.replace(jobs[0], gpu_types=("k80",))
    snap = make_snapshot(NODES, jobs)
    for policy in (GavelPolicy(), GavelPolicy(heterogeneity_aware=False), GavelPolicy(objective="makespan")):
        plan = policy.schedule(snap)
        assert_sound(snap, plan)
        types = job_types(snap, plan)
        assert all(len(t) == 1 for t in types.values()), types
        assert types.get("j0", {"k80"}) == {"k80"}


def test_pop_partitions_stay_close_to_the_whole_lp_and_every_usable_gpu_is_placed():
    nodes = typed(make_nodes(4, 4, prefix="k"), "k80") + typed(make_nodes(4, 4, prefix="v"), "v100")
    apps = ["imagenet", "cifar10", "bert", "deepspeech2", "ncf", "yolov3"]
    jobs = [tjob(f"j{k:02d}", apps[k % 6], gpus=1 + k % 3, min_gpus=1, max_gpus=4, submit=k) for k in range(24)]
    snap = make_snapshot(nodes, jobs)
    whole, split = GavelPolicy().solve(snap), GavelPolicy(partitions=4).solve(snap)
    assert GavelPolicy().partition_count(24) == 1 and GavelPolicy(partitions=3).partition_count(24) == 3
    assert GavelPolicy(partitions=40).partition_count(24) == 24
    # Each part gets a quarter of every type; the stitched allocation keeps every capacity row.
    for solved in (whole, split):
        for t, gpu_type in enumerate(solved.types):
            used = float(np.sum(solved.fraction * solved.gpus * (solved.gpu_type == t)))
            assert used <= 16 + 1e-6, gpu_type
    assert split.normalized_throughput().min() >= 0.9 * whole.normalized_throughput().min()
    plan = GavelPolicy(partitions=4).schedule(snap)
    assert_sound(snap, plan)
    assert sum(a.gpus for a in plan.allocations.values()) == 32  # 24 jobs of up to 4 GPUs can use all 32


def test_identical_jobs_are_solved_as_one_lp_row_without_changing_the_optimum():
    # 36 jobs of 6 kinds: the LP over the 6 classes (with their sizes) must reach the same max-min
    # level and the same water-filled total as the LP with one row per job, and keep capacities.
    from scheduler.policies import gavel_max_min

    nodes = typed(make_nodes(3, 4, prefix="k"), "k80") + typed(make_nodes(2, 4, prefix="v"), "v100")
    apps = ["imagenet", "cifar10", "bert", "deepspeech2", "ncf", "yolov3"]
    jobs = [tjob(f"j{k:02d}", apps[k % 6], gpus=1 + k % 2 * 3, min_gpus=1, max_gpus=1 + k % 2 * 3) for k in range(36)]
    snap = make_snapshot(nodes, jobs)
    by_class = GavelPolicy().solve(snap)
    real = gavel_max_min.job_classes
    try:
        gavel_max_min.job_classes = lambda job, *rest: np.arange(rest[-1])  # every job a class of its own: the plain LP
        plain = GavelPolicy().solve(snap)
    finally:
        gavel_max_min.job_classes = real
    assert by_class.level == pytest.approx(plain.level, rel=1e-6)
    assert by_class.normalized_throughput().sum() == pytest.approx(plain.normalized_throughput().sum(), rel=1e-6)
    for t in range(len(by_class.types)):
        assert float(np.sum(by_class.fraction * by_class.gpus * (by_class.gpu_type == t))) <= [12, 8][t] + 1e-6
    # Jobs j00 and j12 are alike: the same fractions on the same candidates.
    share = by_class.time_fraction()
    assert share[0] == pytest.approx(share[12]) and share[0] > 0
    klass = gavel_max_min.job_classes(by_class.job, by_class.gpus, by_class.gpu_type, by_class.throughput / by_class.reference[by_class.job],
                               by_class.weight, None, len(jobs))
    assert klass.max() + 1 == 6 and klass[0] == klass[12] != klass[1]


def test_types_of_different_sizes_offer_their_own_gpu_counts():
    # 8 K80s and 2 V100s: a 4-GPU elastic job has counts up to 8 on the K80s and up to 2 on the
    # V100s; the candidates of both types are solved together (they once failed to stack).
    nodes = typed(make_nodes(2, 4, prefix="k"), "k80") + typed(make_nodes(1, 2, prefix="v"), "v100")
    jobs = [tjob(f"j{i}", "cifar10", gpus=4, min_gpus=1, max_gpus=8) for i in range(3)]
    snap = make_snapshot(nodes, jobs)
    policy = GavelPolicy(elastic=True)
    solved = policy.solve(snap)
    offered = {(solved.type_of(c), int(solved.gpus[c])) for c in range(solved.job.size)}
    assert ("k80", 8) in offered and ("v100", 2) in offered and ("v100", 4) not in offered
    plan = policy.schedule(snap)
    assert_sound(snap, plan)
    assert plan.allocations
