"""One-call entry points: :func:`simulate` (one policy) and :func:`compare` (several).

These wrap :class:`~simulator.engine.Simulator` with what the engine deliberately does not
do: measuring wall time and resolving workload and cluster inputs from files or names.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scheduler.policy import Policy, TenantQuota
from simulator.cluster import ClusterSpec, load_cluster
from simulator.engine import SimProgress, SimulationResult, Simulator
from simulator.loading import load_workload
from simulator.workload import JobSpec, Workload


def simulate(
    workload: Workload | Sequence[JobSpec] | str | Path,
    policy: Policy | str,
    cluster: ClusterSpec | str | Path | None = None,
    *,
    check_invariants: bool = True,
    observer: Callable[[SimProgress], None] | None = None,
    policy_options: dict[str, Any] | None = None,
    cache_mode: str = "none",
    protect_scale: float = 1.0,
    quotas: Mapping[str, TenantQuota] | None = None,
) -> SimulationResult:
    """Run one simulation to the end; the result carries the wall time it took.

    ``cache_mode``: ``none``, ``lru``, ``static``, ``quiver`` or ``silod`` (:mod:`simulator.cacheio`).
    ``protect_scale`` scales the inference replicas' protect times (0: no protect; DeepBoot workloads).
    ``quotas``: tenant -> quota (:mod:`scheduler.quotas`; :func:`simulator.tenant_quotas.load_quotas` reads a file).
    """
    if isinstance(workload, (str, Path)):
        workload = load_workload(workload)
    if not isinstance(cluster, ClusterSpec):
        cluster = load_cluster(cluster)
    started = time.perf_counter()
    simulator = Simulator(
        workload, policy, cluster, check_invariants=check_invariants, observer=observer, policy_options=policy_options,
        cache_mode=cache_mode, protect_scale=protect_scale, quotas=quotas,
    )
    result = simulator.run()
    return dataclasses.replace(result, wall_time_s=time.perf_counter() - started)


def compare(
    workload: Workload | Sequence[JobSpec] | str | Path,
    policies: Sequence[str],
    cluster: ClusterSpec | str | Path | None = None,
    *,
    check_invariants: bool = True,
    observer: Callable[[str, SimProgress], None] | None = None,
    cache_mode: str = "none",
) -> list[SimulationResult]:
    """Run every policy on the same workload and cluster, in the order given."""
    if isinstance(workload, (str, Path)):
        workload = load_workload(workload)
    if not isinstance(cluster, ClusterSpec):
        cluster = load_cluster(cluster)
    results = []
    for name in policies:
        watch = (lambda p, _n=name: observer(_n, p)) if observer else None
        results.append(simulate(workload, name, cluster, check_invariants=check_invariants, observer=watch, cache_mode=cache_mode))
    return results
