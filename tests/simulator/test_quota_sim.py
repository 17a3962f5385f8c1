"""Tenant quotas in the simulator: the owner's returning demand takes its share back in the
round it arrives; ``--tenant-quotas`` reads a file and names the field of a bad one."""

from __future__ import annotations

from pathlib import Path

from scheduler.quotas import TenantQuota, usage
from silod.cli.main import main
from simulator.cluster import cluster_from_dict
from simulator.engine import Simulator
from simulator.tenant_quotas import load_quotas
from simulator.workload import parse_workload

# Tenant b fills the cluster at t=0; tenant a (4 of the 8 GPUs nominal) arrives at t=300.
WORKLOAD = (
    "name,time,application,num_replicas,batch_size,tenant\n"
    "b-0,0,cifar10,4,512,b\nb-1,0,cifar10,4,512,b\n"
    "a-0,300,cifar10,2,256,a\na-1,300,cifar10,2,256,a\n"
)


def test_the_owner_is_served_in_the_round_its_demand_returns():
    jobs = parse_workload(WORKLOAD)
    assert {j.tenant for j in jobs} == {"a", "b"}
    rounds = []
    sim = Simulator(jobs, "fifo", cluster_from_dict({"nodes": 2, "gpus_per_node": 4, "interval_s": 60.0}),
                    quotas={"a": TenantQuota(gpus={"": 4})}, on_round=lambda s, p: rounds.append((s.time_s, usage(s, p))))
    result = sim.run()
    before = [u for t, u in rounds if t < 300]
    assert before and all(u.get("b") == 8 for u in before)  # a's idle quota lent to b
    first = next(u for t, u in rounds if t >= 300)
    assert first.get("a") == 4 and first.get("b") == 4  # the first round after a arrives
    jcts = {j.name: j for j in result.jobs}
    assert sorted(jcts[b].restarts for b in ("b-0", "b-1")) == [0, 1]  # one borrower preempted, resumed later
    assert jcts["a-0"].tenant == "a"


def test_no_quota_run_is_fifo_itself():
    jobs = parse_workload(WORKLOAD)
    cluster = cluster_from_dict({"nodes": 2, "gpus_per_node": 4, "interval_s": 60.0})
    plain = Simulator(jobs, "fifo", cluster).run()
    assert all(j.restarts == 0 for j in plain.jobs)  # FIFO never preempts: a waits for b


def test_cli_reads_quotas_and_names_bad_fields(tmp_path: Path, capsys):
    workload = tmp_path / "w.csv"
    workload.write_text(WORKLOAD)
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes: 2\ngpus_per_node: 4\n")
    quotas = tmp_path / "q.yaml"
    quotas.write_text("tenants:\n  a: {gpus: 4, remote_io_share: 0.5}\n  b: {gpus: {v100: 2}, lending_limit_gpus: 1}\n")
    assert load_quotas(quotas)["a"] == TenantQuota(gpus={"": 4}, remote_io_share=0.5)
    assert load_quotas(quotas)["b"].gpus == {"v100": 2}
    out = tmp_path / "out"
    args = ["simulate", "run", "--workload", str(workload), "--policy", "fifo", "--cluster", str(cluster),
            "--out", str(out), "--no-plots", "--quiet", "--tenant-quotas"]
    assert main(args + [str(quotas)]) == 0
    assert (out / "summary.json").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  a: {gpus: -1}\n")
    assert main(args + [str(bad)]) != 0
    assert "tenants.a.gpus" in capsys.readouterr().err
    bad.write_text("tenants:\n  a: {gpu: 4}\n")
    assert main(args + [str(bad)]) != 0
    assert "tenants.a.gpu: unknown field" in capsys.readouterr().err
