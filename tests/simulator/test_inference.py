"""simulator.inference: inference rows, the task generator, and the replica lifecycle."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scheduler.deepboot.ats_i import InferenceDecision
from scheduler.deepboot.state import ReplicaState
from scheduler.policy import Allocation, Plan
from simulator.errors import SimulatorInputError
from simulator.inference import (
    ArrivalPattern,
    InferencePool,
    InferenceTask,
    LifecycleConfig,
    ProtectSchedule,
    Replica,
    ReplicaError,
    format_inference_rows,
    generate_inference_tasks,
    load_inference_tasks,
    model_of,
    parse_inference_tasks,
    write_inference_tasks,
)

# The DeepBoot artifact's mixed format: training rows carry duration 4.0 and num_task -1.
MIXED = """name,time,application,num_replicas,batch_size,duration,num_task
inference-ncf-2,33,infer-ncf-1,1,1,2.0,3271
inference-yolov3-1,19,infer-yolov3-1,1,1,7.0,530
cifar10-0,107,cifar10,6,2048,4.0,-1
inference-bert-5,58,infer-bert-2,1,1,4.5,4927
"""

RUNNING, PROTECT, SLEEP, END = ReplicaState.RUNNING, ReplicaState.PROTECT, ReplicaState.SLEEP, ReplicaState.END


# -- rows ----------------------------------------------------------------------------------------


def test_mixed_rows_give_the_inference_tasks_by_arrival():
    tasks = parse_inference_tasks(MIXED, "mixed.csv")
    assert tasks == (
        InferenceTask("inference-yolov3-1", 19.0, "infer-yolov3-1", 7.0, 1, 530),
        InferenceTask("inference-ncf-2", 33.0, "infer-ncf-1", 2.0, 1, 3271),
        InferenceTask("inference-bert-5", 58.0, "infer-bert-2", 4.5, 1, 4927),
    )
    assert [t.model for t in tasks] == ["yolov3", "ncf", "bert"]
    assert model_of("infer-my-model-12") == "my-model"


@pytest.mark.parametrize(
    ("row", "column"),
    [
        ("x,-1,infer-ncf-1,1,1,2.0,5", "time"),
        ("x,nan,infer-ncf-1,1,1,2.0,5", "time"),
        ("x,3,infer-ncf,1,1,2.0,5", "application"),
        ("x,3,infer-ncf-1,2,1,2.0,5", "num_replicas"),
        ("x,3,infer-ncf-1,1,0.5,2.0,5", "batch_size"),
        ("x,3,infer-ncf-1,1,1,0,5", "duration"),
        ("x,3,infer-ncf-1,1,1,inf,5", "duration"),
        ("x,3,infer-ncf-1,1,1,2.0,-1", "num_task"),
        (",3,infer-ncf-1,1,1,2.0,5", "name"),
        ("inference-ncf-2,3,infer-ncf-1,1,1,2.0,5", "name"),  # already defined in row 2
    ],
)
def test_bad_inference_rows_name_the_row_and_column(row, column):
    text = MIXED.splitlines()[0] + "\n" + MIXED.splitlines()[1] + "\n" + row + "\n"
    with pytest.raises(SimulatorInputError, match=f"w.csv: row 3, column '{column}'"):
        parse_inference_tasks(text, "w.csv")


def test_headers_and_short_rows():
    with pytest.raises(SimulatorInputError, match="lacks column 'application'"):
        parse_inference_tasks("name,time\nx,1\n")
    with pytest.raises(SimulatorInputError, match="row 2 is an inference task but the header lacks column 'duration'"):
        parse_inference_tasks("name,time,application,num_replicas,batch_size\nx,1,infer-ncf-1,1,1\n")
    with pytest.raises(SimulatorInputError, match="row 2: 3 fields, the header has 7"):
        parse_inference_tasks(MIXED.splitlines()[0] + "\nx,1,infer-ncf-1\n")
    # A Pollux-only workload simply has no inference tasks.
    assert parse_inference_tasks("name,time,application,num_replicas,batch_size\nj,0,cifar10,1,128\n") == ()


def test_rows_round_trip_through_a_file(tmp_path):
    tasks = parse_inference_tasks(MIXED)
    path = tmp_path / "out" / "tasks.csv"
    write_inference_tasks(tasks, path)
    assert path.read_text().splitlines()[1] == "inference-yolov3-1,19,infer-yolov3-1,1,1,7,530"
    assert load_inference_tasks(path) == tasks


# -- generator -----------------------------------------------------------------------------------


def test_generation_is_seeded():
    first = generate_inference_tasks(seed=7, horizon_s=600, pattern=ArrivalPattern("bursty", rate_per_s=0.2))
    assert first == generate_inference_tasks(seed=7, horizon_s=600, pattern=ArrivalPattern("bursty", rate_per_s=0.2))
    assert first != generate_inference_tasks(seed=8, horizon_s=600, pattern=ArrivalPattern("bursty", rate_per_s=0.2))
    assert parse_inference_tasks(format_inference_rows(first)) == first  # the rows it writes parse back
    assert all(1.0 <= t.duration_s <= 10.0 and 0 <= t.arrival_s < 600 for t in first)
    assert len({t.name for t in first}) == len(first)


def test_steady_arrivals_average_the_rate():
    # 0.5 tasks/s over 20,000 s: 10,000 expected, Poisson standard deviation 100.
    tasks = generate_inference_tasks(seed=1, horizon_s=20_000, pattern=ArrivalPattern("steady", rate_per_s=0.5))
    assert abs(len(tasks) - 10_000) < 400


def test_diurnal_arrivals_follow_the_sine():
    # rate(t) = 0.5 (1 + 0.8 sin(2 pi t / T)), T = horizon = 20,000 s. First half-period:
    # 0.5 (T/2 + 0.8 T / pi) = 0.5 (10,000 + 5,093) = 7,546 expected; second: 0.5 (10,000 - 5,093) = 2,454.
    pattern = ArrivalPattern("diurnal", rate_per_s=0.5, period_s=20_000, amplitude=0.8)
    times = np.array([t.arrival_s for t in generate_inference_tasks(seed=2, horizon_s=20_000, pattern=pattern)])
    assert abs((times < 10_000).sum() - 7_546) < 350
    assert abs((times >= 10_000).sum() - 2_454) < 200


def test_bursty_arrivals_keep_the_mean_but_cluster():
    pattern = ArrivalPattern("bursty", rate_per_s=0.5, burst_factor=10, burst_share=0.1, mean_burst_s=60)
    times = np.array([t.arrival_s for t in generate_inference_tasks(seed=3, horizon_s=100_000, pattern=pattern)])
    # Mean 0.5/s over 100,000 s: 50,000; phases of ~60 s (bursts) and ~540 s (calm) make the count
    # of a long run vary more than Poisson, hence the wider band.
    assert abs(times.size - 50_000) < 5_000
    # Per-minute counts: a Poisson process has variance = mean; bursts (10x busier) inflate it.
    counts = np.bincount((times // 60).astype(int))
    assert counts.var() > 3 * counts.mean()


def test_bad_generator_options():
    for bad in ({"kind": "weekly"}, {"amplitude": 1.5}, {"rate_per_s": 0.0}, {"burst_share": 1.0}):
        with pytest.raises(ValueError):
            ArrivalPattern(**bad)
    with pytest.raises(ValueError):
        generate_inference_tasks(seed=1, horizon_s=10, duration_s=(5.0, 1.0))


# -- lifecycle -----------------------------------------------------------------------------------


def test_protect_time_grows_with_reuse_up_to_the_cap():
    schedule = ProtectSchedule()
    assert [schedule.protect_s(k) for k in range(9)] == [30, 45, 60, 75, 90, 105, 120, 120, 120]
    assert ProtectSchedule(base_s=10, per_reuse_s=5, max_s=20).protect_s(3) == 20


def test_a_replica_runs_protects_sleeps_and_ends():
    config = LifecycleConfig(sleep_s=100.0)
    r = Replica("r", "infer-bert-1", "i0", 0, now=0.0, config=config)
    assert r.state(5.0) is RUNNING and r.next_change_s() == math.inf
    assert r.finish(10.0) == 40.0                    # 30 s protect after the first task
    assert r.state(39.9) is PROTECT
    assert r.state(40.0) is SLEEP and r.view(40.0).since_s == 40.0
    r.reuse(50.0)                                    # a sleeper is still warm
    assert r.reuses == 1 and r.state(50.0) is RUNNING
    assert r.finish(60.0) == 105.0                   # 30 + 15 x 1 reuse
    r.reuse(70.0)
    assert r.finish(80.0) == 140.0                   # 30 + 15 x 2
    assert r.state(240.0) is END                     # slept from 140 s for 100 s
    with pytest.raises(ReplicaError, match="cannot reuse a replica in state end"):
        r.reuse(241.0)
    with pytest.raises(ReplicaError, match="time went backwards"):
        r.state(1.0)


def test_protect_reaches_the_cap_after_six_reuses():
    r = Replica("r", "infer-ncf-1", "i0", 0, now=0.0, config=LifecycleConfig())
    protect = []
    now = 0.0
    for _ in range(8):
        until = r.finish(now + 1.0)
        protect.append(until - (now + 1.0))
        now += 2.0
        r.reuse(now)
    assert protect == [30, 45, 60, 75, 90, 105, 120, 120]


def test_illegal_transitions_raise():
    r = Replica("r", "infer-ncf-1", "i0", 0, now=0.0, config=LifecycleConfig())
    with pytest.raises(ReplicaError):
        r.reuse(1.0)   # running
    with pytest.raises(ReplicaError):
        r.end(1.0)     # running: a busy GPU is never taken
    r.finish(2.0)
    with pytest.raises(ReplicaError):
        r.finish(3.0)  # already finished
    with pytest.raises(ValueError):
        Replica("x", "bert", "i0", 0, now=0.0, config=LifecycleConfig())


def test_pool_applies_ats_i_decisions():
    pool = InferencePool(LifecycleConfig(cold_start_s={"bert": 8.0}, default_cold_start_s=6.0))
    bert = InferenceTask("t1", 0.0, "infer-bert-1", 4.0)
    replica_id, done = pool.start(InferenceDecision("infer-bert-1", "free", "i0", 1), bert, now=0.0)
    assert done == 8.0 + 4.0                         # cold start, then the task
    assert pool.busy(1.0) == {"i0": (1,)}
    assert pool.finish(replica_id, done) == 42.0     # protected 30 s
    assert pool.busy(41.0) == {"i0": (1,)}           # PROTECT keeps the GPU from training
    assert pool.busy(42.0) == {} and pool.views(42.0)[0].state is SLEEP
    assert pool.next_change_s() == math.inf          # sleeps until lent or evicted (sleep_s unlimited)
    # Reusing the warm replica costs no start-up.
    again, done = pool.start(InferenceDecision("infer-bert-1", "reuse", "i0", 1, replica_id=replica_id), bert, now=50.0)
    assert (again, done) == (replica_id, 54.0)
    pool.finish(replica_id, 54.0)                    # protected until 54 + 45 = 99
    # An ncf task evicts the sleeper (cold start 6 s, the default for models not in the table).
    ncf = InferenceTask("t2", 0.0, "infer-ncf-1", 1.0)
    other, done = pool.start(InferenceDecision("infer-ncf-1", "sleep", "i0", 1, replica_id=replica_id), ncf, now=100.0)
    assert done == 107.0 and [v.replica_id for v in pool.views(100.0)] == [other]
    with pytest.raises(ReplicaError, match="keep the task pending"):
        pool.start(InferenceDecision("infer-ncf-1", "wait"), ncf, now=100.0)


def test_sleepers_whose_gpu_is_lent_end():
    pool = InferencePool()
    task = InferenceTask("t", 0.0, "infer-ncf-1", 1.0)
    a, _ = pool.start(InferenceDecision(task.application, "free", "i0", 0), task, now=0.0)
    b, _ = pool.start(InferenceDecision(task.application, "free", "i0", 1), task, now=0.0)
    pool.finish(a, 10.0)                             # sleeps from 40 s
    pool.finish(b, 30.0)                             # still protected at 50 s
    plan = Plan({"job": Allocation(placement=(("i0", (0,)),))})
    assert pool.end_lent(plan, 50.0) == (a,)
    assert [(v.replica_id, v.state) for v in pool.views(50.0)] == [(b, PROTECT)]
