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
  reference's, which few steps could not identify anyway;
- **enough configurations**: a full fit of the type's own log (:mod:`estimator.fitting`),
  starting from the bootstrapped model as its prior, so parameters the log cannot identify
  (e.g. multi-node terms of a job only seen on one node) keep the bootstrapped values.

Gradient statistics describe the model and data, not the hardware: reports from every type
update the one shared estimate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from numpy.typing import ArrayLike

from estimator.fitting import ObservationLog, update_grad_params
from estimator.gpu_types import REFERENCE_TYPE, on_type, speed_from_observations, typed_models
from estimator.job_model import JobModel
from estimator.observe import observe

# Distinct configurations on a type before its own full fit replaces the bootstrap.
FULL_FIT_CONFIGURATIONS = 3


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
        if gpu_type in ("", REFERENCE_TYPE):
            return self.reference
        if gpu_type in self.models:
            return self.models[gpu_type]
        return typed_models(self.reference, [gpu_type])[gpu_type]

    def observe(self, gpu_type: str, *steps: ArrayLike, grad_sqr: ArrayLike = 0.0, grad_var: ArrayLike = 0.0) -> JobModel:
        """Fold steps measured on ``gpu_type`` in; return the job's refitted model on that type.

        ``steps`` are :func:`estimator.observe.observe`'s ``gpus, nodes, batch_size,
        step_time_s[, sync_time_s]`` (``ValueError`` on impossible reports).
        """
        if gpu_type in ("", REFERENCE_TYPE):
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
        bootstrapped = (on_type(self.reference, gpu_type, speed) if speed is not None
                        else typed_models(self.reference, [gpu_type])[gpu_type])
        configurations = {(n, r, b) for n, r, b in zip(obs.nodes, obs.replicas, obs.local_bsz)}
        if len(configurations) < FULL_FIT_CONFIGURATIONS:
            return bootstrapped
        return dataclasses.replace(bootstrapped, perf=log.fit(prior=bootstrapped.perf))

