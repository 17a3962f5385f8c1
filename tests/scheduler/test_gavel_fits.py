"""gavel's LPs answered without HiGHS when every job fits on its best candidate (gavel_fits), and the
promise across departures that rests on it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from scheduler.policies import gavel, gavel_max_min
from scheduler.policies.gavel import GavelPolicy
from scheduler.policies.gavel_fits import best_fits, fits_after_departures
from scheduler.policy import Plan
from scheduler.steady import Steadiness
from tests.scheduler.conftest import make_job, make_nodes, make_snapshot
from tests.scheduler.test_gavel_lp import random_problem


def lp_inputs(p):
    return (p["job"], p["gpus"], p["rate"] * p["factor"][p["job"]], p["weight"], p["n_jobs"], p["capacity"],
            p["kind"], True, p["io"], p["io_budget"], p["multiplicity"])


def best_use(p) -> np.ndarray:
    """Per type: GPUs every job's best candidate takes (times its multiplicity)."""
    job, normalized = p["job"], p["rate"] * p["factor"][p["job"]]
    many = p["multiplicity"] if p["multiplicity"] is not None else np.ones(p["n_jobs"])
    order = np.lexsort((-normalized, job))
    first = np.ones(order.size, dtype=bool)
    first[1:] = job[order[1:]] != job[order[:-1]]
    best = order[first]
    return np.bincount(p["kind"][best], weights=p["gpus"][best] * many[job[best]], minlength=len(p["capacity"]))


@pytest.mark.parametrize("seed", range(40))
def test_the_answer_without_the_lp_is_the_lps(seed):
    rng = np.random.default_rng(seed)
    p = random_problem(rng, n_jobs=int(rng.integers(2, 30)), n_types=int(rng.integers(1, 4)),
                       n_shapes=int(rng.integers(1, 6)), io=seed % 4 == 0, many=seed % 2 == 1)
    if seed % 5 != 4:  # room for every job's best (else the LP's own capacities, which seldom fit)
        p["capacity"] = np.maximum(p["capacity"], np.ceil(best_use(p)).astype(np.int64) + int(rng.integers(0, 3)))
        if p["io"] is not None:
            p["io_budget"] = float(p["io"].sum()) * 4
    fits = best_fits(*lp_inputs(p))
    exact, level = gavel_max_min.solve_max_min_lp(*lp_inputs(p))
    if seed % 5 != 4 and np.all(p["rate"] > 0):
        assert fits is not None
    if fits is None:
        return
    fraction, fits_level = fits
    assert set(np.unique(fraction)) <= {0.0, 1.0}
    np.testing.assert_allclose(fraction, exact, atol=1e-7)
    assert fits_level == pytest.approx(level, rel=1e-7)
    assert gavel_max_min.max_min_lp(*lp_inputs(p))[0].tolist() == fraction.tolist()  # what a round gets


def test_no_answer_without_the_lp_when_a_best_does_not_fit_or_ties_or_no_water_filling():
    job = np.array([0, 0, 1, 1])
    gpus = np.array([1, 2, 1, 2])
    normalized = np.array([0.6, 1.0, 0.5, 0.9])
    kind = np.zeros(4, dtype=np.int64)
    args = (np.ones(2), 2)
    fraction, level = best_fits(job, gpus, normalized, *args, np.array([4]), kind, True)
    assert fraction.tolist() == [0, 1, 0, 1] and level == 0.9
    assert best_fits(job, gpus, normalized, *args, np.array([3]), kind, True) is None    # 2 + 2 GPUs on 3
    assert best_fits(job, gpus, normalized, *args, np.array([4]), kind, False) is None   # max-min alone: many optima
    tied = np.array([1.0, 1.0, 0.5, 0.9])
    assert best_fits(job, gpus, tied, *args, np.array([4]), kind, True) is None
    idle = np.array([0.0, 0.0, 0.5, 0.9])
    assert best_fits(job, gpus, idle, *args, np.array([4]), kind, True) is None         # level 0: no water-filling
    assert best_fits(job, gpus, normalized, *args, np.array([4]), kind, True, np.array([1.0, 1, 1, 3]), 3.5) is None


def jobs_of(n: int):
    return [make_job(f"j{k}", gpus=2, min_gpus=1, max_gpus=4, submit=float(k)) for k in range(n)]


def in_force(policy, snapshot):
    plan = policy.schedule(snapshot)
    shown = dataclasses.replace(snapshot, current=plan)
    return shown, policy.schedule(shown)


def test_a_cluster_with_room_for_every_best_is_promised_across_departures():
    policy = GavelPolicy()
    shown, plan = in_force(policy, make_snapshot(make_nodes(8, 4), jobs_of(5), time=100.0))
    assert policy.stable_until(shown, plan) == Steadiness(math.inf, departures=True)
    assert fits_after_departures(policy.solve(shown), policy.pool_types(shown)[1])
    for gone in ({"j0"}, {"j1", "j3"}, {"j0", "j2", "j4"}):
        kept = Plan({j: a for j, a in plan.allocations.items() if j not in gone})
        fewer = dataclasses.replace(shown, jobs=tuple(j for j in shown.jobs if j.job_id not in gone), current=kept)
        assert policy.schedule(fewer).allocations == kept.allocations
    # Not across departures: without water-filling, split POP-style, or past the LP's size.
    for other in (GavelPolicy(water_fill=False), GavelPolicy(partitions=2), GavelPolicy(partition_jobs=3)):
        shown, plan = in_force(other, make_snapshot(make_nodes(8, 4), jobs_of(5), time=100.0))
        assert not other.stable_until(shown, plan).departures


def test_a_crowded_cluster_is_not_promised_across_departures():
    policy = GavelPolicy()
    shown, plan = in_force(policy, make_snapshot(make_nodes(2, 4), jobs_of(5), time=100.0))
    assert not fits_after_departures(policy.solve(shown), policy.pool_types(shown)[1])
    assert not policy.stable_until(shown, plan).departures


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_a_round_of_few_jobs_is_solved_as_through_the_classes(nodes, monkeypatch):
    """A round of at most ``partition_jobs`` jobs skips the shapes (each job its own hull) and, where every
    job fits on its best, the classes: the same allocation as with both (crowded or roomy cluster)."""
    jobs = jobs_of(4) + [make_job(f"r{k}", "imagenet", gpus=1, min_gpus=1, max_gpus=8, submit=9.0 + k) for k in range(3)]
    jobs += [make_job("x", gpus=4, submit=20.0)]
    snapshot = make_snapshot(make_nodes(nodes, 4), jobs, time=100.0)
    few = GavelPolicy().solve(snapshot)
    gavel.forget_lps()
    monkeypatch.setattr(GavelPolicy, "_fits", lambda *args: None)
    through_classes = GavelPolicy(partition_jobs=len(jobs) - 1).solve(snapshot)  # not "small": shapes, classes
    for field in ("job", "gpus", "throughput", "reference", "weight", "fraction"):
        assert getattr(few, field).tolist() == getattr(through_classes, field).tolist(), field
    assert few.level == through_classes.level
