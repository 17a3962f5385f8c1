"""A job inside the engine: its mutable state, and the :class:`JobInfo` a policy sees of it.

**Progress is anchored, not accumulated.** A running job's rate holds from the moment it was
set (its *anchor*, ``base_t``, with the progress and attained service then, ``done`` and
``attained``) until its allocation or rate changes; its progress at any later time is
``done + rate x (t - max(base_t, restart_until))`` and its attained service ``attained + GPUs x
(t - base_t)``, worked out when asked (:meth:`SimJob.done_at`, :meth:`SimJob.attained_at`) and
written back only when the job's allocation or rate changes (:meth:`SimJob.settle`). So no event
of another job, and no round, touches a job whose allocation did not change, and a job's
figures do not depend on how the time between its changes was cut into events.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from estimator.job_model import JobModel
from estimator.profiles.loading import JobOverheads
from scheduler.policy import Allocation, JobInfo
from simulator.workload import JobSpec


class SimJob:
    """Mutable per-job state inside the engine."""

    __slots__ = (
        "spec", "model", "type_models", "dataset", "target", "min_gpus", "max_gpus", "requested", "done", "attained", "restarts",
        "start", "finish", "allocation", "restart_until", "rate", "finish_at", "_info", "_info_at",
        "overheads", "work_done_at", "base_t", "work_end",
    )

    def __init__(self, spec: JobSpec, model: JobModel, target: float, max_gpus: int, dataset: str = "",
                 type_models: Mapping[str, JobModel] | None = None):
        self.spec = spec
        self.model = model
        self.type_models = type_models if type_models is not None else {}
        self.dataset = dataset
        self.target = target
        self.min_gpus = 1
        self.max_gpus = max_gpus
        self.requested = min(spec.num_replicas, max_gpus)
        self.done = 0.0                 # progress at base_t
        self.attained = 0.0             # attained GPU-seconds at base_t
        self.base_t = 0.0               # the anchor: when done, attained and the rate were last set
        self.restarts = 0
        self.start: float | None = None
        self.finish: float | None = None
        self.allocation: Allocation | None = None
        self.restart_until = -math.inf
        self.rate = 0.0
        self.finish_at = math.inf
        self.work_end = math.inf        # when the last sample is done at this rate (inf: never)
        self._info: JobInfo | None = None
        self._info_at: tuple[float, float, int] | None = None
        self.overheads: JobOverheads | None = None  # measured launch/finish times (None: restart_cost_s, no tail)
        self.work_done_at: float | None = None      # with overheads: when its last step ended

    # --- progress --------------------------------------------------------------------

    def done_at(self, t: float) -> float:
        """Efficiency-weighted samples done by ``t`` (no event of the job's own before it)."""
        if self.allocation is None or self.rate <= 0:
            return self.done
        begin = self.base_t if self.base_t > self.restart_until else self.restart_until
        if t <= begin:
            return self.done
        if self.overheads is not None and self.work_end <= t:  # its last step is done: the finish tail
            return self.target
        return self.done + self.rate * (t - begin)

    def attained_at(self, t: float) -> float:
        """GPU-seconds held by ``t`` (restarts and the finish tail included)."""
        allocation = self.allocation
        return self.attained if allocation is None else self.attained + allocation.gpus * (t - self.base_t)

    def in_tail(self, t: float) -> bool:
        """With overheads: has its last step ended by ``t`` (it holds its GPUs to finish)?"""
        return self.work_done_at is not None or (self.overheads is not None and self.work_end <= t)

    def settle(self, t: float) -> None:
        """Write the progress and service of ``t`` back and anchor there (before a change)."""
        if t == self.base_t:
            return
        if self.overheads is not None and self.work_done_at is None and self.allocation is not None \
                and self.rate > 0 and self.work_end <= t:
            self.work_done_at = self.work_end
        self.done = self.done_at(t)
        self.attained = self.attained_at(t)
        self.base_t = t

    def run_at(self, rate: float, t: float) -> None:
        """From ``t`` (anchored there) the job progresses at ``rate``: its completion time."""
        self.rate = rate
        begin = t if t > self.restart_until else self.restart_until
        if self.overheads is None:
            self.work_end = self.finish_at = begin + (self.target - self.done) / rate if rate > 0 else math.inf
            return
        tail = self.overheads.finish(self.allocation.gpus)
        if self.work_done_at is not None:  # in its finish tail (re-placed since: after the launch)
            self.work_end = self.work_done_at
            self.finish_at = max(self.work_done_at, self.restart_until) + tail
        elif rate > 0:
            self.work_end = begin + (self.target - self.done) / rate
            self.finish_at = self.work_end + tail
        else:
            self.work_end = self.finish_at = math.inf

    def stop(self) -> None:
        """No GPUs from now (call :meth:`settle` first): progress is kept (checkpointed)."""
        self.allocation = None
        self.rate = 0.0
        self.finish_at = self.work_end = math.inf

    # --- what a policy sees ----------------------------------------------------------

    def info(self, t: float | None = None) -> JobInfo:
        """The job as a policy sees it at ``t`` (default: as last settled)."""
        # Only progress, attained service and restarts change while a job is active: a job that
        # waits keeps its JobInfo from round to round.
        if t is None or self.allocation is None:
            done, attained = self.done, self.attained
        else:
            done, attained = self.done_at(t), self.attained_at(t)
        state = (done, attained, self.restarts)
        if self._info is None or self._info_at != state:
            self._info, self._info_at = self._new_info(done, attained), state
        return self._info

    def _new_info(self, done: float, attained: float) -> JobInfo:
        if self._info is not None:  # only the progress fields change: copy the rest (JobInfo has no __post_init__)
            info = object.__new__(JobInfo)
            info.__dict__.update(self._info.__dict__)
            info.__dict__.update(samples_done=min(done, self.target), attained_gpu_s=attained, restarts=self.restarts)
            return info
        s = self.spec
        return JobInfo(
            job_id=s.name,
            model=self.model,
            submit_time_s=s.arrival_s,
            min_gpus=self.min_gpus,
            max_gpus=self.max_gpus,
            target_samples=self.target,
            samples_done=min(done, self.target),
            requested_gpus=self.requested,
            batch_size=s.batch_size,
            attained_gpu_s=attained,
            restarts=self.restarts,
            dataset=self.dataset,
            gpu_types=s.gpu_types,
            type_models=self.type_models,
            tenant=s.tenant,
            cpus_per_rank=s.cpus_per_rank,
            memory_bytes_per_rank=s.memory_bytes_per_rank,
        )


_Job = SimJob  # the engine's former private name


def max_gpus_for(model: JobModel, requested: int, cap: int) -> int:
    """A job's largest world size: what its batch limits allow (``max_batch // min_local``), at
    least what its owner asked for, at most ``cap`` (the cluster, or ``max_gpus_per_job``)."""
    by_batch = max(1, model.bounds.max_batch_size // model.bounds.min_local_bsz)
    return max(1, min(cap, max(by_batch, requested)))
