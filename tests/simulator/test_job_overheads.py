"""Measured launch and finish times (a profile's overheads.csv) in the engine.

The engine is given a job's overheads directly (``_Job.overheads``) so the arithmetic is exact;
the packaged digits profile's own file is read through ``read_overheads`` as the simulator does.
"""

from __future__ import annotations

import pytest

from estimator.profiles.loading import JobOverheads, read_overheads
from simulator import Simulator, cluster_from_dict, target_samples
from tests.simulator.conftest import Scripted, goodput, job, on

REL = 1e-9
MEASURED = JobOverheads(num_replicas=(1, 2), launch_s=(5.0, 9.0), finish_s=(2.0, 3.0))


def _with_overheads(sim: Simulator, overheads: JobOverheads | None = MEASURED) -> Simulator:
    for j in sim._jobs:
        j.overheads = overheads
    return sim


def test_overheads_interpolate_between_world_sizes_and_hold_beyond():
    assert MEASURED.launch(1) == 5.0 and MEASURED.finish(2) == 3.0
    assert MEASURED.launch(4) == 9.0  # beyond the largest measured world size: the largest
    table = JobOverheads(num_replicas=(1, 3), launch_s=(4.0, 8.0), finish_s=(1.0, 1.0))
    assert table.launch(2) == pytest.approx(6.0)


def test_a_job_pays_its_launch_at_its_world_size_and_holds_its_gpus_for_its_finish(two_nodes):
    policy = Scripted(lambda snap: {j.job_id: on("node-00", 0, 1) for j in snap.jobs})
    sim = _with_overheads(Simulator([job("a", 0, gpus=2)], policy, two_nodes))
    result = sim.run()
    (record,) = result.jobs
    work = target_samples("cifar10") / goodput("cifar10", 2, 1, 512)
    assert record.finish_s == pytest.approx(9.0 + work + 3.0, rel=REL)  # launch(2) + steps + finish(2), not 30 s
    assert record.attained_gpu_s == pytest.approx(2 * record.finish_s, rel=REL)  # GPUs held through the tail
    assert result.restart_charges == {"launch": [1, 9.0]}


def test_the_next_job_starts_only_when_the_finish_tail_ends():
    one_gpu = cluster_from_dict({"nodes": 1, "gpus_per_node": 1, "schedule_on_events": True})

    def one_at_a_time(snap):
        holder = next((j.job_id for j in snap.jobs if snap.current.gpus_of(j.job_id)), None)
        return {holder or snap.jobs[0].job_id: on("node-00", 0)}

    policy = Scripted(one_at_a_time)
    sim = _with_overheads(Simulator([job("a", 0, gpus=1), job("b", 1, gpus=1)], policy, one_gpu))
    a, b = sim.run().jobs
    work = target_samples("cifar10") / goodput("cifar10", 1, 1, 512)
    assert a.finish_s == pytest.approx(5.0 + work + 2.0, rel=REL)
    assert b.start_s == pytest.approx(a.finish_s, rel=REL)
    # During the tail the policy saw job a with all its samples done, as the live scheduler would.
    tail = [s for s in policy.seen if a.finish_s - 2.0 < s.time_s < a.finish_s]
    assert all(next(j for j in s.jobs if j.job_id == "a").samples_done == pytest.approx(a.target_samples) for s in tail)


def test_a_job_preempted_in_its_tail_relaunches_and_then_finishes(two_nodes):
    work = target_samples("cifar10") / goodput("cifar10", 1, 1, 512)
    done_at = 5.0 + work
    # The rounds are 60 s apart: pick the first round inside the 2 s tail by making the tail long.
    long_tail = JobOverheads(num_replicas=(1,), launch_s=(5.0,), finish_s=(100.0,))
    drop_at = (int(done_at // 60) + 1) * 60.0  # the first round after the last step: job still finishing

    def drop_once(snap):
        return {} if snap.time_s == drop_at else {j.job_id: on("node-00", 0) for j in snap.jobs}

    sim = _with_overheads(Simulator([job("a", 0, gpus=1)], Scripted(drop_once), two_nodes), long_tail)
    (record,) = sim.run().jobs
    assert record.restarts == 1
    # Placed again at the next round, it relaunches and then runs its whole finish tail again.
    assert record.finish_s == pytest.approx(drop_at + 60.0 + 5.0 + 100.0, rel=REL)


def test_job_overheads_off_keeps_the_fixed_restart_cost(two_nodes):
    off = cluster_from_dict({"nodes": 2, "gpus_per_node": 4, "job_overheads": False, "restart_cost_s": 30})
    assert off.job_overheads is False and two_nodes.job_overheads is True
    sim = Simulator([job("a", 0, application="digits", gpus=1, batch=32)],
                    Scripted(lambda snap: {j.job_id: on("node-00", 0) for j in snap.jobs}), off)
    assert all(j.overheads is None for j in sim._jobs)
    result = sim.run()
    assert result.restart_charges == {"fixed": [1, 30.0]}


def test_profiles_without_overheads_read_none_and_the_digits_profile_has_them():
    assert read_overheads("cifar10") is None
    digits = read_overheads("digits")  # measured by benchmarks/profile_ddp_digits.py
    assert digits is not None and digits.num_replicas == (1, 2)
    assert all(0 < s < 60 for s in digits.launch_s + digits.finish_s)
    with pytest.raises(Exception, match="job_overheads"):
        cluster_from_dict({"job_overheads": "yes"})
