"""The policy interface: a pure function from a cluster snapshot to a plan.

A policy sees plain, immutable value objects and returns one. It reads no clock (the time
is ``snapshot.time_s``), does no I/O and keeps no state between calls: whatever it needs
to remember (attained service, restarts, the current placement) is part of the snapshot.
That is what lets the simulator and the live scheduler run exactly the same code — the
mechanism around a policy (watching jobs, committing plans, launching processes, or
advancing a simulated clock) lives elsewhere.

Units: seconds on the snapshot's clock, bytes, bytes/s, samples, GPUs.

Progress is counted as Pollux does, in *efficiency-weighted samples*: a sample processed at
statistical efficiency e (see :mod:`estimator.goodput`) counts e, so a job run at a batch
size larger than its model's initial one needs more samples to reach the same point, and
the rate of progress is the goodput. A job finishes when ``samples_done`` reaches
``target_samples`` (epochs x dataset samples, or its sample budget).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Literal, Protocol, TypeVar

from estimator.job_model import JobModel

Pool = Literal["training", "inference"]
UNLIMITED = math.inf
V = TypeVar("V")


@dataclass(frozen=True, eq=False)
class ChangedSince(Generic[V]):
    """Which entries of a container differ from an earlier container's: a hint for the parts that
    keep state from call to call, so that a round over 20,000 jobs with a handful of changes looks
    at the handful instead of comparing 20,000 entries.

    ``after`` is ``before`` but for the keys in ``entries``, each with its value in ``after`` (None
    where ``after`` lacks it); any other key has the very same object in both (a listed key may
    have it too: a maker may list more than changed, never less). Both containers are
    named by identity, and a part may take the hint only when ``before`` is the container it saw
    last and ``after`` the one it is handed now (:meth:`follows`). A snapshot or plan remade from
    another (``dataclasses.replace`` with other jobs) keeps a hint about the old container, which
    then fails that test: the part compares, as it would without a hint."""

    before: object
    after: object
    entries: Mapping[str, V | None]

    def follows(self, seen: object, now: object) -> bool:
        return self.before is seen and self.after is now


@dataclass(frozen=True)
class NodeInfo:
    """A machine the policy may place work on."""

    name: str
    gpus: int                                   # GPUs on the node (indices 0..gpus-1)
    pool: Pool = "training"                     # inference-pool GPUs are only lent (DeepBoot)
    cache_capacity_bytes: float = 0.0           # bytes of dataset cache on the node
    nic_bytes_per_s: float = UNLIMITED          # bytes/s the node can read from remote storage
    gpu_type: str = ""                          # type of every GPU of the node ("v100"); "" = untyped
    cpus: float = UNLIMITED                     # CPU cores ranks may request on the node; UNLIMITED = no limit
    memory_bytes: float = UNLIMITED             # bytes of memory ranks may request on the node; UNLIMITED = no limit


@dataclass(frozen=True)
class JobInfo:
    """An active job (arrived, not finished) as the policy sees it."""

    job_id: str
    model: JobModel                             # estimator view: throughput, efficiency, dataset IO facts
    submit_time_s: float                        # arrival on the snapshot clock
    min_gpus: int                               # smallest world size it runs with (>= 1)
    max_gpus: int                               # largest world size (== min_gpus for rigid jobs)
    target_samples: float                       # progress needed to finish, in efficiency-weighted samples (below)
    samples_done: float = 0.0                   # progress so far, efficiency-weighted samples
    requested_gpus: int = 0                     # what the owner asked for; rigid policies give this; 0 = max_gpus
    batch_size: int = 0                         # owner's global batch size; 0 = the model's initial batch size
    attained_gpu_s: float = 0.0                 # GPU-seconds received so far (least-attained-service, fairness)
    restarts: int = 0                           # times the job was (re)started with a new placement
    dataset: str = ""                           # dataset name; jobs reading one dataset share its cache
    priority: int = 0                           # larger first among equals
    tenant: str = "default"
    gpu_types: tuple[str, ...] = ()             # GPU types the job may run on; () = any
    # GPU type -> the job's model on that type (estimator.gpu_types); a type missing here
    # (and untyped nodes) use ``model``.
    type_models: Mapping[str, JobModel] = field(default_factory=dict)
    cpus_per_rank: float = 0.0                  # CPU cores each rank requests; 0 = none (placed by GPUs alone)
    memory_bytes_per_rank: int = 0              # bytes of memory each rank requests; 0 = none

    @property
    def has_requests(self) -> bool:
        """Does a rank request cores or memory (so placement must find room for them)?"""
        return bool(self.cpus_per_rank or self.memory_bytes_per_rank)

    def model_on(self, gpu_type: str) -> JobModel:
        """The job's model on GPUs of ``gpu_type``."""
        return self.type_models.get(gpu_type, self.model) if gpu_type else self.model

    def allows(self, gpu_type: str) -> bool:
        """May the job run on ``gpu_type``? Untyped nodes ("") take any job."""
        return not self.gpu_types or not gpu_type or gpu_type in self.gpu_types

    @property
    def remaining_samples(self) -> float:
        return max(0.0, self.target_samples - self.samples_done)

    @property
    def requested(self) -> int:
        return min(max(self.requested_gpus or self.max_gpus, self.min_gpus), self.max_gpus)

    @property
    def rigid(self) -> bool:
        return self.min_gpus == self.max_gpus

    @property
    def initial_batch_size(self) -> int:
        return self.batch_size or self.model.bounds.init_batch_size


@dataclass(frozen=True)
class Allocation:
    """What one job holds under a plan."""

    placement: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (node, GPU indices) pairs, nodes sorted
    batch_size: int = 0                         # global samples/step; 0 = the job's own batch size
    cache_bytes: Mapping[str, float] = field(default_factory=dict)  # node -> bytes of cache quota for the job's dataset
    remote_io_bytes_per_s: float = UNLIMITED    # bytes/s of remote IO granted; UNLIMITED = not managed
    gpu_type: str = ""                          # type of every GPU of the placement; "" = untyped

    @functools.cached_property
    def gpus(self) -> int:  # cached: the simulator asks every running job's count several times per event
        return sum(len(indices) for _, indices in self.placement)

    @property
    def nodes(self) -> int:
        return len(self.placement)

    @property
    def gpus_by_node(self) -> dict[str, int]:
        return {node: len(indices) for node, indices in self.placement}

    @property
    def total_cache_bytes(self) -> float:
        return float(sum(self.cache_bytes.values()))

    def same_gpus(self, other: "Allocation | None") -> bool:
        return other is not None and self.placement == other.placement


@dataclass(frozen=True)
class Plan:
    """Every job's allocation; a job absent from ``allocations`` holds nothing."""

    allocations: Mapping[str, Allocation] = field(default_factory=dict)
    # How ``allocations`` differs from an earlier plan's of the same maker (ChangedSince): a hint.
    changed: ChangedSince[Allocation] | None = field(default=None, compare=False, repr=False)

    def get(self, job_id: str) -> Allocation | None:
        return self.allocations.get(job_id)

    def gpus_of(self, job_id: str) -> int:
        allocation = self.allocations.get(job_id)
        return allocation.gpus if allocation else 0


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's nominal share of the cluster (Kueue: a ClusterQueue's nominalQuota and limits)."""

    # GPU type -> nominal GPUs of that type; "" (scheduler.quotas.ANY_TYPE) -> nominal GPUs of any
    # type (untyped clusters: the only key that matters). Empty: no GPU guarantee.
    gpus: Mapping[str, int] = field(default_factory=dict)
    cache_bytes: float = UNLIMITED              # ceiling on the cache quotas of the tenant's jobs, bytes, all nodes
    remote_io_share: float = 1.0                # ceiling on its jobs' remote IO, fraction (0, 1] of the storage budget
    borrowing_limit_gpus: int | None = None     # GPUs it may hold beyond its nominal share; None = no limit
    lending_limit_gpus: int | None = None       # of its idle nominal GPUs, how many may be lent; None = all

    @property
    def nominal_gpus(self) -> int:
        """Nominal GPUs over all types."""
        return sum(self.gpus.values())


@dataclass(frozen=True)
class ClusterSnapshot:
    """Everything a policy may look at, at one instant."""

    time_s: float                               # now, on the scheduler's (or simulator's) clock
    nodes: tuple[NodeInfo, ...]
    jobs: tuple[JobInfo, ...]                   # active jobs, in arrival order
    current: Plan = field(default_factory=Plan)  # the plan in force
    restart_cost_s: float = 30.0                # seconds a job loses when its placement changes
    interval_s: float = 60.0                    # seconds until the next regular round
    storage_bandwidth_bytes_per_s: float = UNLIMITED  # cluster-wide remote read budget
    cached_bytes: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (node, dataset) -> bytes cached now
    # (job, node) -> bytes of the job's dataset cached on the node since the job's current epoch
    # began: an epoch reads every sample once, so the job cannot hit these before its next
    # epoch (scheduler.data_grants.EpochStarts); missing = 0
    fresh_bytes: Mapping[tuple[str, str], float] = field(default_factory=dict)
    # Inference-pool node -> GPU indices an inference replica holds now (RUNNING or PROTECT,
    # see scheduler.deepboot). Those GPUs are not lendable to training; empty = none busy.
    inference_busy: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # Tenant -> its quota (scheduler.quotas). Policies do not read it: scheduler.quotas.schedule
    # runs them on each tenant's share. Empty = no quotas, every tenant shares the whole cluster.
    quotas: Mapping[str, TenantQuota] = field(default_factory=dict)
    # How ``jobs`` differs from the last snapshot's of the same maker, by job id (ChangedSince):
    # a hint, never needed. Policies that keep a memo between calls (fifo's queue, the plan
    # checks) follow it instead of comparing every job.
    jobs_changed: ChangedSince[JobInfo] | None = field(default=None, compare=False, repr=False)

    @property
    def total_gpus(self) -> int:
        return sum(node.gpus for node in self.nodes)

    def gpu_types(self, pools: tuple[Pool, ...] = ("training",)) -> tuple[str, ...]:
        """Distinct GPU types of the nodes of ``pools``, sorted ("" for untyped nodes)."""
        return tuple(sorted({node.gpu_type for node in self.nodes if node.pool in pools}))

    def node(self, name: str) -> NodeInfo:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


class Policy(Protocol):
    """A scheduling policy. Implementations are plain classes whose constructor takes options."""

    name: ClassVar[str]

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        """Return the plan for ``snapshot``; must not mutate it, read clocks or do I/O."""
        ...

    # Optional: ``stable_until(snapshot, plan) -> scheduler.steady.Steadiness``, how long ``plan``
    # (= ``schedule(snapshot)``) stands while only the clock and progress move (see scheduler.steady).
