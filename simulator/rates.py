"""How fast a running job progresses: the one function to swap when the cluster model grows.

A running job's rate of progress is its *goodput* (efficiency-weighted samples/s, see
:mod:`scheduler.policy`). Today the simulator is GPU-only: every job is fed by unlimited
remote IO and no cache (``remote_io_bytes_per_s = inf``), so the rate is the Pollux goodput
of its GPU placement and batch size, from :func:`estimator.predict.predict` — the same
estimator the policies use. A later model that also charges for cache and remote IO
implements :class:`RateModel` with the allocations' ``cache_bytes`` and
``remote_io_bytes_per_s`` and is passed to the simulator instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from estimator.job_model import JobModel
from estimator.predict import DEFAULT_GPUS_PER_NODE, ModelTable, predict
from scheduler.policy import Allocation, JobInfo


class RateModel(Protocol):
    def rates(self, jobs: Sequence[JobInfo], allocations: Sequence[Allocation]) -> np.ndarray:
        """Goodput (efficiency-weighted samples/s) of each job under its allocation, same order.

        Every allocation holds at least one GPU. Called once per scheduling round with all
        running jobs; the rate holds until the next round.
        """
        ...


def effective_batch_size(job: JobInfo, allocation: Allocation) -> int:
    """The global batch the job runs with: the plan's, else the owner's, else 0 (best)."""
    return allocation.batch_size or job.batch_size


class GoodputRates:
    """GPU-only rates: Pollux goodput at the allocation's GPUs, nodes and batch size; IO unlimited."""

    stateless = True  # a job's rate depends on its allocation alone (rounds whose plan is known need not run)

    def __init__(self, models: Sequence[JobModel] = (), *, gpus_per_node: int = DEFAULT_GPUS_PER_NODE):
        self.gpus_per_node = gpus_per_node
        self._models: list[JobModel] = []
        self._index: dict[int, int] = {}
        self._table: ModelTable | None = None
        self._known: dict[tuple[int, int, int, int], float] = {}  # (model, GPUs, nodes, batch) -> rate
        for model in models:
            self._index_of(model)

    def _index_of(self, model: JobModel) -> int:
        key = id(model)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self._models)
            self._models.append(model)  # keeps the object alive, so its id stays unique
            self._table = None
        return index

    def _model_table(self) -> ModelTable:
        if self._table is None:
            self._table = ModelTable(self._models)
        return self._table

    def rates(self, jobs: Sequence[JobInfo], allocations: Sequence[Allocation]) -> np.ndarray:
        if not jobs:
            return np.zeros(0)
        # A rate depends only on (model, GPUs, nodes, batch): price each such key once per run.
        keys = [(self._index_of(job.model_on(a.gpu_type)), a.gpus, a.nodes, effective_batch_size(job, a))
                for job, a in zip(jobs, allocations)]
        new = [key for key in dict.fromkeys(keys) if key not in self._known]
        if new:
            index, gpus, nodes, batch = (np.array(column) for column in zip(*new))
            result = predict(
                self._model_table(), index, gpus, nodes, 0.0, math.inf, batch, gpus_per_node=self.gpus_per_node
            )
            self._known.update(zip(new, result.goodput_samples_per_s.tolist()))
        return np.array([self._known[key] for key in keys])
