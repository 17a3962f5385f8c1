"""Fold a job's reported steps into its model: the math behind ``EstimatorService.Observe``.

Reports arrive as ``silod.v1.StepObservation`` describes them: GPUs, nodes, *global* batch
size, step and sync time, gradient statistics. The per-GPU micro-batch and accumulation
steps are not reported; they follow from the batch size and the job's ``max_local_bsz``
the same way the predictor splits batches (:func:`estimator.goodput.split_local_batch`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import ArrayLike

from estimator.fitting import ObservationLog, update_grad_params
from estimator.goodput import split_local_batch
from estimator.job_model import JobModel


def observe(
    model: JobModel,
    log: ObservationLog,
    gpus: ArrayLike,
    nodes: ArrayLike,
    batch_size: ArrayLike,
    step_time_s: ArrayLike,
    sync_time_s: ArrayLike = 0.0,
    grad_sqr: ArrayLike = 0.0,
    grad_var: ArrayLike = 0.0,
    io_bound: ArrayLike = False,
) -> JobModel:
    """Add reports (oldest first) to ``log`` (mutated) and return the refitted model.

    ``sync_time_s = 0`` means unknown for multi-GPU steps; ``grad_sqr = grad_var = 0`` means
    not measured. Rows marked ``io_bound`` (steps that waited for input, see
    :func:`estimator.fitting.is_io_bound`) update the gradient statistics but not the step-time
    fit. Parameters the log cannot identify keep their current values (initially the
    profile's). ``ValueError`` on impossible reports (no GPUs, nodes > GPUs, empty batch,
    non-positive step time).
    """
    gpu, node, batch, step, sync, skip = np.broadcast_arrays(
        *(np.atleast_1d(np.asarray(v, dtype=np.float64)) for v in (gpus, nodes, batch_size, step_time_s, sync_time_s, io_bound))
    )
    if np.any(gpu < 1) or np.any(node < 1) or np.any(node > gpu) or np.any(batch < 1):
        raise ValueError("observations need gpus >= 1, 1 <= nodes <= gpus and batch_size >= 1")
    if not (np.all(np.isfinite(step)) and np.all(step > 0) and np.all(np.isfinite(sync)) and np.all(sync >= 0)):
        raise ValueError("step_time_s must be positive and sync_time_s non-negative")
    atomic, accum = split_local_batch(batch / gpu, model.bounds.max_local_bsz)
    for row in np.flatnonzero(~skip.astype(bool)):
        log.add(int(node[row]), int(gpu[row]), int(atomic[row]), int(accum[row]), float(step[row]), float(sync[row]))
    grad, reports = update_grad_params(model.grad, model.grad_reports, grad_sqr, grad_var)
    perf = log.fit(prior=model.perf) if len(log) else model.perf
    return dataclasses.replace(model, perf=perf, grad=grad, grad_reports=reports)
