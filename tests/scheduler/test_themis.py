"""Themis: finish-time fairness rho = T_shared / T_ideal, worst rho first, fairness knob, lease-aware bids."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator.predict import predict_one
from scheduler.policies.themis import ThemisPolicy
from scheduler.registry import get_policy
from tests.scheduler.conftest import assert_sound, make_job, make_nodes, make_snapshot, model, running


def schedule(snapshot, **options):
    plan = get_policy("themis", **options).schedule(snapshot)
    assert_sound(snapshot, plan, rigid=True)
    return plan


def rate(application: str = "cifar10", gpus: int = 1) -> float:
    m = model(application)
    return float(predict_one(m, gpus, 0, 0.0, math.inf, m.bounds.init_batch_size).goodput_samples_per_s[0])


def test_rho_by_hand():
    # G = 4 GPUs, N = 2 jobs, so the fair share is 2 GPUs. C = 30 s, I = 60 s, now = 100 s.
    small = make_job("small", gpus=1, target_samples=1e6, samples_done=4e5, submit=0)
    big = make_job("big", gpus=4, target_samples=2e6, submit=40)
    snap = make_snapshot(make_nodes(1, 4), [small, big], time=100, current={"small": [("n0", (0,))]}, restart_cost_s=30, interval_s=60)
    est = ThemisPolicy().estimate(snap)
    g1, g4 = rate("cifar10", 1), rate("cifar10", 4)
    ideal = np.array([1e6 / g1, 2e6 / g4 * 2])  # the 4-GPU job only gets a 2-GPU share: twice as long
    np.testing.assert_allclose(est.ideal_s, ideal)
    shared = np.array([100 + 0 + 6e5 / g1, 60 + 30 + 2e6 / g4])  # small runs in place: no restart
    np.testing.assert_allclose(est.shared_s, shared)
    np.testing.assert_allclose(est.rho, shared / ideal)
    wait = np.array([100 + 60 + 30 + 6e5 / g1, 60 + 60 + 30 + 2e6 / g4])
    np.testing.assert_allclose(est.rho_wait, wait / ideal)
    np.testing.assert_allclose(est.bid, np.log(wait / shared))
    dedicated = ThemisPolicy(ideal="dedicated").estimate(snap)
    np.testing.assert_allclose(dedicated.ideal_s, [1e6 / g1, 2e6 / g4])


def test_favours_the_job_with_the_worst_finish_time_fairness():
    # Same job, one arrived long ago: its finish time is further from its ideal.
    jobs = [make_job("patient", remaining=1e6, submit=0), make_job("newcomer", remaining=1e6, submit=4000)]
    snap = make_snapshot(make_nodes(1, 1), jobs, time=5000)
    est = ThemisPolicy().estimate(snap)
    assert est.rho[0] > est.rho[1]
    assert running(schedule(snap)) == {"patient"}


def auction_case():
    # "waited": rho ~ 51 but a lease more barely changes it (bid ~ 0.01);
    # "fresh": rho ~ 4 but a lease more hurts it a lot relative to its length (bid ~ 0.9).
    g = rate()
    jobs = [make_job("waited", remaining=100 * g, submit=0), make_job("fresh", remaining=10 * g, submit=5000)]
    return make_snapshot(make_nodes(1, 1), jobs, time=5000, restart_cost_s=30, interval_s=60)


def test_fairness_knob_one_serves_the_worst_rho_first():
    snap = auction_case()
    est = ThemisPolicy().estimate(snap)
    assert est.rho[0] > est.rho[1] and est.bid[0] < est.bid[1]
    assert running(schedule(snap, fairness_knob=1.0)) == {"waited"}
    assert running(schedule(snap, fairness_knob=0.5)) == {"waited"}  # ceil(0.5 x 2) = 1 bidder


def test_fairness_knob_zero_lets_everyone_bid_and_the_best_bid_per_gpu_wins():
    assert running(schedule(auction_case(), fairness_knob=0.0)) == {"fresh"}


def test_fair_share_ideal_does_not_favour_big_jobs():
    g1, g4 = rate("cifar10", 1), rate("cifar10", 4)
    jobs = [make_job("big", gpus=4, remaining=1000 * g4, submit=0), make_job("small", gpus=1, remaining=1000 * g1, submit=1)]
    snap = make_snapshot(make_nodes(1, 4), jobs, time=500)
    # Same dedicated running time and wait: with a 2-GPU fair share the 4-GPU job's ideal doubles.
    assert running(schedule(snap, fairness_knob=1.0)) == {"small"}
    # Dedicated ideal: the big job waited a second longer, so its rho is (slightly) worse.
    assert running(schedule(snap, fairness_knob=1.0, ideal="dedicated")) == {"big"}


def test_leftover_gpus_go_to_the_other_jobs():
    # Only the worst job bids (knob 1); the other GPUs still go out, worst rho first.
    jobs = [make_job(f"j{k}", remaining=1e6, submit=k) for k in range(5)]
    snap = make_snapshot(make_nodes(1, 4), jobs, time=10)
    est = ThemisPolicy(fairness_knob=1.0).estimate(snap)
    assert list(np.argsort(-est.rho)) == [0, 1, 2, 3, 4]
    assert running(schedule(snap, fairness_knob=1.0)) == {"j0", "j1", "j2", "j3"}


def test_a_running_job_bids_more_than_a_waiting_twin():
    jobs = [make_job("runner", remaining=1e6, submit=0), make_job("twin", remaining=1e6, submit=0)]
    snap = make_snapshot(make_nodes(1, 1), jobs, time=100, current={"runner": [("n0", (0,))]})
    est = ThemisPolicy().estimate(snap)
    assert est.bid[0] > est.bid[1] and est.rho[0] < est.rho[1]
    assert running(schedule(snap, fairness_knob=0.0)) == {"runner"}  # no restart: keeping it is the better deal
    assert running(schedule(snap, fairness_knob=1.0)) == {"twin"}  # the restart makes the twin's rho worse


@pytest.mark.parametrize("options", [{"fairness_knob": -0.1}, {"fairness_knob": 1.5}, {"ideal": "nope"}, {"keep_margin": -0.1}])
def test_rejects_bad_options(options):
    with pytest.raises(ValueError):
        ThemisPolicy(**options)
