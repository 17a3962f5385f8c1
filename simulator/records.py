"""What a simulation reports: progress to an observer, finished jobs and tasks, the result."""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.cluster import ClusterSpec


@dataclass(frozen=True)
class SimProgress:
    """What an observer sees after every event."""

    time_s: float
    finished: int
    total: int
    active: int       # arrived and not finished
    running: int      # holding GPUs
    rounds: int


@dataclass(frozen=True)
class JobRecord:
    """One finished job (a row of jobs.csv)."""

    name: str
    application: str
    arrival_s: float
    start_s: float            # first time it held GPUs
    finish_s: float
    jct_s: float              # finish - arrival
    restarts: int             # placements after the first
    attained_gpu_s: float     # GPU-seconds held (restarts included)
    mean_gpus: float          # attained_gpu_s / (finish - start)
    requested_gpus: int
    batch_size: int
    target_samples: float
    isolated_jct_s: float     # alone on the cluster with its requested GPUs (see docs/evaluation.md)
    tenant: str = "default"   # the job's tenant (workload column ``tenant``)


@dataclass(frozen=True)
class InferenceRecord:
    """One finished inference task (a row of inference.csv)."""

    name: str
    application: str
    arrival_s: float
    start_s: float            # placed on a GPU (its replica starts, or is reused)
    ready_s: float            # start + cold start (the task runs from here)
    finish_s: float
    wait_s: float             # start - arrival: time queued for a GPU
    cold_start: bool          # a new replica (free GPU, an evicted sleeper, or a reclaimed lent GPU)
    kind: str                 # ATS-I decision: reuse, free, sleep or reclaim


@dataclass(frozen=True)
class TimelinePoint:
    time_s: float
    allocated_gpus: int
    active_jobs: int
    running_jobs: int
    lent_gpus: int = 0        # training GPUs on inference-pool nodes
    inference_gpus: int = 0   # inference GPUs held by RUNNING/PROTECT replicas


@dataclass(frozen=True)
class SimulationResult:
    policy: str
    workload: str
    cluster: ClusterSpec
    jobs: tuple[JobRecord, ...]           # in arrival order
    timeline: tuple[TimelinePoint, ...]   # after every event that changed allocations or the job set
    rounds: int                           # scheduling rounds (every tick with active jobs, and event rounds)
    events: int
    plans_checked: int
    start_s: float                        # the clock's start
    wall_time_s: float = 0.0              # filled by :func:`simulator.runner.simulate`
    policy_options: dict = field(default_factory=dict)  # the policy's constructor options, for reproducibility
    cache_mode: str = "none"              # see simulator.cacheio
    remote_bytes_read: float = 0.0        # bytes read from remote storage by all jobs (IO utilization)
    inference: tuple[InferenceRecord, ...] = ()  # inference tasks, in arrival order
    lent_gpu_s: float = 0.0               # GPU-seconds training held on inference-pool nodes
    reclaims: int = 0                     # lent GPUs ATS-I took back from training
    protect_scale: float = 1.0            # the replicas' protect times were scaled by this
    restart_charges: dict = field(default_factory=dict)  # "afe"/"full"/"fixed"/"launch" -> [count, seconds] charged to jobs
    rounds_computed: int = -1             # rounds whose policy ran (the others' plan was promised); -1 = all
