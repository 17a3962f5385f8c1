"""Each active job as the policy sees it (JobInfo), made again only when something it is made of
changed: the job's message (KnownJobs hands out a new one on any change), its model
(JobModels.watch_changes) or the GPU types of the nodes (its model per type).

A round first matches its jobs against the last round's (:meth:`JobInfos.match`), then, once the
models are up to date, makes the infos that changed (:meth:`JobInfos.update`). Where the round's
jobs follow the last round's by KnownJobs' changes (the refresh right after the one last matched,
most rounds), only the changed jobs are looked at: a steady round over 20,000 jobs matched every
one of them by its message in about 20 ms. Otherwise (the first round, after a whole read of the
jobs, after a failed round) every job is matched by its message, as before.

Both ways give the same jobs in the same order, KnownJobs' (submission order): a changed entry
keeps its place, and the entries new since the last refresh are its last ones, in its order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Mapping

from estimator.per_type import is_reference
from scheduler.live.inference import is_inference_job
from scheduler.live.jobs import KnownJobs
from scheduler.live.models import JobModels
from scheduler.policy import ChangedSince, JobInfo
from silod.v1 import common_pb2


@dataclasses.dataclass(slots=True, frozen=True)
class _Known:
    """An active job as a round saw it."""

    job: common_pb2.Job  # the message its info was made of
    info: JobInfo | None  # None: an inference job (LiveInference places those), or one still to make


@dataclasses.dataclass
class Matched:
    """The active jobs of a round, matched against the last round's (JobInfos.match)."""

    training: dict[str, _Known]  # in KnownJobs' order; info None where it has to be made
    infos: dict[str, JobInfo | None]  # the same jobs in the same order, their infos (the round's tuple in C)
    inference: dict[str, common_pb2.Job]
    fresh_training: list[tuple[common_pb2.Job, _Known | None]]  # new, or its message changed: (job, last round's)
    fresh_inference: list[common_pb2.Job]
    left: set[str]  # last round's jobs no longer active
    followed: bool  # matched by KnownJobs' changes, not by a pass over every job
    refreshes: int  # KnownJobs.refreshes of these jobs
    first: bool = False  # no round before (or the last failed half way): the parts may know jobs from before

    @property
    def forget(self) -> bool:
        """Should the parts that keep something per job forget those not active?"""
        return bool(self.left) or self.first

    @property
    def training_ids(self) -> Collection[str]:
        return self.training.keys()

    def training_jobs(self) -> Iterator[common_pb2.Job]:
        return (known.job for known in self.training.values())

    def active_ids(self) -> set[str]:
        return set(self.training).union(self.inference)


class MinGpus(dict):
    """Each training job's min_gpus, read off the jobs as asked (Holdings.current asks for the
    jobs it holds an allocation for): not a dict of 20,000 made each round. A dict of the jobs
    underneath (a copy in C), so that asking whether a job is one costs no Python call."""

    def __getitem__(self, job_id: str) -> int:
        return dict.__getitem__(self, job_id).job.spec.min_gpus


class JobInfos:
    def __init__(self, models: JobModels) -> None:
        self.models = models
        self._model_changes = models.watch_changes()
        self._training: dict[str, _Known] = {}  # the last round's, every info made, in KnownJobs' order
        self._infos: dict[str, JobInfo] = {}  # their infos, in the same order
        self._inference: dict[str, common_pb2.Job] = {}
        self._jobs: tuple[JobInfo, ...] = ()  # the last round's infos, as handed to its snapshot
        self._refreshes: int | None = None  # KnownJobs.refreshes of the jobs last matched (None: none yet)
        self._gpu_types: tuple[str, ...] | None = None  # the node GPU types the infos were made for
        self.last_match = "whole"  # or "changes": how the last round matched (tests, benchmarks)

    # ---- match ---------------------------------------------------------------------------------
    def match(self, jobs: list[common_pb2.Job], known: KnownJobs) -> Matched:
        """``jobs`` (what ``known`` last refreshed) against the last round's."""
        if known.changes is not None and known.appended is not None and self._refreshes is not None \
                and known.refreshes == self._refreshes + 1:
            matched = self._follow(known.last_active, known.changes, known.appended, known.refreshes)
            if matched is not None:
                self.last_match = "changes"
                return matched
        self.last_match = "whole"
        return self._whole(jobs, known.refreshes)

    def _whole(self, jobs: list[common_pb2.Job], refreshes: int) -> Matched:
        before_training, before_inference = self._training, self._inference
        matched = Matched({}, {}, {}, [], [], left=set(), followed=False, refreshes=refreshes,
                          first=self._refreshes is None)
        training, infos, inference = matched.training, matched.infos, matched.inference
        for job in jobs:
            job_id = job.id
            before = before_training.get(job_id)
            if before is not None and before.job is job:
                training[job_id] = before
                infos[job_id] = before.info
            elif before_inference.get(job_id) is job:
                inference[job_id] = job
            elif is_inference_job(job):
                inference[job_id] = job
                matched.fresh_inference.append(job)
            else:
                training[job_id] = _Known(job, None)
                infos[job_id] = None
                matched.fresh_training.append((job, before))
        matched.left = (before_training.keys() | before_inference.keys()) - training.keys() - inference.keys()
        return matched

    def _follow(self, active: Mapping[str, common_pb2.Job], changes: Collection[str],
                appended: tuple[str, ...], refreshes: int) -> Matched | None:
        """The last round's jobs with ``changes`` applied; None where that cannot be done (a job
        became or stopped being an inference job: then a whole pass)."""
        matched = Matched(dict(self._training), dict(self._infos), dict(self._inference), [], [], left=set(),
                          followed=True, refreshes=refreshes)
        training, infos, inference, left = matched.training, matched.infos, matched.inference, matched.left
        for job_id in changes:
            job = active.get(job_id)
            before = training.get(job_id)
            if job is None:  # ended, or cancelled
                if before is not None or inference.pop(job_id, None) is not None:
                    training.pop(job_id, None)
                    infos.pop(job_id, None)
                    left.add(job_id)
                continue
            if is_inference_job(job):
                if before is not None:
                    return None
                if inference.get(job_id) is not job:
                    inference[job_id] = job
                    matched.fresh_inference.append(job)
            elif job_id in inference:
                return None
            elif before is None or before.job is not job:
                training[job_id] = _Known(job, None)
                infos[job_id] = None
                matched.fresh_training.append((job, before))
        for job_id in appended:  # new entries go last, as in KnownJobs (see the module docstring)
            for entries in (training, infos, inference):
                if job_id in entries:
                    entries[job_id] = entries.pop(job_id)  # type: ignore[assignment]
        return matched

    # ---- update --------------------------------------------------------------------------------
    def update(self, matched: Matched, datasets: dict[str, common_pb2.Dataset | None],
               gpu_types: tuple[str, ...], specs: dict[str, common_pb2.JobSpec]
               ) -> tuple[tuple[JobInfo, ...], ChangedSince[JobInfo] | None]:
        """The round's JobInfos, in the order of its training jobs, and how they differ from the
        last round's (None on the first); ``specs`` (job -> spec, for the nodes' plans) learns
        those of the jobs new or changed."""
        changed = set(self._model_changes)  # changes made while this runs are for the next round
        self._model_changes.difference_update(changed)
        retyped = gpu_types != self._gpu_types
        training, made = matched.training, matched.infos
        try:
            remake: dict[str, tuple[common_pb2.Job, _Known | None]] = {job.id: (job, before)
                                                                      for job, before in matched.fresh_training}
            for job_id in (training if retyped else changed):
                if job_id not in remake and job_id in training:
                    known = training[job_id]
                    remake[job_id] = (known.job, known)
            differ: dict[str, JobInfo | None] = {}  # the hint's entries: not last round's info
            for job_id, (job, before) in remake.items():
                info = self._made(job, before, retyped or job_id in changed, datasets, gpu_types)
                training[job_id] = _Known(job, info)
                made[job_id] = info
                if before is None or before.info is not info:
                    differ[job_id] = info
                if before is None or before.job is not job:
                    specs[job_id] = job.spec
            for job in matched.fresh_inference:
                specs[job.id] = job.spec
            jobs = tuple(made.values())  # type: ignore[arg-type]
        except BaseException:
            # Half done: the next round makes every info anew rather than trust these.
            self._training, self._infos, self._inference, self._gpu_types, self._refreshes = {}, {}, {}, None, None
            raise
        # Gone from the training jobs: ended, or (a whole pass) became an inference job.
        for job_id in matched.left if matched.followed else self._training.keys() - training.keys():
            differ[job_id] = None
        hint = None if self._refreshes is None else ChangedSince(self._jobs, jobs, differ)
        self._training, self._infos, self._inference, self._jobs = training, made, matched.inference, jobs  # type: ignore[assignment]
        self._gpu_types, self._refreshes = gpu_types, matched.refreshes
        return jobs, hint

    def _made(self, job: common_pb2.Job, before: _Known | None, model_changed: bool,
              datasets: dict[str, common_pb2.Dataset | None], gpu_types: tuple[str, ...]) -> JobInfo:
        """``job``'s info: ``before``'s again if it comes out the same."""
        kept, old = (before.info, before.job) if before is not None else (None, None)
        if kept is not None and not model_changed and job.spec == old.spec:  # type: ignore[union-attr]
            # Its model is made of its spec, profile and fitted model only; its info, of those and
            # its creation time and progress. A state move, or KnownJobs' periodic whole read
            # (every job's message new), changes neither.
            progress_same = job.progress.samples_done == old.progress.samples_done  # type: ignore[union-attr]
            if progress_same and job.created_at == old.created_at:  # type: ignore[union-attr]
                return kept
            model, target, type_models = kept.model, kept.target_samples, kept.type_models
        else:
            model, target = self.models.model_now(job, datasets)
            type_models = self.models.type_models_now(job, model, gpu_types) if any(gpu_types) else {}
            if len(gpu_types) == 1 and not is_reference(gpu_types[0]):
                # One type, not the reference: policies price every job with its model there.
                model, type_models = type_models[gpu_types[0]], {}
            type_models = type_models if len(gpu_types) > 1 else {}
        info = _job_info(job, model, target, type_models)
        return kept if info == kept else info


def _job_info(job: common_pb2.Job, model: object, target: float, type_models: dict) -> JobInfo:
    spec = job.spec
    return JobInfo(
        job_id=job.id, model=model, submit_time_s=_epoch_s(job.created_at),  # type: ignore[arg-type]
        min_gpus=spec.min_gpus, max_gpus=spec.max_gpus, target_samples=target,
        samples_done=min(float(job.progress.samples_done), target * 0.999), requested_gpus=spec.max_gpus,
        batch_size=spec.batch_size, dataset=spec.dataset, priority=spec.priority,
        tenant=spec.tenant or "default", gpu_types=tuple(spec.gpu_types), type_models=type_models,
        cpus_per_rank=spec.cpus_per_rank, memory_bytes_per_rank=spec.memory_bytes_per_rank,
    )


def _epoch_s(stamp) -> float:
    """Seconds since the epoch of a Timestamp, as the UTC datetime's timestamp() gives them
    (microseconds, one rounding), without building the datetime: once per JobInfo made."""
    return (stamp.seconds * 1_000_000 + stamp.nanos // 1000) / 1_000_000
