"""The event-driven engine on hand-built workloads: exact JCTs, clock, restarts, guards."""

from __future__ import annotations

import inspect
import math

import pytest

from scheduler.invariants import PlanViolation
from simulator import SimClock, SimulationStuck, Simulator, cluster_from_dict, target_samples
from simulator import engine as engine_module
from tests.simulator.conftest import Scripted, goodput, job, on

REL = 1e-9


def test_one_job_alone_finishes_at_round_plus_restart_plus_target_over_goodput(two_nodes):
    # Arrives at 53 s; the first round after that is at 60 s; 30 s restart; then target / goodput.
    policy = Scripted(lambda snap: {j.job_id: on("node-00", 0, 1, 2, 3) for j in snap.jobs})
    result = Simulator([job("a", 53, gpus=4, batch=512)], policy, two_nodes).run()
    (record,) = result.jobs
    rate = goodput("cifar10", 4, 1, 512)
    expected_finish = 60.0 + 30.0 + target_samples("cifar10") / rate
    assert record.start_s == 60.0
    assert record.finish_s == pytest.approx(expected_finish, rel=REL)
    assert record.jct_s == pytest.approx(expected_finish - 53.0, rel=REL)
    assert record.restarts == 0
    assert record.attained_gpu_s == pytest.approx(4 * (expected_finish - 60.0), rel=REL)
    assert record.mean_gpus == pytest.approx(4.0)
    # Alone with its requested GPUs, packed: the isolated JCT is restart + target / goodput.
    assert record.isolated_jct_s == pytest.approx(30.0 + target_samples("cifar10") / rate, rel=REL)


def test_target_is_the_artifact_completion_progress_in_samples():
    # cifar10: 100 epochs x 50,000 images at batch 128 -> the trace's progress at epoch 100 x 128.
    assert target_samples("cifar10") == pytest.approx(128 * 39062.9, rel=1e-5)
    assert target_samples("imagenet") / 90 == pytest.approx(1_281_167, rel=1e-5)
    assert target_samples("bert") == 12 * 14774.0


def test_injected_clock_offsets_every_time_and_policies_see_round_times(two_nodes):
    policy = Scripted(lambda snap: {j.job_id: on("node-00", 0, 1) for j in snap.jobs})
    base = Simulator([job("a", 10, gpus=2)], Scripted(policy.decide), two_nodes).run()
    clock = SimClock(start_s=1_000_000.0)
    shifted = Simulator([job("a", 10, gpus=2)], policy, two_nodes, clock=clock).run()
    assert shifted.jobs[0].arrival_s == 1_000_010.0
    assert shifted.jobs[0].finish_s == pytest.approx(base.jobs[0].finish_s + 1_000_000.0, rel=REL)
    assert shifted.jobs[0].jct_s == pytest.approx(base.jobs[0].jct_s, rel=1e-7)
    assert clock.now() == shifted.jobs[0].finish_s  # the run ends at the last completion
    times = [snap.time_s for snap in policy.seen]
    assert times[0] == 1_000_060.0
    assert all((t - 1_000_000.0) % 60.0 == 0 for t in times)
    assert times == sorted(set(times))


def test_engine_reads_no_wall_clock():
    source = inspect.getsource(engine_module)
    assert "import time" not in source and "time.time" not in source and "sleep(" not in source


def test_clock_refuses_to_go_back():
    clock = SimClock(5.0)
    clock.advance_to(7.5)
    with pytest.raises(ValueError):
        clock.advance_to(7.0)


def test_moving_a_job_costs_one_restart_and_exactly_the_restart_time(two_nodes):
    def moving(snap):
        node = "node-00" if snap.time_s < 300 else "node-01"  # move once, at the 300 s round
        return {j.job_id: on(node, 0, 1, 2, 3) for j in snap.jobs}

    staying = Simulator([job("a", 0)], Scripted(lambda s: {j.job_id: on("node-00", 0, 1, 2, 3) for j in s.jobs}), two_nodes).run()
    moved = Simulator([job("a", 0)], Scripted(moving), two_nodes).run()
    assert staying.jobs[0].restarts == 0 and moved.jobs[0].restarts == 1
    assert moved.jobs[0].finish_s - staying.jobs[0].finish_s == pytest.approx(30.0, rel=1e-7)
    # GPUs are held (and counted) during the restart too.
    assert moved.jobs[0].attained_gpu_s == pytest.approx(4 * (moved.jobs[0].finish_s - moved.jobs[0].start_s), rel=REL)


def test_same_gpus_in_a_new_plan_is_not_a_restart(two_nodes):
    rounds = []

    def same(snap):
        rounds.append(snap.time_s)
        return {j.job_id: on("node-00", 0, 1, 2, 3) for j in snap.jobs}

    result = Simulator([job("a", 0)], Scripted(same), two_nodes).run()
    assert len(rounds) > 10 and result.jobs[0].restarts == 0


def test_preempted_job_keeps_its_progress_and_pays_the_restart_again(two_nodes):
    rate = goodput("cifar10", 4, 1, 512)

    def preempt(snap):  # held from 0, dropped at 120, back at 240
        return {} if 120 <= snap.time_s < 240 else {j.job_id: on("node-00", 0, 1, 2, 3) for j in snap.jobs}

    result = Simulator([job("a", 0)], Scripted(preempt), two_nodes).run()
    record = result.jobs[0]
    # Work: [30, 120) and [270, finish): total = target / rate.
    expected = 270.0 + target_samples("cifar10") / rate - 90.0
    assert record.finish_s == pytest.approx(expected, rel=REL)
    assert record.restarts == 1
    assert record.attained_gpu_s == pytest.approx(4 * (120.0 + record.finish_s - 240.0), rel=REL)


def test_rate_changes_with_a_resize_mid_run(two_nodes):
    small, large = goodput("cifar10", 2, 1, 512), goodput("cifar10", 4, 1, 512)

    def grow(snap):
        return {j.job_id: (on("node-00", 0, 1) if snap.time_s < 600 else on("node-00", 0, 1, 2, 3)) for j in snap.jobs}

    record = Simulator([job("a", 0, gpus=2)], Scripted(grow), two_nodes).run().jobs[0]
    done_before = small * (600.0 - 30.0)
    expected = 630.0 + (target_samples("cifar10") - done_before) / large
    assert record.finish_s == pytest.approx(expected, rel=REL)
    assert record.restarts == 1


def test_completion_frees_gpus_for_the_next_round_or_at_once_on_events():
    jobs = [job("a", 0, gpus=4), job("b", 1, gpus=4)]
    rate = goodput("cifar10", 4, 1, 512)

    def first_come(snap):
        holder = next((j.job_id for j in snap.jobs if snap.current.gpus_of(j.job_id)), None)
        chosen = holder or snap.jobs[0].job_id
        return {chosen: on("node-00", 0, 1, 2, 3)}

    one_node = cluster_from_dict({"nodes": 1})
    rounds = Simulator(jobs, Scripted(first_come), one_node).run()
    a, b = rounds.jobs
    assert a.finish_s == pytest.approx(30.0 + target_samples("cifar10") / rate, rel=REL)
    assert b.start_s == math.ceil(a.finish_s / 60.0) * 60.0  # waits for the next regular round
    eager = Simulator(jobs, Scripted(first_come), cluster_from_dict({"nodes": 1, "schedule_on_events": True})).run()
    assert eager.jobs[1].start_s == pytest.approx(eager.jobs[0].finish_s, rel=REL)


def test_idle_gaps_skip_rounds_and_resume_on_the_next_tick(two_nodes):
    policy = Scripted(lambda snap: {j.job_id: on("node-00", 0, 1, 2, 3) for j in snap.jobs})
    result = Simulator([job("a", 0, application="ncf", gpus=1, batch=32768), job("b", 100_000, application="ncf", gpus=1, batch=32768)],
                       policy, two_nodes).run()
    assert result.jobs[1].start_s == 100_020.0  # 100,000 is not a multiple of 60; the next tick is
    assert all(len(snap.jobs) > 0 for snap in policy.seen)  # no rounds while the cluster is empty
    assert result.rounds == len(policy.seen) < 200


def test_a_policy_that_never_places_a_job_is_reported_stuck():
    cluster = cluster_from_dict({"nodes": 1, "stall_timeout_s": 3600})
    with pytest.raises(SimulationStuck, match=r"scripted: no job progressed .*unfinished: a \(needs 1-4 GPUs, holds 0"):
        Simulator([job("a", 0)], Scripted(lambda snap: {}), cluster).run()


def test_a_plan_that_double_books_a_gpu_is_rejected(two_nodes):
    policy = Scripted(lambda snap: {j.job_id: on("node-00", 0, 1) for j in snap.jobs})
    with pytest.raises(PlanViolation, match="GPU node-00:0 already held by"):
        Simulator([job("a", 0, gpus=2), job("b", 0, gpus=2)], policy, two_nodes).run()


def test_a_plan_beyond_a_jobs_max_gpus_is_rejected():
    # ncf's batch limits allow up to 64 GPUs, but max_gpus_per_job caps it at 2.
    cluster = cluster_from_dict({"nodes": 1, "max_gpus_per_job": 2})
    policy = Scripted(lambda snap: {j.job_id: on("node-00", 0, 1, 2) for j in snap.jobs})
    with pytest.raises(PlanViolation, match=r"3 GPUs outside \[1, 2\]"):
        Simulator([job("a", 0, application="ncf", gpus=1, batch=32768)], policy, cluster).run()


def test_gpu_seconds_in_the_timeline_match_the_jobs(two_nodes):
    from simulator import simulate

    policy = Scripted(lambda snap: {j.job_id: on(f"node-0{i % 2}", 0, 1) for i, j in enumerate(snap.jobs[:2])})
    result = simulate([job("a", 0, gpus=2), job("b", 30, gpus=2), job("c", 200, gpus=2)], policy, two_nodes)
    timeline = result.timeline
    integral = sum(p.allocated_gpus * (q.time_s - p.time_s) for p, q in zip(timeline, timeline[1:]))
    assert integral == pytest.approx(sum(j.attained_gpu_s for j in result.jobs), rel=1e-9)
    assert timeline[-1].allocated_gpus == 0 and timeline[-1].active_jobs == 0
    assert result.wall_time_s > 0
