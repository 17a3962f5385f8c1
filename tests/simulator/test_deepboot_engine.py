"""DeepBoot in the engine: inference tasks beside training, lending, reclaims and resize costs."""

from __future__ import annotations

import json
import math

import pytest

from scheduler.deepboot.costs import AFE_RESIZE_S, FULL_RESTART_S
from scheduler.deepboot.state import ReplicaState
from scheduler.invariants import PlanViolation
from scheduler.policy import Allocation
from simulator import cluster_from_dict
from simulator.cli_options import parse_options as _parse_options
from simulator.engine import Simulator
from simulator.errors import SimulatorInputError
from simulator.inference import ArrivalPattern, InferenceTask, generate_inference_tasks, mixed_rows, parse_inference_tasks
from simulator.metrics import inference_summary, summary
from simulator.loading import load_workload
from simulator.workload import JobSpec, parse_workload, workload_from_jobs

MIXED_CLUSTER = {"nodes": [{"count": 1, "gpus": 4}, {"count": 2, "gpus": 2, "pool": "inference"}]}
JOBS = (
    JobSpec("cifar-a", "cifar10", 0.0, 2, 512),
    JobSpec("ncf-b", "ncf", 30.0, 1, 1024),
    JobSpec("cifar-c", "cifar10", 200.0, 4, 512),
)


def _tasks(seed: int = 3, horizon: float = 2400.0) -> tuple[InferenceTask, ...]:
    pattern = ArrivalPattern("bursty", rate_per_s=0.03, mean_burst_s=60, burst_factor=20)
    return generate_inference_tasks(seed=seed, horizon_s=horizon, pattern=pattern, models=("bert", "ncf", "cifar10"))


def _holders(sim: Simulator, now: float) -> dict[tuple[str, int], list[str]]:
    """Computed here from the engine's state, independently of its own check."""
    held: dict[tuple[str, int], list[str]] = {}
    for job in sim._active:
        if job.allocation is not None:
            for node, indices in job.allocation.placement:
                for i in indices:
                    held.setdefault((node, i), []).append(job.spec.name)
    for view in sim._pool.views(now):
        held.setdefault((view.node, view.gpu), []).append(view.replica_id)
    return held


def _run_checking_every_step(sim: Simulator) -> dict[str, int]:
    inference = {(n.name, i) for n in sim.cluster.nodes if n.pool == "inference" for i in range(n.gpus)}
    seen = {"lent_peak": 0, "queued_steps": 0}
    while sim.step():
        now = sim.now
        doubled = {gpu: who for gpu, who in _holders(sim, now).items() if len(who) > 1}
        assert not doubled, f"t={now}: {doubled}"
        lent = sum(1 for gpu, who in _holders(sim, now).items() if gpu in inference and not who[0].startswith("infer-"))
        seen["lent_peak"] = max(seen["lent_peak"], lent)
        if sim._queue:  # a task waits only when every inference GPU is RUNNING (idle PROTECT replicas give way)
            seen["queued_steps"] += 1
            held = {(v.node, v.gpu) for v in sim._pool.views(now) if v.state is ReplicaState.RUNNING}
            assert inference <= held, f"t={now}: {len(sim._queue)} tasks queued with lendable inference GPUs"
    return seen


def test_deepboot_lends_reclaims_and_never_double_books():
    tasks = _tasks()
    sim = Simulator(workload_from_jobs(JOBS), "deepboot", cluster_from_dict(MIXED_CLUSTER), inference_tasks=tasks)
    seen = _run_checking_every_step(sim)
    result = sim.result()
    assert len(result.jobs) == len(JOBS) and len(result.inference) == len(tasks)
    # The scenario exercised lending and taking GPUs back.
    assert seen["lent_peak"] > 0 and result.lent_gpu_s > 0 and result.reclaims > 0
    kinds = {r.kind for r in result.inference}
    assert {"reuse", "reclaim", "evict"} <= kinds  # evict: another model's idle PROTECT replica, not a wait
    assert max(r.wait_s for r in result.inference) == 0.0
    for record in result.inference:
        assert record.start_s >= record.arrival_s and record.finish_s > record.ready_s >= record.start_s
        assert record.cold_start == (record.kind != "reuse")
    by_name = {t.name: t for t in tasks}
    for record in result.inference:  # a cold start pays the model's start-up, a reuse none
        cold = sim._pool.config.cold_start(record.application) if record.cold_start else 0.0
        assert record.ready_s - record.start_s == pytest.approx(cold)
        assert record.finish_s - record.ready_s == pytest.approx(by_name[record.name].duration_s)
    # Every first start is a full start; reclaims leave survivors, so they are AFE resizes.
    assert set(result.restart_charges) == {"afe", "full"} and result.restart_charges["full"][0] >= len(JOBS)
    assert result.restart_charges["afe"][0] > 0
    s = summary(result)
    assert s["inference"]["tasks"] == len(tasks) and s["inference"]["reclaims"] == result.reclaims
    assert 0 < s["inference"]["cold_start_share"] < 1


def test_without_lending_training_stays_on_its_pool_and_inference_never_waits_behind_it():
    for policy, options in (("deepboot", {"lend": False}), ("pollux", {})):
        sim = Simulator(workload_from_jobs(JOBS), policy, cluster_from_dict(MIXED_CLUSTER), inference_tasks=_tasks(),
                        policy_options=options)
        _run_checking_every_step(sim)
        result = sim.result()
        assert result.lent_gpu_s == 0 and result.reclaims == 0, policy
        assert all(r.kind != "reclaim" for r in result.inference)
        assert all(p.lent_gpus == 0 for p in result.timeline)


def test_lending_shortens_training_on_a_quiet_inference_pool():
    tasks = (InferenceTask("one", 10.0, "infer-ncf-1", 5.0),)  # one short task: the pool is idle almost all the time
    cluster = cluster_from_dict(MIXED_CLUSTER)
    lend = Simulator(workload_from_jobs(JOBS), "deepboot", cluster, inference_tasks=tasks).run()
    alone = Simulator(workload_from_jobs(JOBS), "deepboot", cluster, inference_tasks=tasks, policy_options={"lend": False}).run()
    avg = lambda r: sum(j.jct_s for j in r.jobs) / len(r.jobs)  # noqa: E731
    assert lend.lent_gpu_s > 0 and avg(lend) < avg(alone)


def test_resize_costs_come_from_the_policy():
    cluster = cluster_from_dict(MIXED_CLUSTER)
    old = Allocation(placement=(("node-00", (0, 1)),))
    grown = Allocation(placement=(("node-00", (0, 1, 2)),))
    moved = Allocation(placement=(("node-01", (0, 1)),))

    def cost(policy, options, before, after):
        sim = Simulator(workload_from_jobs(JOBS), policy, cluster, policy_options=options)
        job = sim._jobs[0]  # cifar10
        job.allocation = before
        return sim._resize_cost(job, job.info(), after)

    assert cost("deepboot", {}, old, grown) == AFE_RESIZE_S["cifar10"]        # survivors keep running: AFE
    assert cost("deepboot", {}, old, moved) == FULL_RESTART_S["cifar10"]      # nothing kept: full restart
    assert cost("deepboot", {}, None, old) == FULL_RESTART_S["cifar10"]       # first start
    assert cost("deepboot", {"afe": False}, old, grown) == FULL_RESTART_S["cifar10"]
    assert cost("pollux", {}, old, grown) == cluster.restart_cost_s           # no costs: the cluster's restart cost


def test_protect_scale_and_input_errors():
    cluster = cluster_from_dict(MIXED_CLUSTER)
    sim = Simulator(workload_from_jobs(JOBS), "deepboot", cluster, inference_tasks=_tasks(), protect_scale=0.0)
    assert sim._pool.config.protect.protect_s(5) == 0.0
    result = sim.run()
    assert result.protect_scale == 0.0 and len(result.inference) == len(_tasks())
    assert Simulator(workload_from_jobs(JOBS), "deepboot", cluster, protect_scale=2.0)._pool.config.protect.protect_s(0) == 60.0
    with pytest.raises(SimulatorInputError, match="--inference-protect-scale"):
        Simulator(workload_from_jobs(JOBS), "deepboot", cluster, protect_scale=-1.0)
    with pytest.raises(SimulatorInputError, match="no inference-pool nodes"):
        Simulator(workload_from_jobs(JOBS), "deepboot", cluster_from_dict({"nodes": 2}), inference_tasks=_tasks())
    with pytest.raises(SimulatorInputError, match=r"nodes\[1\]' field 'pool'"):
        cluster_from_dict({"nodes": [{"gpus": 4}, {"gpus": 4, "pool": "serving"}]})


def test_engine_refuses_a_double_booked_gpu():
    sim = Simulator(workload_from_jobs(JOBS), "deepboot", cluster_from_dict(MIXED_CLUSTER), inference_tasks=_tasks())
    while not sim._serving:
        sim.step()
    replica = sim._pool.views(sim.now)[0]
    sim._active[0].allocation = Allocation(placement=((replica.node, (replica.gpu,)),))
    with pytest.raises(PlanViolation, match=f"GPU {replica.node}/{replica.gpu} held by both"):
        sim._check_gpus(sim.now)


def test_mixed_csv_round_trips_training_and_inference_rows(tmp_path):
    tasks = _tasks(horizon=600)
    text = mixed_rows(JOBS, tasks)
    assert parse_workload(text, "m.csv") == JOBS
    assert parse_inference_tasks(text, "m.csv") == tasks
    path = tmp_path / "m.csv"
    path.write_text(text)
    workload = load_workload(path)
    assert workload.jobs == JOBS and workload.inference == tasks
    assert load_workload("workload-1").inference == ()  # Pollux workloads have no inference rows


def test_set_false_is_a_boolean_and_summary_without_inference_has_no_inference_block():
    assert _parse_options(["deepboot.lend=false", "deepboot.afe=False"], ["deepboot"]) == {"deepboot": {"lend": False, "afe": False}}
    result = Simulator(workload_from_jobs(JOBS[:1]), "fifo", cluster_from_dict({"nodes": 1})).run()
    assert inference_summary(result) == {} and "inference" not in summary(result)
    assert math.isfinite(summary(result)["avg_jct_s"])


def test_cli_mix_then_run_deepboot_writes_inference_outputs(tmp_path, capsys):
    from silod.cli.main import main

    training = tmp_path / "train.csv"
    training.write_text("name,time,application,num_replicas,batch_size\n"
                        "cifar-a,0,cifar10,2,512\nncf-b,30,ncf,1,1024\n")
    mixed = tmp_path / "mixed.csv"
    assert main(["simulate", "mix", "--workload", str(training), "--pattern", "bursty", "--rate", "0.02",
                 "--horizon-s", "1200", "--seed", "4", "--out", str(mixed)]) == 0
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes:\n  - {count: 1, gpus: 4}\n  - {count: 1, gpus: 2, pool: inference}\n")
    out = tmp_path / "out"
    assert main(["simulate", "--workload", str(mixed), "--policy", "deepboot", "--set", "deepboot.afe=false",
                 "--inference-protect-scale", "0.5", "--cluster", str(cluster), "--out", str(out), "--no-plots"]) == 0
    data = json.loads((out / "summary.json").read_text())
    tasks = load_workload(mixed).inference
    assert data["policy_options"]["afe"] is False and data["inference"]["protect_scale"] == 0.5
    assert data["inference"]["tasks"] == len(tasks) > 0
    rows = (out / "inference.csv").read_text().splitlines()
    assert len(rows) == len(tasks) + 1 and rows[0].startswith("name,application,arrival_s")
    assert "inference:" in capsys.readouterr().out
    both = tmp_path / "both"
    assert main(["simulate", "compare", "--workload", str(mixed), "--policy", "deepboot,pollux", "--cluster", str(cluster),
                 "--out", str(both), "--no-plots", "--quiet"]) == 0
    table = (both / "compare.md").read_text()
    assert "inf. wait p99 (s)" in table and "cold starts" in table
    assert all("inference" in p for p in json.loads((both / "compare.json").read_text())["policies"].values())
