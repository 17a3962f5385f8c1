"""What a committed plan's jobs hold, kept so that the next plan's changes are checked by what
they change.

A CommitPlanChanges at 20,000 jobs changes a handful of entries, yet checking the whole plan
it makes (check_plan: every GPU's holder, the remote IO granted in all) took about 0.1 s of
each round. The plan it builds on was checked whole when it was committed, so only the changed
entries can break its invariants: a GPU held twice, or the remote IO budget exceeded. Loans and
replicas come whole with every plan's header and are checked whole, against these holders.

The rule: ``after`` says "sound" only when the whole check would pass. Anything it is not sure
of (None) goes to the whole check, which refuses the plan with its usual message, or passes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from silod.v1 import plan_pb2

from services.metadata.validation.plans import Gpu, check_loans_and_replicas, check_plan
from services.runtime.errors import InvalidArgument


class JobHolders:
    """Who holds each GPU under the jobs of plan ``version``, and the remote IO granted to each."""

    def __init__(self, version: int, holder: dict[Gpu, str], gpus_of: dict[str, tuple[Gpu, ...]],
                 remote_io_of: dict[str, int]) -> None:
        self.version = version
        self.holder = holder
        self.gpus_of = gpus_of
        self.remote_io_of = remote_io_of
        self.remote_io = sum(remote_io_of.values())

    @classmethod
    def of(cls, plan: plan_pb2.AllocationPlan) -> JobHolders:
        """Those of ``plan``, a plan the whole check passed."""
        holder: dict[Gpu, str] = {}
        gpus_of: dict[str, tuple[Gpu, ...]] = {}
        remote_io_of: dict[str, int] = {}
        for job in plan.jobs:
            gpus = _gpus(job)
            if gpus:
                gpus_of[job.job_id] = gpus
                holder.update((gpu, job.job_id) for gpu in gpus)
            if job.cache_grants:
                remote_io_of[job.job_id] = sum(grant.remote_io_bytes_per_s for grant in job.cache_grants)
        return cls(plan.version, holder, gpus_of, remote_io_of)

    def after(self, header: plan_pb2.AllocationPlan, changes: plan_pb2.PlanChanges) -> _Changed | None:
        """What the jobs hold once ``changes`` apply, if the plan they make with ``header`` (every
        field but jobs) surely passes the whole check; None where that is not sure. ``changes``
        passed check_plan_changes."""
        touched = {job.job_id for job in changes.jobs}
        touched.update(changes.removed_job_ids)
        claimed: dict[Gpu, str] = {}
        for job in changes.jobs:
            for gpu in _gpus(job):
                other = self.holder.get(gpu)
                if gpu in claimed or (other is not None and other not in touched):
                    return None
                claimed[gpu] = job.job_id
        remote_io = self.remote_io - sum(self.remote_io_of.get(job_id, 0) for job_id in touched) \
            + sum(grant.remote_io_bytes_per_s for job in changes.jobs for grant in job.cache_grants)
        budget = header.storage_bandwidth_budget_bytes_per_s
        if budget and remote_io > budget:
            return None
        try:
            check_plan(header)  # its own fields, loans and replicas (it holds no jobs)
            check_loans_and_replicas(header, _HoldersAfter(self.holder, touched, claimed))
        except InvalidArgument:  # the whole check gives the message
            return None
        return _Changed(touched, claimed, changes)

    def apply(self, changed: _Changed, version: int) -> None:
        """Follow the plan committed as ``version`` with ``changed`` (from ``after`` on this)."""
        for job_id in changed.touched:
            for gpu in self.gpus_of.pop(job_id, ()):
                if self.holder.get(gpu) == job_id:
                    del self.holder[gpu]
            self.remote_io -= self.remote_io_of.pop(job_id, 0)
        self.holder.update(changed.claimed)
        for job in changed.changes.jobs:
            gpus = _gpus(job)
            if gpus:
                self.gpus_of[job.job_id] = gpus
            if job.cache_grants:
                io = self.remote_io_of[job.job_id] = sum(grant.remote_io_bytes_per_s for grant in job.cache_grants)
                self.remote_io += io
        self.version = version


class _Changed:
    def __init__(self, touched: set[str], claimed: dict[Gpu, str], changes: plan_pb2.PlanChanges) -> None:
        self.touched = touched
        self.claimed = claimed
        self.changes = changes


class _HoldersAfter(Mapping[Gpu, str]):
    """GPU -> job once the changes apply, read through (not copied from) the base's holders."""

    def __init__(self, base: Mapping[Gpu, str], touched: set[str], claimed: Mapping[Gpu, str]) -> None:
        self._base, self._touched, self._claimed = base, touched, claimed

    def __getitem__(self, gpu: Gpu) -> str:
        job = self._claimed.get(gpu)
        if job is not None:
            return job
        job = self._base[gpu]
        if job in self._touched:
            raise KeyError(gpu)
        return job

    def __iter__(self) -> Iterator[Gpu]:  # not used by the checks; here for Mapping's sake
        yield from self._claimed
        yield from (gpu for gpu, job in self._base.items() if job not in self._touched)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _gpus(job: plan_pb2.JobAllocation) -> tuple[Gpu, ...]:
    return tuple((placement.node, index) for placement in job.placements for index in placement.gpu_indices)
