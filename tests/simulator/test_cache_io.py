"""Cache and remote IO in the simulator: the cluster fields, the rate model by hand, and
co-designed (--cache silod) runs whose every plan keeps quotas and IO within capacity."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from estimator.job_model import JobModel
from estimator.predict import predict_one
from scheduler.invariants import check_plan
from scheduler.policy import Allocation, JobInfo
from scheduler.registry import get_policy
from silod.cli.main import main
from simulator import Simulator, SimulatorInputError, cluster_from_dict, load_cluster, target_samples
from simulator.cacheio import CacheIoRates
from simulator.rates import GoodputRates
from tests.simulator.conftest import job


# --- the cluster spec --------------------------------------------------------------------


def test_defaults_are_gpu_only():
    spec = cluster_from_dict({})
    assert spec.storage_bandwidth_bytes_per_s == math.inf and not spec.io_limited
    assert all(n.cache_capacity_bytes == 0 and n.nic_bytes_per_s == math.inf for n in spec.nodes)


def test_cache_and_io_fields_with_units(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "nodes:\n  - {count: 2, gpus: 4}\n  - {name: big, gpus: 8, cache_bytes: 1 TB, nic_bytes_per_s: 2e9}\n"
        "cache_bytes_per_node: 8 GB\nstorage_bandwidth_bytes_per_s: 200 MB/s\nnic_bytes_per_s: 1.25e9\n"
    )
    spec = load_cluster(path)
    assert [n.cache_capacity_bytes for n in spec.nodes] == [8e9, 8e9, 1e12]
    assert [n.nic_bytes_per_s for n in spec.nodes] == [1.25e9, 1.25e9, 2e9]
    assert spec.storage_bandwidth_bytes_per_s == 2e8 and spec.io_limited
    assert spec.total_cache_bytes == 8e9 + 8e9 + 1e12


@pytest.mark.parametrize("data, name", [
    ({"cache_bytes_per_node": -1}, "cache_bytes_per_node"),
    ({"cache_bytes_per_node": "lots"}, "cache_bytes_per_node"),
    ({"storage_bandwidth_bytes_per_s": 0}, "storage_bandwidth_bytes_per_s"),
    ({"nic_bytes_per_s": -5}, "nic_bytes_per_s"),
    ({"nodes": [{"gpus": 4, "cache_bytes": ".inf"}]}, "cache_bytes"),
])
def test_bad_cache_fields_are_named(data, name):
    with pytest.raises(SimulatorInputError, match=name):
        cluster_from_dict(data)


# --- the rate model by hand --------------------------------------------------------------

D, S = 1e9, 1e5          # a 1 GB dataset of 100 kB samples
CAPACITY, BUDGET = 4e8, 1e6


def _info(name: str, model: JobModel, dataset: str = "ds") -> JobInfo:
    return JobInfo(job_id=name, model=model, submit_time_s=0, min_gpus=1, max_gpus=4, target_samples=1e9,
                   batch_size=128, dataset=dataset)


def _on(node: str, *gpus: int) -> Allocation:
    return Allocation(placement=((node, tuple(gpus)),))


def _compute(model: JobModel) -> tuple[float, float]:
    p = predict_one(model, 1, 1, 0, math.inf, 128)
    return float(p.compute_samples_per_s[0]), float(p.statistical_efficiency[0])


def _world(mode: str, budget: float = BUDGET):
    nodes = cluster_from_dict({"nodes": 2, "gpus_per_node": 4, "cache_bytes_per_node": CAPACITY}).nodes
    return CacheIoRates(mode, nodes, budget, gpus_per_node=4)


def test_none_with_unlimited_io_is_the_gpu_only_rate():
    models = [JobModel.from_profile(a) for a in ("cifar10", "imagenet", "ncf")]
    jobs = [_info(f"j{k}", m, m.application) for k, m in enumerate(models)]
    allocations = [_on("node-00", 0), _on("node-00", 1, 2), _on("node-01", 0, 1, 2, 3)]
    gpu_only = GoodputRates(models, gpus_per_node=4).rates(jobs, allocations)
    assert np.array_equal(_world("none", math.inf).rates(jobs, allocations), gpu_only)


def test_fixed_subset_cache_fills_at_the_io_rate_and_raises_the_hit_ratio():
    model = JobModel.from_profile("cifar10").with_dataset(D, S)
    t, eff = _compute(model)
    assert t * S > BUDGET  # IO-bound: b* = T s is far above the 1 MB/s budget
    world = _world("static")
    jobs, allocs = [_info("a", model)], [_on("node-00", 0)]
    # Cold: no hits, the whole budget feeds B / s samples/s.
    assert world.rates(jobs, allocs)[0] == pytest.approx(BUDGET / S * eff)
    world.advance({"a": 100.0})  # 100 s at 1 MB/s of misses: 100 MB admitted (target min(4e8, d))
    assert world.cached_bytes() == {("node-00", "ds"): pytest.approx(1e8)}
    # Still in its first epoch (1,000 of 10,000 samples): it has read what it cached, no hits yet...
    assert world.rates(jobs, allocs)[0] == pytest.approx(BUDGET / S * eff)
    # ... while a job joining it on the dataset hits what the first one cached: h = 0.1.
    both = world.rates(jobs + [_info("b", model)], allocs + [_on("node-00", 1)])
    assert both[1] == pytest.approx(BUDGET / 2 / (S * 0.9) * eff)
    world.rates(jobs, allocs)
    world.advance({"a": 1000.0})  # would admit 1 GB more, but the node holds 400 MB (the static share)
    assert world.cached_bytes() == {("node-00", "ds"): pytest.approx(CAPACITY)}
    # Its second epoch began at 1,000 s (all 400 MB cached by then): h = 0.4.
    assert world.rates(jobs, allocs)[0] == pytest.approx(BUDGET / (S * 0.6) * eff)
    assert world.bytes_read == pytest.approx(BUDGET * 1100.0)
    # Moved to the other node: the cache stays behind, the job reads everything remotely again.
    assert world.rates(jobs, [_on("node-01", 0)])[0] == pytest.approx(BUDGET / S * eff)


def test_lru_hits_far_less_than_a_fixed_subset_under_random_epochs():
    model = JobModel.from_profile("cifar10").with_dataset(D, S)
    _, eff = _compute(model)
    world = _world("lru")
    jobs, allocs = [_info("a", model)], [_on("node-00", 0)]
    world.rates(jobs, allocs)
    world.advance({"a": 1000.0})  # fills the node's 400 MB
    k = CAPACITY / D
    h = k + (1 - k) * math.log(1 - k)  # 0.0935: LRU under a fresh permutation every epoch
    assert h == pytest.approx(0.0935, abs=1e-4)
    assert world.rates(jobs, allocs)[0] == pytest.approx(BUDGET / (S * (1 - h)) * eff)


def test_independent_io_is_shared_max_min():
    model = JobModel.from_profile("cifar10").with_dataset(D, S)
    _, eff = _compute(model)
    world = _world("none")
    jobs = [_info("a", model), _info("b", model)]
    rates = world.rates(jobs, [_on("node-00", 0), _on("node-01", 0)])
    assert rates == pytest.approx([BUDGET / 2 / S * eff] * 2)


def test_silod_uses_the_plans_quota_and_rate():
    model = JobModel.from_profile("cifar10").with_dataset(D, S)
    _, eff = _compute(model)
    world = _world("silod")
    jobs = [_info("a", model)]
    plan = [Allocation(placement=(("node-00", (0,)),), cache_bytes={"node-00": 2e8}, remote_io_bytes_per_s=3e5)]
    assert world.rates(jobs, plan)[0] == pytest.approx(3e5 / S * eff)
    world.advance({"a": 1000.0})  # 300 MB of misses read, 200 MB (the quota) kept
    assert world.cached_bytes() == {("node-00", "ds"): pytest.approx(2e8)}
    # 3,000 of its first epoch's 10,000 samples read: what it cached is not hit before its next epoch.
    assert world.rates(jobs, plan)[0] == pytest.approx(3e5 / S * eff)
    world.advance({"a": 2500.0})  # the second epoch begins at 3,333 s
    assert world.rates(jobs, plan)[0] == pytest.approx(3e5 / (S * 0.8) * eff)


# --- co-designed simulations -------------------------------------------------------------


@dataclass(frozen=True)
class Recording:
    """Runs ``inner`` and keeps every (snapshot, plan) for the test to check."""

    inner: Any
    codesign: bool = False
    seen: list = field(default_factory=list, compare=False)
    name: str = "recording"

    def schedule(self, snapshot):
        plan = self.inner.schedule(snapshot)
        self.seen.append((snapshot, plan))
        return plan


SMALL = [job("c1", 0, "cifar10", 4, 512), job("n1", 10, "ncf", 1, 256), job("c3", 20, "cifar10", 4, 512),
         job("c2", 30, "cifar10", 2, 256), job("b1", 40, "bert", 2, 24)]
IO_CLUSTER = {"nodes": 2, "gpus_per_node": 4, "cache_bytes_per_node": "1 GB", "storage_bandwidth_bytes_per_s": "5 MB/s",
              "nic_bytes_per_s": "4 MB/s"}


@pytest.mark.parametrize("name", ["fifo", "sjf", "tiresias", "themis", "gavel", "pollux"])
def test_every_co_designed_step_keeps_quotas_and_io_within_capacity(name):
    cluster = cluster_from_dict(IO_CLUSTER)
    recorder = Recording(get_policy(name, codesign=True))
    sim = Simulator(SMALL, recorder, cluster, cache_mode="silod")
    result = sim.run()
    assert len(result.jobs) == len(SMALL) and result.plans_checked == result.rounds
    assert len(recorder.seen) == result.rounds
    managed = 0
    for snapshot, plan in recorder.seen:
        assert snapshot.storage_bandwidth_bytes_per_s == 5e6  # the co-designing policy is told the budget
        check_plan(snapshot, plan)
        for node in snapshot.nodes:
            assert sum(a.cache_bytes.get(node.name, 0.0) for a in plan.allocations.values()) <= node.cache_capacity_bytes * (1 + 1e-9)
        assert sum(a.remote_io_bytes_per_s for a in plan.allocations.values()) <= 5e6 * (1 + 1e-9)
        managed += sum(1 for a in plan.allocations.values() if a.cache_bytes)
    assert managed > 0  # quotas were really handed out
    assert 0 < result.remote_bytes_read


def test_independent_modes_keep_the_scheduler_gpu_only():
    cluster = cluster_from_dict(IO_CLUSTER)
    recorder = Recording(get_policy("sjf"))
    Simulator(SMALL, recorder, cluster, cache_mode="lru").run()
    for snapshot, plan in recorder.seen:
        assert snapshot.storage_bandwidth_bytes_per_s == math.inf and not snapshot.cached_bytes
        assert all(a.remote_io_bytes_per_s == math.inf and not a.cache_bytes for a in plan.allocations.values())


def test_default_cluster_and_cache_reproduce_the_gpu_only_run():
    before = Simulator(SMALL, "sjf", cluster_from_dict({"nodes": 2})).run()
    none = Simulator(SMALL, "sjf", cluster_from_dict({"nodes": 2}), cache_mode="none").run()
    assert isinstance(Simulator(SMALL, "sjf").rate_model, GoodputRates)
    assert [j.finish_s for j in before.jobs] == [j.finish_s for j in none.jobs]


def test_cli_compares_cache_modes(tmp_path: Path, capsys):
    workload = tmp_path / "w.csv"
    workload.write_text("name,time,application,num_replicas,batch_size\n"
                        + "".join(f"{j.name},{j.arrival_s:g},{j.application},{j.num_replicas},{j.batch_size}\n" for j in SMALL))
    cluster = tmp_path / "c.yaml"
    cluster.write_text("".join(f"{k}: {v}\n" for k, v in IO_CLUSTER.items()))
    out = tmp_path / "out"
    assert main(["simulate", "compare", "--workload", str(workload), "--policy", "fifo", "--cluster", str(cluster),
                 "--cache", "static,silod", "--out", str(out), "--quiet", "--no-plots"]) == 0
    assert (out / "fifo" / "static" / "summary.json").is_file() and (out / "fifo" / "silod" / "summary.json").is_file()
    table = (out / "compare.md").read_text()
    assert "| cache |" in table and "IO util." in table and "| fifo/silod | silod |" in table
    assert main(["simulate", "run", "--workload", str(workload), "--policy", "fifo", "--cache", "mru",
                 "--out", str(out / "x"), "--quiet"]) == 2
    assert "--cache: unknown cache mode 'mru'" in capsys.readouterr().err
