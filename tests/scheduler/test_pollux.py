"""pollux: goodput-optimized elastic allocation maximizing the power mean of speedups."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from estimator.goodput import BatchBounds, GradParams, PerfParams
from estimator.job_model import JobModel
from estimator.predict import predict_one
from scheduler.policies.pollux import PolluxPolicy, power_mean
from scheduler.policies.pollux_counts import _solve_hull_greedy, local_search, solve_dp, upper_hull_segments
from scheduler.registry import get_policy
from tests.scheduler.conftest import APPLICATIONS, assert_sound, make_job, make_nodes, make_snapshot, snapshots


def synthetic(sync_s: float, noise: float) -> JobModel:
    """A job whose scaling is set by its all-reduce time and gradient noise (large batches help noisy jobs)."""
    return JobModel(
        application="synthetic",
        perf=PerfParams(alpha_c=0.05, beta_c=0.0005, alpha_n=sync_s, beta_n=0.0, alpha_r=sync_s, beta_r=0.0, gamma=1.0),
        grad=GradParams(sqr=1.0, var=noise),
        bounds=BatchBounds(init_batch_size=100, max_batch_size=6400, min_local_bsz=50, max_local_bsz=400),
        dataset_bytes=1e9,
        bytes_per_sample=1e5,
    )


def elastic(job_id: str, application: str = "cifar10", *, held: int = 1, low: int = 1, high: int = 16, **fields):
    return make_job(job_id, application, gpus=held, min_gpus=low, max_gpus=high, **fields)


def random_snapshot(rng: np.random.Generator, *, jobs: int, nodes: int, per_node: int):
    items = []
    for k in range(jobs):
        low = int(rng.choice([1, 1, 1, 2, 4]))
        high = int(max(low, rng.choice([1, 4, 8, 16, 64])))
        items.append(
            make_job(
                f"j{k:03d}",
                APPLICATIONS[int(rng.integers(len(APPLICATIONS)))],
                gpus=int(rng.integers(low, high + 1)),
                min_gpus=low,
                max_gpus=high,
                submit=float(k),
                attained_gpu_s=float(rng.choice([0.0, 500.0, 5e4])),
            )
        )
    return make_snapshot(make_nodes(nodes, per_node), items, time=float(jobs + 1))


def counts_of(table, plan) -> np.ndarray:
    return np.array([plan.gpus_of(job.job_id) for job in table.jobs])


def test_registered_with_options():
    policy = get_policy("pollux", p=-0.5, restart_penalty=False, max_gpus_per_job=8)
    assert isinstance(policy, PolluxPolicy) and policy.p == -0.5 and policy.name == "pollux"
    bad_options = (
        {"p": float("nan")}, {"max_gpus_per_job": 0}, {"speedup_base": "x"}, {"solver": "x"}, {"floor": 0.0},
        {"penalty_model": "x"}, {"penalty_rounds": 0.0},
    )
    for bad in bad_options:
        with pytest.raises(ValueError):
            PolluxPolicy(**bad)


def test_power_mean():
    assert power_mean([1.0, 4.0], -1, floor=0.0) == pytest.approx(1.6)  # 2 / (1 + 1/4)
    assert power_mean([1.0, 4.0], 0, floor=0.0) == pytest.approx(2.0)
    assert power_mean([1.0, 4.0], 1, floor=0.0) == pytest.approx(2.5)
    assert power_mean([0.0, 4.0], -1) == pytest.approx(2 / (1 / 1e-3 + 1 / 4.001))  # an idle job drags it to ~0


def test_empty_snapshot_and_no_training_gpus():
    assert PolluxPolicy().schedule(make_snapshot(make_nodes(2), [])).allocations == {}
    inference_only = make_snapshot(make_nodes(2, pool="inference"), [elastic("a")])
    assert PolluxPolicy().schedule(inference_only).allocations == {}


def test_better_scaling_job_gets_more_gpus():
    nodes = make_nodes(2, 8)
    jobs = [elastic("fast", model=synthetic(0.001, 1000.0)), elastic("slow", model=synthetic(0.2, 10.0), submit=1.0)]
    snapshot = make_snapshot(nodes, jobs, time=10.0)
    efficient = PolluxPolicy(p=1.0).schedule(snapshot)  # total speedup
    assert_sound(snapshot, efficient)
    assert efficient.gpus_of("fast") > efficient.gpus_of("slow") >= 1
    # p = -1 (harmonic mean) trades efficiency for fairness: the slow job gets more than under p = 1.
    fair = PolluxPolicy(p=-1.0).schedule(snapshot)
    assert fair.gpus_of("slow") > efficient.gpus_of("slow")
    assert fair.gpus_of("fast") + fair.gpus_of("slow") == 16


def test_real_profiles_ncf_stops_where_it_stops_scaling():
    # ncf's speedup peaks at a few GPUs; imagenet keeps scaling.
    nodes = make_nodes(4, 4)
    jobs = [elastic("ncf", "ncf"), elastic("imagenet", "imagenet", submit=1.0)]
    plan = PolluxPolicy().schedule(make_snapshot(nodes, jobs, time=10.0))
    assert plan.gpus_of("imagenet") > plan.gpus_of("ncf") >= 1
    assert plan.gpus_of("ncf") <= 4


def test_p_minus_one_gives_every_job_a_gpu_before_growing_any():
    nodes = make_nodes(2, 4)
    jobs = [elastic(f"j{k}", app, submit=float(k)) for k, app in enumerate(APPLICATIONS + ("imagenet", "cifar10"))]
    plan = PolluxPolicy().schedule(make_snapshot(nodes, jobs, time=10.0))
    assert [plan.gpus_of(job.job_id) for job in jobs] == [1] * 8


def test_more_jobs_than_gpus_prefers_least_attained_service():
    nodes = make_nodes(1, 2)
    jobs = [
        elastic("old", submit=0.0, attained_gpu_s=1e4),
        elastic("new", submit=5.0),
        elastic("newer", submit=6.0),
    ]
    plan = PolluxPolicy(restart_penalty=False).schedule(make_snapshot(nodes, jobs, time=10.0))
    assert {job_id for job_id, a in plan.allocations.items() if a.gpus} == {"new", "newer"}


@pytest.mark.parametrize("application", ["cifar10", "imagenet", "yolov3"])
def test_restart_penalty_keeps_allocations_when_gains_are_small(application):
    # Two identical jobs split 8 GPUs 3/5; 4/4 is (slightly) better, but moving restarts both.
    nodes = make_nodes(1, 8)
    jobs = [elastic("a", application, held=3, high=8), elastic("b", application, held=5, high=8, submit=1.0)]
    current = {"a": [("n0", range(3))], "b": [("n0", range(3, 8))]}
    snapshot = make_snapshot(nodes, jobs, time=100.0, current=current, restart_cost_s=30.0, interval_s=60.0)
    stable = PolluxPolicy(penalty_rounds=1).schedule(snapshot)  # a restart loses half the next round
    assert stable.allocations["a"].placement == (("n0", (0, 1, 2)),)
    assert stable.allocations["b"].placement == (("n0", (3, 4, 5, 6, 7)),)
    assert PolluxPolicy(restart_penalty=False).schedule(snapshot).gpus_of("a") == 4
    if application == "cifar10":
        # Spreading the cost over a longer horizon makes the same move worth it.
        assert PolluxPolicy(penalty_rounds=10).schedule(snapshot).gpus_of("a") == 4


def test_restart_penalty_allows_large_gains():
    nodes = make_nodes(1, 8)
    jobs = [elastic("a", held=1, high=8), elastic("b", held=7, high=8, submit=1.0)]
    current = {"a": [("n0", [0])], "b": [("n0", range(1, 8))]}
    plan = PolluxPolicy().schedule(make_snapshot(nodes, jobs, time=100.0, current=current))
    assert plan.gpus_of("a") == plan.gpus_of("b") == 4


def test_batch_sizes_are_goodput_optimal():
    nodes = make_nodes(3, 4)
    jobs = [elastic(f"j{k}", app, submit=float(k)) for k, app in enumerate(APPLICATIONS)]
    snapshot = make_snapshot(nodes, jobs, time=10.0)
    plan = PolluxPolicy().schedule(snapshot)
    assert sum(a.gpus for a in plan.allocations.values()) == 12
    for job in jobs:
        a = plan.allocations[job.job_id]
        best = predict_one(job.model, a.gpus, a.nodes, 0, float("inf"), 0, gpus_per_node=4)
        assert a.batch_size == best.batch_size[0] > 0
        # Nothing on the goodput grid beats it by more than the batch-size search's resolution.
        others = np.arange(job.model.bounds.init_batch_size, job.model.bounds.max_batch_size + 1)
        alt = predict_one(job.model, a.gpus, a.nodes, 0, float("inf"), others, gpus_per_node=4)
        assert alt.goodput_samples_per_s.max() <= best.goodput_samples_per_s[0] * 1.01


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(max_jobs=12))
def test_plans_are_sound_on_random_snapshots(snapshot):
    policy = PolluxPolicy(max_gpus_per_job=8)
    plan = policy.schedule(snapshot)
    assert_sound(snapshot, plan)
    jobs = {job.job_id: job for job in snapshot.jobs}
    for job_id, a in plan.allocations.items():
        assert a.gpus <= max(8, jobs[job_id].min_gpus)
        assert a.batch_size > 0
        assert all(snapshot.node(node).pool == "training" for node, _ in a.placement)


def equal_share_counts(table) -> np.ndarray:
    """Baseline: each job its fair share clipped to its bounds, in arrival order while GPUs last."""
    jobs, free = table.jobs, table.capacity
    share = max(table.capacity // len(jobs), 1)
    counts = np.zeros(len(jobs), dtype=np.int64)
    for k, job in enumerate(jobs):
        want = min(max(share, job.min_gpus), job.max_gpus, 64)
        if job.min_gpus <= want <= free:
            counts[k] = want
            free -= want
    return counts


@pytest.mark.parametrize("seed", range(12))
def test_fitness_beats_simple_baselines(seed):
    rng = np.random.default_rng(seed)
    snapshot = random_snapshot(rng, jobs=int(rng.integers(2, 40)), nodes=int(rng.integers(1, 8)), per_node=4)
    policy = PolluxPolicy()
    table = policy.speedup_table(snapshot)
    plan = policy.schedule(snapshot)
    assert_sound(snapshot, plan)
    chosen = policy.fitness(table, counts_of(table, plan))
    assert chosen >= policy.fitness(table, equal_share_counts(table)) * (1 - 1e-9)
    one_each = np.array([1 if job.min_gpus == 1 else 0 for job in table.jobs])
    one_each[np.cumsum(one_each) > table.capacity] = 0
    assert chosen >= policy.fitness(table, one_each) * (1 - 1e-9)


def test_upper_hull_segments():
    utility = np.array([
        [0.0, 1.0, 1.5, 3.0, 3.2],        # (0,0)-(3,3) slope 1 (farthest of the ties), then 0.2
        [0.0, -np.inf, 2.0, 2.0, 1.0],     # a forbidden count, then nothing gained past 2
        [-5.0, -1.0, -np.inf, -np.inf, -np.inf],
    ])
    job, start, end, slope = upper_hull_segments(utility)
    found = sorted(zip(job.tolist(), start.tolist(), end.tolist(), np.round(slope, 6).tolist()))
    assert found == [(0, 0, 3, 1.0), (0, 3, 4, 0.2), (1, 0, 2, 1.0), (2, 0, 1, 4.0)]


def test_dp_is_exact_on_small_tables():
    rng = np.random.default_rng(7)
    for _ in range(20):
        jobs, capacity, width = int(rng.integers(1, 5)), int(rng.integers(0, 7)), int(rng.integers(2, 6))
        utility = rng.normal(size=(jobs, width))
        utility[rng.random((jobs, width)) < 0.2] = -np.inf
        utility[:, 0] = rng.normal(size=jobs) - 1
        best = max(
            utility[np.arange(jobs), list(c)].sum()
            for c in itertools.product(range(width), repeat=jobs)
            if sum(c) <= capacity
        )
        counts = solve_dp(utility, capacity)
        assert counts.sum() <= capacity
        assert utility[np.arange(jobs), counts].sum() == pytest.approx(best)


@pytest.mark.parametrize("seed", range(8))
def test_greedy_search_is_close_to_the_exact_optimum(seed):
    rng = np.random.default_rng(100 + seed)
    snapshot = random_snapshot(rng, jobs=int(rng.integers(5, 80)), nodes=int(rng.integers(2, 12)), per_node=int(rng.choice([4, 8])))
    policy = PolluxPolicy()
    table = policy.speedup_table(snapshot)
    exact = solve_dp(table.utility, table.capacity)
    greedy = local_search(table.utility, table.capacity, _solve_hull_greedy(table.utility, table.capacity), 200)
    assert greedy.sum() <= table.capacity
    low = np.array([job.min_gpus for job in table.jobs])
    assert np.all((greedy == 0) | (greedy >= low))
    assert policy.fitness(table, greedy) >= 0.99 * policy.fitness(table, exact)
    # Both solvers produce sound plans through the policy.
    plan = PolluxPolicy(solver="greedy").schedule(snapshot)
    assert_sound(snapshot, plan)


def test_fair_share_base_and_p_options_run():
    rng = np.random.default_rng(3)
    snapshot = random_snapshot(rng, jobs=20, nodes=4, per_node=4)
    for policy in (PolluxPolicy(speedup_base="fair_share"), PolluxPolicy(p=0.0), PolluxPolicy(p=1.0)):
        plan = policy.schedule(snapshot)
        assert_sound(snapshot, plan)
        assert sum(a.gpus for a in plan.allocations.values()) == 16


def test_policy_is_pure():
    rng = np.random.default_rng(5)
    snapshot = random_snapshot(rng, jobs=30, nodes=4, per_node=4)
    policy = PolluxPolicy()
    assert policy.schedule(snapshot) == policy.schedule(snapshot)


def test_age_penalty_model():
    nodes = make_nodes(1, 8)
    jobs = [
        elastic("old", held=3, high=8, submit=0.0),
        elastic("young", held=5, high=8, submit=9_000.0, restarts=2),
    ]
    current = {"old": [("n0", range(3))], "young": [("n0", range(3, 8))]}
    snapshot = make_snapshot(nodes, jobs, time=10_000.0, current=current)
    policy = PolluxPolicy(penalty_model="age")
    factor = policy.restart_factor(snapshot)
    assert factor == pytest.approx([10_000 / 10_030, (1_000 - 60) / 1_030])
    assert_sound(snapshot, policy.schedule(snapshot))
    assert list(PolluxPolicy(restart_penalty=False).restart_factor(snapshot)) == [1.0, 1.0]


def test_single_node_jobs_are_placed_before_multi_node_ones():
    # Free: 2 GPUs on n0, 4 on n1, 4 on n2. Placing the 6-GPU job first (largest first) would
    # leave the 4-GPU job straddling two nodes; single-node jobs go first.
    nodes = make_nodes(3, 4)
    jobs = [make_job("a", gpus=2), make_job("big", "imagenet", gpus=6, submit=1.0), make_job("small", "imagenet", gpus=4, submit=2.0)]
    snapshot = make_snapshot(nodes, jobs, time=100.0, current={"a": [("n0", [0, 1])]})
    plan = PolluxPolicy().schedule(snapshot)
    assert_sound(snapshot, plan)
    assert plan.gpus_of("big") == 6 and plan.gpus_of("small") == 4
    assert plan.allocations["small"].nodes == 1


def test_a_spread_job_is_priced_as_spread():
    # Only 4 GPUs straddling two nodes are left for "d": the policy weighs 4 spread GPUs
    # against 2 on one node using the spread price, and the plan is sound either way.
    nodes = make_nodes(3, 4)
    jobs = [
        make_job("a", gpus=2, submit=0.0),
        make_job("b", gpus=2, submit=1.0),
        elastic("c", "imagenet", held=4, high=4, submit=2.0),
        elastic("d", "imagenet", held=4, high=4, submit=3.0),
    ]
    current = {"a": [("n0", [0, 1])], "b": [("n1", [0, 1])]}
    snapshot = make_snapshot(nodes, jobs, time=100.0, current=current)
    policy = PolluxPolicy()
    plan = policy.schedule(snapshot)
    assert_sound(snapshot, plan)
    table = policy.speedup_table(snapshot)
    d = [job.job_id for job in table.jobs].index("d")
    assert table.raw_split[d, 4] < table.raw[d, 4]
    chosen = plan.allocations["d"]
    if chosen.nodes > 1:  # spread 4 GPUs must beat 2 packed ones
        assert table.raw_split[d, 4] > table.raw[d, 2]


@pytest.mark.parametrize("seed", range(6))
def test_repacking_never_lowers_the_placed_fitness(seed):
    rng = np.random.default_rng(200 + seed)
    snapshot = random_snapshot(rng, jobs=int(rng.integers(5, 30)), nodes=int(rng.integers(2, 8)), per_node=4)
    # Give it a current plan: what the policy chose a round earlier, with the jobs a little older.
    earlier = PolluxPolicy().schedule(snapshot)
    snapshot = make_snapshot(snapshot.nodes, snapshot.jobs, time=snapshot.time_s + 60.0, current=earlier)
    fitness = {}
    for rounds in (0, 3):
        policy = PolluxPolicy(repack_rounds=rounds)
        plan = policy.schedule(snapshot)
        assert_sound(snapshot, plan)
        table = policy.speedup_table(snapshot)
        fitness[rounds] = power_mean(policy.placed_speedups(table, snapshot, {k: a.placement for k, a in plan.allocations.items()}), policy.p)
    assert fitness[3] >= fitness[0] * (1 - 1e-9)


def test_count_solvers_reach_the_brute_force_optimum_on_small_tables():
    # The DP (strided windows, columns past each job's last improving count skipped) and the
    # "every best count fits" shortcut must both give the best sum over all count vectors.
    from scheduler.policies.pollux_counts import solve_counts

    rng = np.random.default_rng(7)
    for _ in range(60):
        n, width, capacity = int(rng.integers(1, 4)), int(rng.integers(2, 6)), int(rng.integers(1, 9))
        utility = np.round(rng.normal(size=(n, width)), 1)
        utility[rng.random((n, width)) < 0.2] = -np.inf
        utility[:, 0] = 0.0
        best = max(sum(utility[j, g] for j, g in enumerate(counts))
                   for counts in itertools.product(range(width), repeat=n) if sum(counts) <= capacity)
        for counts in (solve_dp(utility, capacity), solve_counts(utility, capacity, "dp")):
            assert counts.sum() <= capacity
            assert utility[np.arange(n), counts].sum() == pytest.approx(best)


def _reference_dp(utility, capacity):
    """The plain group-knapsack DP: every job, every capacity, every count, the smallest count
    among equal totals (what the fast DPs must return, ties included)."""
    n, width = utility.shape
    best = np.zeros(capacity + 1)
    choice = np.zeros((n, capacity + 1), dtype=np.int64)
    for j in range(n):
        new = np.full(capacity + 1, -np.inf)
        for c in range(capacity + 1):
            for k in range(min(width, c + 1)):
                if best[c - k] + utility[j, k] > new[c]:
                    new[c], choice[j, c] = best[c - k] + utility[j, k], k
        best = new
    counts, c = np.zeros(n, dtype=np.int64), capacity
    for j in range(n - 1, -1, -1):
        counts[j] = choice[j, c]
        c -= counts[j]
    return counts


def test_sparse_and_dense_dps_return_the_reference_answer_ties_included():
    from scheduler.policies.pollux_counts import _lagrangian_candidates, _solve_dense_dp, _solve_sparse_dp

    rng = np.random.default_rng(11)
    pruned = 0
    for trial in range(400):
        n, width, capacity = int(rng.integers(1, 7)), int(rng.integers(2, 8)), int(rng.integers(0, 14))
        utility = np.round(rng.normal(size=(n, width)), int(rng.integers(0, 3)))  # coarse values tie
        if trial % 3 == 0:
            utility = np.sort(utility, axis=1)  # rising rows, as speedups are
        utility[rng.random((n, width)) < 0.2] = -np.inf
        utility[:, 0] = np.round(rng.normal(size=n), 1) if trial % 2 else 0.0
        expected = _reference_dp(utility, capacity)
        assert np.array_equal(_solve_dense_dp(utility, capacity), expected)
        assert np.array_equal(solve_dp(utility, capacity), expected)
        candidates = _lagrangian_candidates(utility, capacity)
        if candidates is not None:
            job, count = candidates
            assert np.array_equal(_solve_sparse_dp(utility, capacity, job, count), expected)
            # The answer's counts survive the pruning, and the pruning removed something somewhere.
            assert set(zip(range(n), expected.tolist())) <= set(zip(job.tolist(), count.tolist()))
            pruned += job.size < n * width
    assert pruned > 100


def test_lagrangian_pruning_keeps_few_counts_on_a_policy_table():
    from scheduler.policies.pollux_counts import _lagrangian_candidates

    rng = np.random.default_rng(21)
    snapshot = random_snapshot(rng, jobs=60, nodes=6, per_node=8)
    table = PolluxPolicy().speedup_table(snapshot)
    candidates = _lagrangian_candidates(table.utility, table.capacity)
    assert candidates is not None
    job, count = candidates
    finite = np.isfinite(table.utility).sum()
    assert job.size < finite / 3
    assert np.array_equal(solve_dp(table.utility, table.capacity), _reference_dp(table.utility, table.capacity))


def test_memoized_packed_goodput_matches_a_fresh_prediction():
    from scheduler.policies.pollux_estimates import packed_goodput
    from tests.scheduler.conftest import model

    bert, cifar = model("bert"), model("cifar10")
    models, gpus, batch = [bert, cifar, bert, bert], [1, 4, 8, 1], [0, 0, 64, 0]
    expected = [predict_one(m, g, 0, 0, np.inf, b, gpus_per_node=4).goodput_samples_per_s[0]
                for m, g, b in zip(models, gpus, batch)]
    for _ in range(2):  # the second call is answered from the memo
        assert packed_goodput(models, gpus, batch, per_node=4) == pytest.approx(expected, rel=1e-12)
