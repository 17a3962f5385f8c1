"""Trace-driven, event-driven simulation of a GPU cluster running silod's own policies.

The engine (:class:`Simulator`) advances an injected :class:`SimClock` from event to event,
calls the same :mod:`scheduler` policies and :mod:`estimator` models as the live scheduler,
and checks every plan against :mod:`scheduler.invariants`. ``silod simulate`` is its command
line (:mod:`simulator.cli`); docs/evaluation.md describes the model and the results.

    from simulator import simulate, write_outputs
    result = simulate("workload-6", "fifo")          # packaged Pollux workload, default cluster
    write_outputs(result, "out/")
"""

from simulator.cacheio import CACHE_MODES, CacheIoRates
from simulator.clock import SimClock
from simulator.cluster import ClusterSpec, cluster_from_dict, load_cluster
from simulator.engine import JobRecord, SimProgress, SimulationResult, Simulator, TimelinePoint
from simulator.errors import SimulationStuck, SimulatorInputError
from simulator.metrics import summary, write_compare, write_outputs
from simulator.philly import generate_philly
from simulator.rates import GoodputRates, RateModel
from simulator.runner import compare, simulate
from simulator.loading import load_workload
from simulator.workload import JobSpec, Workload, packaged_workloads, target_samples, write_workload

__all__ = [
    "CACHE_MODES",
    "CacheIoRates",
    "ClusterSpec",
    "GoodputRates",
    "JobRecord",
    "JobSpec",
    "RateModel",
    "SimClock",
    "SimProgress",
    "SimulationResult",
    "SimulationStuck",
    "Simulator",
    "SimulatorInputError",
    "TimelinePoint",
    "Workload",
    "cluster_from_dict",
    "compare",
    "generate_philly",
    "load_cluster",
    "load_workload",
    "packaged_workloads",
    "simulate",
    "summary",
    "target_samples",
    "write_compare",
    "write_outputs",
    "write_workload",
]
