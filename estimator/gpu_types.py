"""GPU types: how fast a job computes on each type, relative to the type its model was fitted on.

A job model (:class:`~estimator.job_model.JobModel`) describes one job on one GPU type. The
packaged application profiles (Pollux's) are taken as measured on the *reference type*,
:data:`REFERENCE_TYPE`; another type ``t`` is described by the job's *compute speed* on it,
``speed(t) = samples/s on one GPU of t / samples/s on one GPU of the reference``, at the same
batch size. :func:`on_type` turns a model into its model on ``t`` by dividing the compute time
of a step (Pollux's ``alpha_c + beta_c * local_bsz``) by the speed; the network and
synchronization terms stay (the types share the cluster's interconnect), so a faster type
gains less for a job that spends its step synchronizing.

Where the speeds come from:

- **Measured (Gavel's table).** ``profiles/gavel/throughputs.csv`` holds the steps/s Gavel's
  authors measured for their job types on one K80, P100 and V100 (see SOURCE.md there). Each
  packaged application is related to the Gavel job type of its architecture family
  (:data:`APPLICATION_JOB_TYPES`, our mapping); its speed on ``t`` is that job type's
  ``steps/s(t) / steps/s(v100)`` — the batch size is the same on both sides, so the ratio of
  steps/s is the ratio of samples/s.
- **Bootstrapped (Sia's idea).** A type the table does not know, or a job that measured itself
  on it, gets its speed from a few observed step times: :func:`speed_from_observations`
  compares each measured compute time with what the reference model predicts for the same
  local batch and takes the median ratio. One observation is enough to place the job on the
  type; the estimator refits the full per-type model once enough configurations were seen
  (:mod:`estimator.fitting`). Steps of several GPUs whose synchronisation time was not
  measured (what the live scheduler reports) show no compute time on their own;
  :func:`speed_from_step_times` then finds the speed at which the scaled reference model
  predicts the whole measured step.

An unknown type with no observation gets speed 1 (the reference's): a neutral guess that the
first observations on the type correct.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from importlib import resources

import numpy as np

from estimator.goodput import PerfParams, step_time
from estimator.job_model import JobModel

REFERENCE_TYPE = "v100"

# How a GPU type is written wherever it enters silod (nodes, job constraints, estimator calls):
# lower case, so "A100" is not a type of its own. The metadata service checks the same rule
# (services/metadata/validation/common.py; tests/estimator/test_typed_service.py keeps them equal).
GPU_TYPE_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")


def gpu_type_problem(value: str) -> str | None:
    """Why ``value`` is not a GPU type ("" = untyped is allowed), or None if it is one."""
    if not value or GPU_TYPE_PATTERN.fullmatch(value):
        return None
    shown = value if len(value) <= 40 else value[:40] + "..."
    return (f"must be empty (untyped) or 1..32 characters of [a-z0-9._-] starting with a letter or digit, "
            f"lower case as nodes advertise it (e.g. v100, a100), got {shown!r}")

# Each packaged application's nearest Gavel job type: same architecture family, a batch size
# near the application's initial one (our choice; Gavel did not measure these applications).
APPLICATION_JOB_TYPES = {
    "cifar10": "ResNet-18 (batch size 128)",
    "imagenet": "ResNet-50 (batch size 128)",
    "bert": "Transformer (batch size 16)",
    "deepspeech2": "LM (batch size 20)",
    "ncf": "Recommendation (batch size 2048)",
    "yolov3": "CycleGAN",
}


@functools.lru_cache(maxsize=1)
def measured_steps_per_s() -> Mapping[str, Mapping[str, float]]:
    """Gavel job type -> GPU type -> steps/s on one GPU (Gavel's simulation_throughputs.json)."""
    table: dict[str, dict[str, float]] = {}
    text = resources.files("estimator.profiles").joinpath("gavel/throughputs.csv").read_text()
    for row in csv.DictReader(text.splitlines()):
        table.setdefault(row["job_type"], {})[row["gpu_type"]] = float(row["steps_per_s"])
    return table


def measured_types() -> tuple[str, ...]:
    """GPU types of the measured table."""
    return tuple(sorted({t for by_type in measured_steps_per_s().values() for t in by_type}))


def job_type_speed(job_type: str, gpu_type: str) -> float | None:
    """Speed of Gavel job type ``job_type`` on ``gpu_type`` relative to the reference, or None if not measured."""
    by_type = measured_steps_per_s().get(job_type, {})
    if gpu_type in ("", REFERENCE_TYPE):
        return 1.0
    own, reference = by_type.get(gpu_type), by_type.get(REFERENCE_TYPE)
    if not own or not reference:
        return None
    return own / reference


def application_speed(application: str, gpu_type: str) -> float | None:
    """Speed of ``application`` on ``gpu_type`` from the measured table, or None if it cannot say."""
    job_type = APPLICATION_JOB_TYPES.get(application)
    if gpu_type in ("", REFERENCE_TYPE):
        return 1.0
    return job_type_speed(job_type, gpu_type) if job_type else None


def on_type(model: JobModel, gpu_type: str, speed: float) -> JobModel:
    """``model`` (fitted on the reference type) as it runs on ``gpu_type``, ``speed`` times faster at compute."""
    if not speed > 0:
        raise ValueError(f"speed on {gpu_type!r} must be positive, got {speed!r}")
    perf = model.perf
    scaled = PerfParams(perf.alpha_c / speed, perf.beta_c / speed, *perf[2:])
    return dataclasses.replace(model, perf=scaled, gpu_type=gpu_type)


def typed_models(
    model: JobModel,
    gpu_types: Iterable[str],
    *,
    job_type: str = "",
    speeds: Mapping[str, float] | None = None,
) -> dict[str, JobModel]:
    """``model``'s model on each of ``gpu_types`` (untyped "" excluded).

    The speed on a type is, first found: ``speeds[type]`` (e.g. bootstrapped from
    observations), the measured speed of Gavel job type ``job_type``, the measured speed of
    the model's application, else 1.
    """
    result: dict[str, JobModel] = {}
    for gpu_type in dict.fromkeys(gpu_types):
        if not gpu_type:
            continue
        speed = (speeds or {}).get(gpu_type)
        if speed is None and job_type:
            speed = job_type_speed(job_type, gpu_type)
        if speed is None:
            speed = application_speed(model.application, gpu_type)
        result[gpu_type] = on_type(model, gpu_type, 1.0 if speed is None else speed)
    return result


def speed_from_observations(
    reference: JobModel,
    local_batch_sizes: Iterable[float],
    compute_times_s: Iterable[float],
) -> float:
    """A job's compute speed on a new type from a few measured steps (Sia's bootstrap).

    ``compute_times_s[k]`` is the measured compute part of a step (forward + backward, no
    synchronization: a 1-GPU step, or ``accum`` steps' compute) at per-GPU batch
    ``local_batch_sizes[k]``. The reference model predicts ``alpha_c + beta_c * local`` for
    it; the speed is the median of predicted / measured, robust to one straggler.
    ``ValueError`` with no usable observation.
    """
    local = np.asarray(list(local_batch_sizes), dtype=np.float64)
    measured = np.asarray(list(compute_times_s), dtype=np.float64)
    if local.shape != measured.shape:
        raise ValueError("need one compute time per local batch size")
    usable = (local > 0) & (measured > 0) & np.isfinite(measured)
    if not usable.any():
        raise ValueError("no usable observation (positive batch size and compute time)")
    predicted = reference.perf.alpha_c + reference.perf.beta_c * local[usable]
    return float(np.median(predicted / measured[usable]))


MIN_SPEED, MAX_SPEED = 1e-3, 1e3  # a type 1,000x slower or faster than the reference is a measuring error


def speed_from_step_times(
    reference: JobModel,
    nodes: Iterable[float],
    replicas: Iterable[float],
    local_batch_sizes: Iterable[float],
    accum_steps: Iterable[float],
    step_times_s: Iterable[float],
) -> float:
    """A job's compute speed on a new type from whole step times (no sync time measured).

    For each step, the speed ``s`` at which :func:`on_type` (reference, s) predicts exactly the
    measured step time (the step time falls as ``s`` grows, so bisection in log ``s`` finds it),
    clipped to [MIN_SPEED, MAX_SPEED] (a step faster than the reference's synchronisation alone
    gets MAX_SPEED); the median over steps. ``ValueError`` with no usable step.
    """
    columns = [np.asarray(list(values), dtype=np.float64) for values in
               (nodes, replicas, local_batch_sizes, accum_steps, step_times_s)]
    if len({column.shape for column in columns}) != 1:
        raise ValueError("need one value of each per step")
    node, replica, local, accum, measured = columns
    usable = (local > 0) & (measured > 0) & np.isfinite(measured) & (replica >= 1) & (node >= 1)
    if not usable.any():
        raise ValueError("no usable step (positive batch size and step time)")
    node, replica, local, accum, measured = (column[usable] for column in columns)
    perf = reference.perf
    low = np.full(len(measured), np.log(MIN_SPEED))
    high = np.full(len(measured), np.log(MAX_SPEED))
    for _ in range(48):  # the bracket is 14 wide in log: 48 halvings leave ~5e-14
        middle = (low + high) / 2
        speed = np.exp(middle)
        scaled = PerfParams(perf.alpha_c / speed, perf.beta_c / speed, *perf[2:])
        too_slow = step_time(scaled, node, replica, local, accum) > measured
        low = np.where(too_slow, middle, low)
        high = np.where(too_slow, high, middle)
    return float(np.clip(np.median(np.exp((low + high) / 2)), MIN_SPEED, MAX_SPEED))
