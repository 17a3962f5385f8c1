"""gavel's answer, the LP's allocation (:class:`GavelAllocation`): how a round reads it (each
job's candidates in the order it tries them, :func:`ranked_choices`), and the answers of the
last few rounds' LPs, which a round with the same jobs reuses (:func:`remembered`)."""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from scheduler.policies import gavel_candidates as cand
from scheduler.policy import JobInfo

# Time fractions below this are solver noise.
NOISE = 1e-9


@dataclass(frozen=True)
class GavelAllocation:
    """The LP's answer: candidates (flattened) and the time fraction of each."""

    jobs: tuple[JobInfo, ...]
    job: np.ndarray               # job position of each candidate
    gpus: np.ndarray              # GPU count of each candidate
    throughput: np.ndarray        # rate of progress with the candidate (efficiency-weighted samples/s)
    reference: np.ndarray         # per job: throughput under an equal share (the normalizer)
    weight: np.ndarray            # per job: priority weight
    fraction: np.ndarray          # per candidate: share of time (the LP's X)
    level: float                  # the max-min normalized throughput t* (makespan: 1 / the makespan in s)
    io: np.ndarray | None = None  # per candidate: remote bytes/s it uses while running (codesign only)
    types: tuple[str, ...] = ("",)  # GPU types of the pool, sorted
    gpu_type: np.ndarray | None = None  # per candidate: index into ``types`` (None = all untyped)
    bound: float | None = None    # price solver only: an upper bound on the LP's level

    def type_of(self, candidate: int) -> str:
        return self.types[int(self.gpu_type[candidate])] if self.gpu_type is not None else self.types[0]

    def time_fraction(self) -> np.ndarray:
        """Per job: share of time it should run (sum over its candidates)."""
        return np.bincount(self.job, weights=self.fraction, minlength=len(self.jobs))

    def target_gpus(self) -> np.ndarray:
        """Per job: GPUs it should hold on average."""
        return np.bincount(self.job, weights=self.fraction * self.gpus, minlength=len(self.jobs))

    def normalized_throughput(self) -> np.ndarray:
        """Per job: ``sum_c X[j,c] thr[j,c] / ref[j]``."""
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = self.fraction * np.where(self.reference[self.job] > 0, self.throughput / self.reference[self.job], 0.0)
        return np.bincount(self.job, weights=rate, minlength=len(self.jobs))


def ranked_choices(allocation: GavelAllocation) -> list[list[int]]:
    """Per job: its candidates with time in the LP, most-weighted first (the smaller count among
    near-equal weights); a job the LP gives no time keeps its first one, for leftover GPUs.
    (Remembered for the last allocation: a round and its promise both ask.)"""
    last = _LAST_CHOICES
    if last is not None and last[0] is allocation:
        return last[1]
    ranked = _rank_choices(allocation)
    globals()["_LAST_CHOICES"] = (allocation, ranked)
    return ranked


# The last allocation's choices (a round, then its promise, ask the same).
_LAST_CHOICES: tuple | None = None


def _rank_choices(allocation: GavelAllocation) -> list[list[int]]:
    ranked = np.lexsort((allocation.gpus, -np.round(allocation.fraction / 1e-6), allocation.job))
    first = np.ones(ranked.size, dtype=bool)
    first[1:] = allocation.job[ranked[1:]] != allocation.job[ranked[:-1]]
    return cand.by_job(ranked[first | (allocation.fraction[ranked] > NOISE)], allocation.job, len(allocation.jobs))


_PREPARED: OrderedDict[tuple, tuple[list, GavelAllocation]] = OrderedDict()
_PREPARED_LOCK = threading.Lock()
_PREPARED_KEPT = 4


def remembered(key: tuple, jobs: tuple[JobInfo, ...], solve) -> GavelAllocation:
    """``solve()`` for ``key``, or the answer remembered for it with this round's ``jobs``."""
    with _PREPARED_LOCK:
        found = _PREPARED.get(key)
        if found is not None:
            _PREPARED.move_to_end(key)
            return dataclasses.replace(found[1], jobs=jobs)
    allocation = solve()
    for value in vars(allocation).values():
        if isinstance(value, np.ndarray):
            value.setflags(write=False)  # shared by the rounds that reuse it
    models = [(job.model, job.type_models) for job in jobs]
    with _PREPARED_LOCK:
        _PREPARED[key] = (models, allocation)
        while len(_PREPARED) > _PREPARED_KEPT:
            _PREPARED.popitem(last=False)
    return allocation


def forget_answers() -> None:
    """Drop the remembered allocations and choices (with :func:`scheduler.policies.gavel.forget_lps`)."""
    global _LAST_CHOICES
    with _PREPARED_LOCK:
        _PREPARED.clear()
    _LAST_CHOICES = None
