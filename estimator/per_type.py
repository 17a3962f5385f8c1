"""A job's models per GPU type, fitted online from the steps it reports on each type.

One :class:`TypedModels` per job holds its *reference* model (the application's profile,
refitted from steps on the reference type, :data:`estimator.gpu_types.REFERENCE_TYPE`, or on
untyped nodes) and one observation log per other type. What the job's model on type ``t``
is depends on how much was seen there:

- **nothing**: the reference model scaled by the measured speed of the application on ``t``
  (Gavel's table, :func:`estimator.gpu_types.typed_models`), or unscaled for a type the table
  does not know;
- **fewer than** :data:`FULL_FIT_CONFIGURATIONS` distinct (GPUs, nodes, local batch)
  configurations (a job's first minutes on a type): the reference model scaled by the speed
  the steps themselves show (:func:`estimator.gpu_types.speed_from_observations`, Sia's
  bootstrap) — one step of known compute time is enough, and the network terms stay the
  reference's, which few steps could not identify anyway. When no step shows its compute time
  (several GPUs, sync time not measured), the speed that makes the scaled reference predict
  the measured steps (:func:`estimator.gpu_types.speed_from_step_times`);
- **enough configurations**: a full fit of the type's own log (:mod:`estimator.fitting`),
  starting from the bootstrapped model as its prior, so parameters the log cannot identify
  (e.g. multi-node terms of a job only seen on one node) keep the bootstrapped values.

Gradient statistics describe the model and data, not the hardware: reports from every type
update the one shared estimate.

The per-type state travels in ``JobModelParams.params`` beside the reference model's keys
(:func:`types_to_params`): for each type ``t`` with observations, ``type[t].perf.*`` (its
fitted Pollux parameters, same keys as the reference's), ``type[t].compute_speed_ratio`` (the
bootstrapped speed) and ``type[t].obs.<i>.*`` (its observation log). The brackets keep the
type name apart from the key, since a type may contain dots ("a100.80gb").
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from numpy.typing import ArrayLike

from estimator.fitting import ObservationLog, update_grad_params
from estimator.goodput import PerfParams
from estimator.gpu_types import (
    MAX_SPEED,
    MIN_SPEED,
    REFERENCE_TYPE,
    gpu_type_problem,
    on_type,
    speed_from_observations,
    speed_from_step_times,
    typed_models,
)
from estimator.job_model import PERF_KEYS, JobModel
from estimator.observe import observe

# Distinct configurations on a type before its own full fit replaces the bootstrap.
FULL_FIT_CONFIGURATIONS = 3

SPEED_KEY = "compute_speed_ratio"
_TYPE_KEY = re.compile(r"type\[([^\]]*)\]\.(.+)")


def is_reference(gpu_type: str) -> bool:
    """Steps on untyped nodes and on the reference type refit the job's reference model."""
    return gpu_type in ("", REFERENCE_TYPE)


def type_key(gpu_type: str, key: str) -> str:
    """``key`` of the job's model on ``gpu_type`` in ``JobModelParams.params``."""
    return f"type[{gpu_type}].{key}"


@dataclass
class TypedModels:
    """Per-type models of one job (see the module docstring)."""

    reference: JobModel
    reference_log: ObservationLog = field(default_factory=ObservationLog)
    logs: dict[str, ObservationLog] = field(default_factory=dict)
    models: dict[str, JobModel] = field(default_factory=dict)
    speeds: dict[str, float] = field(default_factory=dict)  # bootstrapped compute speed per type

    def model_on(self, gpu_type: str) -> JobModel:
        """The job's current model on ``gpu_type`` ("" or the reference type: the reference model)."""
        if is_reference(gpu_type):
            return self.reference
        if gpu_type in self.models:
            return self.models[gpu_type]
        return typed_models(self.reference, [gpu_type])[gpu_type]

    def observe(self, gpu_type: str, *steps: ArrayLike, grad_sqr: ArrayLike = 0.0, grad_var: ArrayLike = 0.0) -> JobModel:
        """Fold steps measured on ``gpu_type`` in; return the job's refitted model on that type.

        ``steps`` are :func:`estimator.observe.observe`'s ``gpus, nodes, batch_size,
        step_time_s[, sync_time_s]`` (``ValueError`` on impossible reports).
        """
        if is_reference(gpu_type):
            self.reference = observe(self.reference, self.reference_log, *steps, grad_sqr=grad_sqr, grad_var=grad_var)
            # Other types' models share the gradient statistics and follow the new compute fit.
            self.models = {t: self._refit(t) for t in self.logs}
            return self.reference
        grad, reports = update_grad_params(self.reference.grad, self.reference.grad_reports, grad_sqr, grad_var)
        self.reference = dataclasses.replace(self.reference, grad=grad, grad_reports=reports)
        log = self.logs.setdefault(gpu_type, ObservationLog())
        scratch = dataclasses.replace(self.model_on(gpu_type), grad=grad, grad_reports=reports)
        # observe() validates the rows and appends them to the type's log; its fit is redone in _refit.
        observe(scratch, log, *steps)
        self.models = {t: self._refit(t) for t in self.logs}
        return self.models[gpu_type]

    def _refit(self, gpu_type: str) -> JobModel:
        log = self.logs[gpu_type]
        obs = log.observations()
        known, per_micro = obs.compute_per_microbatch()
        speed = self.speeds.get(gpu_type)
        if known.any():
            speed = speed_from_observations(self.reference, obs.local_bsz[known], per_micro[known])
            self.speeds[gpu_type] = speed
        elif len(obs.step_time):
            speed = speed_from_step_times(self.reference, obs.nodes, obs.replicas, obs.local_bsz, obs.accum_steps,
                                          obs.step_time)
            self.speeds[gpu_type] = speed
            if not MIN_SPEED * 1.001 < speed < MAX_SPEED / 1.001:
                # No compute speed explains the steps (e.g. faster than the reference's own
                # synchronisation): fit the type's log, starting from the closest scaled model.
                bootstrapped = on_type(self.reference, gpu_type, speed)
                return dataclasses.replace(bootstrapped, perf=log.fit(prior=bootstrapped.perf))
        bootstrapped = (on_type(self.reference, gpu_type, speed) if speed is not None
                        else typed_models(self.reference, [gpu_type])[gpu_type])
        configurations = {(n, r, b) for n, r, b in zip(obs.nodes, obs.replicas, obs.local_bsz)}
        if len(configurations) < FULL_FIT_CONFIGURATIONS:
            return bootstrapped
        return dataclasses.replace(bootstrapped, perf=log.fit(prior=bootstrapped.perf))



def types_to_params(models: Mapping[str, JobModel], logs: Mapping[str, ObservationLog],
                    speeds: Mapping[str, float]) -> dict[str, float]:
    """The per-type part of a job's ``JobModelParams.params`` (see the module docstring)."""
    params: dict[str, float] = {}
    for gpu_type, model in models.items():
        params.update({type_key(gpu_type, key): float(value) for key, value in zip(PERF_KEYS, model.perf)})
        if gpu_type in speeds:
            params[type_key(gpu_type, SPEED_KEY)] = float(speeds[gpu_type])
        log = logs.get(gpu_type)
        if log is not None:
            params.update({type_key(gpu_type, key): value for key, value in log.to_params().items()})
    return params


def types_from_params(
    reference: JobModel, params: Mapping[str, float]
) -> tuple[dict[str, JobModel], dict[str, ObservationLog], dict[str, float]]:
    """Inverse of :func:`types_to_params`: (models, logs, speeds) per type.

    A typed model shares ``reference``'s gradient statistics, batch limits and dataset (only
    the step-time parameters depend on the hardware). ``ValueError`` naming the key when a
    type name, its parameters or its speed are unusable.
    """
    grouped: dict[str, dict[str, float]] = {}
    for key, value in params.items():
        found = _TYPE_KEY.fullmatch(key)
        if found:
            grouped.setdefault(found[1], {})[found[2]] = value
    models, logs, speeds = {}, {}, {}
    for gpu_type, own in grouped.items():
        if not gpu_type or is_reference(gpu_type) or gpu_type_problem(gpu_type):
            raise ValueError(f"{type_key(gpu_type, '*')}: not a GPU type with a model of its own")
        missing = [key for key in PERF_KEYS if key not in own]
        if missing:
            raise ValueError(f"{type_key(gpu_type, missing[0])} is missing")
        perf = PerfParams(*(float(own[key]) for key in PERF_KEYS))
        models[gpu_type] = dataclasses.replace(reference, perf=perf, gpu_type=gpu_type)  # validates the ranges
        if SPEED_KEY in own:
            speed = float(own[SPEED_KEY])
            if not (speed > 0 and math.isfinite(speed)):
                raise ValueError(f"{type_key(gpu_type, SPEED_KEY)} must be a positive number, got {speed!r}")
            speeds[gpu_type] = speed
        logs[gpu_type] = ObservationLog.from_params(own)
    return models, logs, speeds


def fitted_type_models(reference: JobModel, params: Mapping[str, float]) -> dict[str, JobModel]:
    """The job's fitted models per GPU type in ``params`` (what GetJobModel and Observe return)."""
    return types_from_params(reference, params)[0]
