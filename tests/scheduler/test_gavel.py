"""gavel: max-min fairness over normalized throughput (LP) and Gavel's round-based integral allocation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from estimator.goodput import BatchBounds, GradParams, PerfParams
from estimator.job_model import JobModel
from estimator.predict import predict_one
from scheduler.policies.gavel import GavelPolicy
from scheduler.policy import Allocation, Plan
from scheduler.registry import get_policy
from tests.scheduler.conftest import assert_sound, make_job, make_nodes, make_snapshot, snapshots


def synthetic(speed: float = 1.0) -> JobModel:
    """A job ``speed`` times as fast as the base one on any number of GPUs."""
    return JobModel(
        application="synthetic",
        perf=PerfParams(0.05 / speed, 0.0005 / speed, 0.1 / speed, 0.0, 0.02 / speed, 0.0, 1.0),
        grad=GradParams(1.0, 100.0),
        bounds=BatchBounds(100, 3200, 25, 400),
        dataset_bytes=1e9,
        bytes_per_sample=1e5,
    )


def fractions_by_job(allocation) -> dict[str, float]:
    return {job.job_id: f for job, f in zip(allocation.jobs, allocation.time_fraction())}


def test_registered_with_options():
    policy = get_policy("gavel", water_fill=False, running_bonus=0.5)
    assert isinstance(policy, GavelPolicy) and policy.name == "gavel" and not policy.water_fill
    for bad in ({"max_gpus_per_job": 0}, {"priority_base": 0.0}, {"running_bonus": -1.0}):
        with pytest.raises(ValueError):
            GavelPolicy(**bad)


def test_empty_snapshot():
    assert GavelPolicy().schedule(make_snapshot(make_nodes(1), [])).allocations == {}


def test_equal_jobs_get_equal_shares():
    jobs = [make_job(f"j{k}", submit=float(k)) for k in range(4)]
    allocation = GavelPolicy().solve(make_snapshot(make_nodes(1, 2), jobs, time=10.0))
    assert list(allocation.time_fraction()) == pytest.approx([0.5] * 4, abs=1e-6)
    assert allocation.level == pytest.approx(1.0, abs=1e-6)  # everyone at its equal share


def test_throughput_is_normalized():
    # One job runs twice as fast per GPU; max-min over *normalized* throughput still splits time evenly.
    jobs = [make_job("fast", model=synthetic(2.0)), make_job("slow", model=synthetic(1.0), submit=1.0)]
    allocation = GavelPolicy().solve(make_snapshot(make_nodes(1, 1), jobs, time=10.0))
    assert fractions_by_job(allocation) == pytest.approx({"fast": 0.5, "slow": 0.5}, abs=1e-6)
    rate = dict(zip(("fast", "slow"), np.bincount(allocation.job, allocation.fraction * allocation.throughput)))
    assert rate["fast"] == pytest.approx(2 * rate["slow"], rel=1e-6)
    np.testing.assert_allclose(allocation.normalized_throughput(), [1.0, 1.0], atol=1e-6)


def test_bigger_jobs_get_proportionally_less_time():
    # Equal share = 1 GPU each: a 1-GPU job runs all the time, a 2-GPU job half of it (Gavel's scale factor).
    jobs = [make_job("one", gpus=1), make_job("two", gpus=2, submit=1.0)]
    allocation = GavelPolicy().solve(make_snapshot(make_nodes(1, 2), jobs, time=10.0))
    assert fractions_by_job(allocation) == pytest.approx({"one": 1.0, "two": 0.5}, abs=1e-6)
    assert list(allocation.target_gpus()) == pytest.approx([1.0, 1.0], abs=1e-6)


def test_priority_weights():
    jobs = [make_job("high", priority=1), make_job("low", submit=1.0)]
    allocation = GavelPolicy().solve(make_snapshot(make_nodes(1, 1), jobs, time=10.0))
    assert fractions_by_job(allocation) == pytest.approx({"high": 2 / 3, "low": 1 / 3}, abs=1e-6)


def test_water_filling_hands_out_what_the_bottleneck_cannot_use():
    # The elastic job's own batch is large enough to scale to 8 GPUs.
    jobs = [make_job("rigid"), make_job("elastic", gpus=2, min_gpus=1, max_gpus=8, submit=1.0, batch_size=2048)]
    snapshot = make_snapshot(make_nodes(1, 8), jobs, time=10.0)
    filled = GavelPolicy().solve(snapshot)
    assert list(filled.target_gpus()) == pytest.approx([1.0, 7.0], abs=1e-5)
    assert filled.level == pytest.approx(1.0, abs=1e-6)
    plain = GavelPolicy(water_fill=False).solve(snapshot)
    assert plain.normalized_throughput().min() == pytest.approx(filled.level, abs=1e-6)
    plan = GavelPolicy().schedule(snapshot)
    assert_sound(snapshot, plan)
    assert plan.gpus_of("rigid") == 1 and plan.gpus_of("elastic") >= 4


def test_elastic_candidates():
    policy = GavelPolicy()
    assert policy.candidate_counts(make_job("r", gpus=3), 16) == [3]
    assert policy.candidate_counts(make_job("e", gpus=3, min_gpus=2, max_gpus=12), 16) == [2, 3, 4, 8, 12]
    assert policy.candidate_counts(make_job("c", gpus=3, min_gpus=1, max_gpus=100), 16) == [1, 2, 3, 4, 8, 16]
    assert policy.candidate_counts(make_job("big", gpus=32), 16) == []
    assert GavelPolicy(elastic=False).candidate_counts(make_job("e", gpus=3, min_gpus=2, max_gpus=12), 16) == [3]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(max_jobs=12))
def test_rounds_honour_capacity_on_random_snapshots(snapshot):
    plan = GavelPolicy().schedule(snapshot)
    assert_sound(snapshot, plan)
    training = sum(node.gpus for node in snapshot.nodes if node.pool == "training")
    assert sum(a.gpus for a in plan.allocations.values()) <= training
    assert all(snapshot.node(node).pool == "training" for a in plan.allocations.values() for node, _ in a.placement)


def run_rounds(snapshot, policy, rounds: int, interval: float = 60.0):
    """Advance ``snapshot`` through ``rounds`` scheduling rounds, crediting GPU-seconds."""
    for _ in range(rounds):
        plan = policy.schedule(snapshot)
        assert_sound(snapshot, plan)
        jobs = tuple(
            dataclasses.replace(job, attained_gpu_s=job.attained_gpu_s + plan.gpus_of(job.job_id) * interval)
            for job in snapshot.jobs
        )
        snapshot = dataclasses.replace(snapshot, jobs=jobs, current=plan, time_s=snapshot.time_s + interval)
    return snapshot


def test_received_shares_converge_to_the_lp_targets():
    nodes = make_nodes(1, 4)
    jobs = [
        make_job("a", gpus=1),
        make_job("b", gpus=1),
        make_job("c", gpus=2),
        make_job("d", gpus=2),
        make_job("e", gpus=3),
    ]
    snapshot = make_snapshot(nodes, jobs, time=0.0)
    policy = GavelPolicy()
    target = policy.solve(snapshot).target_gpus()
    assert target.sum() == pytest.approx(4.0, abs=1e-6)
    end = run_rounds(snapshot, policy, 300)
    received = np.array([job.attained_gpu_s / end.time_s for job in end.jobs])
    np.testing.assert_allclose(received, target, atol=0.08)


def test_running_bonus_reduces_preemptions():
    nodes = make_nodes(1, 2)
    jobs = [make_job(f"j{k}") for k in range(3)]
    snapshot = make_snapshot(nodes, jobs, time=0.0)

    def restarts(policy):
        s, count = snapshot, 0
        for _ in range(60):
            plan = policy.schedule(s)
            count += sum(1 for job_id, a in plan.allocations.items() if not a.same_gpus(s.current.get(job_id)))
            jobs = tuple(dataclasses.replace(j, attained_gpu_s=j.attained_gpu_s + plan.gpus_of(j.job_id) * 60.0) for j in s.jobs)
            s = dataclasses.replace(s, jobs=jobs, current=plan, time_s=s.time_s + 60.0)
        return count, [j.attained_gpu_s for j in s.jobs]

    plain, shares = restarts(GavelPolicy())
    assert max(shares) - min(shares) <= 60.0  # plain Gavel rotates every round
    sticky, sticky_shares = restarts(GavelPolicy(running_bonus=0.25))
    assert sticky < plain / 2
    assert max(sticky_shares) - min(sticky_shares) <= 0.25 * max(sticky_shares)  # still fair, within the hysteresis


def test_batch_sizes_own_or_adapted():
    jobs = [make_job("a", "imagenet", gpus=4), make_job("b", "cifar10", gpus=2, submit=1.0)]
    snapshot = make_snapshot(make_nodes(2, 4), jobs, time=10.0)
    plain = GavelPolicy().schedule(snapshot)
    assert {a.batch_size for a in plain.allocations.values()} == {0}  # the job's own batch size
    adapted = GavelPolicy(adapt_batch=True).schedule(snapshot)
    for job in jobs:
        a = adapted.allocations[job.job_id]
        assert a.batch_size == predict_one(job.model, a.gpus, a.nodes, 0, float("inf"), 0, gpus_per_node=4).batch_size[0]


def test_keeps_running_jobs_in_place():
    jobs = [make_job("a", gpus=2), make_job("b", gpus=2, submit=1.0)]
    current = Plan({"a": Allocation(placement=(("n0", (1, 3)),))})
    snapshot = make_snapshot(make_nodes(1, 4), jobs, time=10.0, current=current, )
    plan = GavelPolicy().schedule(dataclasses.replace(snapshot, jobs=(dataclasses.replace(jobs[0], attained_gpu_s=20.0), jobs[1])))
    assert plan.allocations["a"].placement == (("n0", (1, 3)),)
    assert plan.allocations["b"].placement == (("n0", (0, 2)),)


def test_policy_is_pure():
    rng = np.random.default_rng(1)
    jobs = [make_job(f"j{k}", gpus=int(rng.integers(1, 5)), submit=float(k), attained_gpu_s=float(rng.integers(0, 500))) for k in range(30)]
    snapshot = make_snapshot(make_nodes(4, 4), jobs, time=1000.0)
    assert GavelPolicy().schedule(snapshot) == GavelPolicy().schedule(snapshot)


def test_a_job_that_cannot_fit_does_not_hold_the_others_back():
    jobs = [make_job("huge", gpus=16), make_job("a", submit=1.0), make_job("b", submit=2.0)]
    snapshot = make_snapshot(make_nodes(1, 4), jobs, time=10.0)
    allocation = GavelPolicy().solve(snapshot)
    assert allocation.level == pytest.approx(1.0, abs=1e-6)
    assert fractions_by_job(allocation) == pytest.approx({"huge": 0.0, "a": 1.0, "b": 1.0}, abs=1e-6)
    plan = GavelPolicy().schedule(snapshot)
    assert_sound(snapshot, plan)
    assert plan.gpus_of("a") == plan.gpus_of("b") == 1 and plan.gpus_of("huge") == 0


def test_the_lp_through_highs_bindings_matches_linprog_bit_for_bit(monkeypatch):
    import scheduler.policies.gavel_max_min as gavel_max_min

    if gavel_max_min._highs is None:
        pytest.skip("this scipy has no HiGHS bindings: linprog is the only path")
    rng = np.random.default_rng(4)
    problems = []
    for _ in range(6):
        n_jobs, n_types = int(rng.integers(3, 12)), int(rng.integers(1, 4))
        per_job = rng.integers(1, 5, size=n_jobs)
        job = np.repeat(np.arange(n_jobs), per_job)
        gpus = rng.choice([1, 2, 4, 8], size=job.size)
        normalized = rng.uniform(0.1, 3.0, size=job.size)
        kind = rng.integers(0, n_types, size=job.size)
        capacity = rng.integers(4, 24, size=n_types)
        weight = rng.choice([1.0, 2.0], size=n_jobs)
        problems.append((job, gpus, normalized, weight, n_jobs, capacity, kind, True))
    direct = [gavel_max_min.solve_max_min_lp(*p) for p in problems]
    monkeypatch.setattr(gavel_max_min, "_highs", None)
    through_linprog = [gavel_max_min.solve_max_min_lp(*p) for p in problems]
    for (x, level), (y, expected) in zip(direct, through_linprog):
        assert level == expected and level > 0
        assert np.array_equal(x, y)


def test_a_round_without_arrivals_reuses_the_lp_inputs_and_answers_as_a_fresh_solve():
    import scheduler.policies.gavel as gavel

    gavel.forget_lps()
    nodes = make_nodes(4, 4)
    jobs = [make_job(f"j{k}", app, gpus=g, min_gpus=1, max_gpus=8)
            for k, (app, g) in enumerate([("cifar10", 2), ("bert", 4), ("imagenet", 1), ("ncf", 2), ("cifar10", 2)])]
    policy = GavelPolicy()
    first = policy.solve(make_snapshot(nodes, jobs, time=0.0))
    # Progress and attained service do not enter the LP: the next round reuses its inputs.
    later = [dataclasses.replace(j, samples_done=1e5, attained_gpu_s=600.0) for j in jobs]
    again = policy.solve(make_snapshot(nodes, later, time=600.0))
    assert again.fraction is first.fraction and again.jobs[0].samples_done == 1e5
    with pytest.raises(ValueError):
        again.fraction[0] = 0.5  # shared between rounds: read-only
    # A new job (or other bounds) is another LP; and a reused answer is what a fresh solve gives.
    grown = policy.solve(make_snapshot(nodes, later + [make_job("j9", "bert", gpus=2)], time=600.0))
    assert grown.fraction is not first.fraction and len(grown.jobs) == 6
    gavel.forget_lps()
    fresh = policy.solve(make_snapshot(nodes, later, time=600.0))
    assert np.array_equal(fresh.fraction, again.fraction) and fresh.level == again.level
    assert policy.schedule(make_snapshot(nodes, later, time=600.0)) == policy.schedule(make_snapshot(nodes, later, time=600.0))
