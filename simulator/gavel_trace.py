"""Gavel's Philly-derived traces as silod workloads (``--workload gavel/<trace>``).

A Gavel trace row names a *job type* Gavel measured on K80/P100/V100 (``ResNet-50 (batch
size 128)``...), the steps to run, the arrival time and the GPUs (its scale factor); see
``simulator/traces/gavel/SOURCE.md``. silod runs jobs on its applications' Pollux models, so
each row becomes a job of the application of the same family
(:data:`estimator.gpu_types.APPLICATION_JOB_TYPES`, inverted) that

- runs at the *Gavel job type's* measured speed on every GPU type (``JobSpec.job_type``:
  :func:`estimator.gpu_types.typed_models` scales the application's model by that job type's
  steps/s there over its steps/s on a V100), and
- has the work that makes it last as long on one V100 as Gavel measured: its ``total_steps``
  at the job type's V100 steps/s, times the application's goodput on one V100. On more GPUs it
  scales as the application's model says (Gavel's table for 2-8 GPUs was not copied).

The owner's batch is the application's initial one. Job types of no listed family (A3C) map
to the application :data:`FALLBACK_APPLICATION`.
"""

from __future__ import annotations

import csv
import functools
import io
from importlib import resources

from estimator.gpu_types import APPLICATION_JOB_TYPES, measured_steps_per_s
from estimator.job_model import JobModel
from estimator.predict import predict_one
from simulator.errors import SimulatorInputError
from simulator.workload import JobSpec, Workload

PREFIX = "gavel/"
FALLBACK_APPLICATION = "deepspeech2"  # A3C: an RNN policy network, nearest to the LM family
_FAMILIES = {job_type.split(" (")[0]: app for app, job_type in APPLICATION_JOB_TYPES.items()}


def application_of(job_type: str) -> str:
    """The packaged application standing in for Gavel job type ``job_type``."""
    return _FAMILIES.get(job_type.split(" (")[0], FALLBACK_APPLICATION)


def packaged_traces() -> list[str]:
    folder = resources.files("simulator.traces").joinpath("gavel")
    return sorted(PREFIX + entry.name[:-4] for entry in folder.iterdir() if entry.name.endswith(".csv"))


def load_gavel_trace(name: str) -> Workload:
    """The packaged trace ``gavel/<name>`` as a workload (``SimulatorInputError`` naming the problem)."""
    stem = name[len(PREFIX):] if name.startswith(PREFIX) else name
    entry = resources.files("simulator.traces").joinpath("gavel", f"{stem}.csv")
    if not entry.is_file():
        raise SimulatorInputError(f"workload {name}: no such Gavel trace; packaged: {', '.join(packaged_traces())}")
    return Workload(PREFIX + stem, parse_gavel_trace(entry.read_text(encoding="utf-8"), PREFIX + stem))


def parse_gavel_trace(text: str, source: str = "gavel trace") -> tuple[JobSpec, ...]:
    measured = measured_steps_per_s()
    jobs = []
    for row_number, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        where = f"workload {source} row {row_number}"
        job_type = row.get("job_type", "")
        if job_type not in measured:
            raise SimulatorInputError(f"{where} column 'job_type': unknown Gavel job type {job_type!r}")
        try:
            steps, arrival, gpus = int(row["total_steps"]), float(row["arrival_s"]), int(row["scale_factor"])
        except (KeyError, TypeError, ValueError):
            raise SimulatorInputError(f"{where}: needs whole total_steps and scale_factor and a numeric arrival_s") from None
        if steps < 1 or gpus < 1 or not arrival >= 0:
            raise SimulatorInputError(f"{where}: total_steps and scale_factor must be >= 1 and arrival_s >= 0")
        application = application_of(job_type)
        seconds_on_v100 = steps / measured[job_type]["v100"]
        jobs.append(JobSpec(
            name=f"gavel-{row_number - 2:05d}", application=application, arrival_s=arrival, num_replicas=gpus,
            batch_size=JobModel.from_profile(application).bounds.init_batch_size, job_type=job_type,
            target_samples=seconds_on_v100 * _one_gpu_goodput(application),
        ))
    return tuple(sorted(jobs, key=lambda j: j.arrival_s))


@functools.lru_cache(maxsize=None)
def _one_gpu_goodput(application: str) -> float:
    model = JobModel.from_profile(application)
    return float(predict_one(model, 1, 1, 0, float("inf"), model.bounds.init_batch_size).goodput_samples_per_s[0])
