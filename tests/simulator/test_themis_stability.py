"""Themis with IO-aware rho does not swap jobs round after round on the packaged IO-bound scenario."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scheduler.policies.themis import ThemisPolicy
from simulator import Simulator, load_cluster, load_workload
from simulator.workload import workload_from_jobs

CLUSTER = Path(__file__).resolve().parents[2] / "simulator" / "clusters" / "io-bound.yaml"


def _restarts(policy: ThemisPolicy, horizon_s: float) -> dict[str, int]:
    """The two ImageNet jobs of workload-6 (32 and 48 GPUs: they cannot both run on the 64
    GPUs), submitted together, on the IO-bound cluster with co-design, for ``horizon_s``."""
    jobs = [dataclasses.replace(j, arrival_s=0.0) for j in load_workload("workload-6").jobs
            if j.name in ("imagenet-81", "imagenet-137")]
    sim = Simulator(workload_from_jobs(jobs), policy, load_cluster(CLUSTER), cache_mode="silod")
    while sim.now < horizon_s and sim.step():
        pass
    assert sim.rounds > 100  # the horizon spans many rounds: a swap every few would show
    return {j.spec.name: j.restarts for j in sim._jobs}


@pytest.mark.parametrize("options", [{"io_aware_rho": True}, {"keep_margin": 0.1}])
def test_contending_jobs_do_not_swap_every_few_rounds(options):
    # Without the margin (IO_AWARE_KEEP_MARGIN = 0) io_aware_rho swaps the two every few rounds
    # once the first has run a while: 18 restarts each by 12,000 s; each swap restarts both.
    restarts = _restarts(ThemisPolicy(**options), horizon_s=12000.0)
    assert max(restarts.values()) <= 2, restarts
