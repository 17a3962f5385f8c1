"""What the estimator knows about one job: its Pollux parameters, batch limits and dataset.

A :class:`JobModel` starts from the application's profile (:meth:`JobModel.from_profile`)
and is refitted from the job's observations (:mod:`estimator.fitting`). It serializes to the
flat ``dict[str, float]`` the metadata service stores (``JobModelParams.params``); every key
ends in its unit.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from estimator.goodput import BatchBounds, GradParams, PerfParams

# Keys of JobModelParams.params, in the order of the NamedTuple fields they hold.
PERF_KEYS = (
    "perf.alpha_c_s",
    "perf.beta_c_s_per_sample",
    "perf.alpha_n_s",
    "perf.beta_n_s_per_replica",
    "perf.alpha_r_s",
    "perf.beta_r_s_per_replica",
    "perf.gamma_dimensionless",
)
GRAD_KEYS = ("grad.sqr_norm2", "grad.var_norm2")  # squared gradient-norm units
GRAD_REPORTS_KEY = "grad.reports_count"
BOUNDS_KEYS = (
    "batch.init_samples",
    "batch.max_samples",
    "batch.min_local_samples",
    "batch.max_local_samples",
)
DATASET_KEYS = ("dataset.size_bytes", "dataset.sample_bytes")


@dataclass(frozen=True)
class JobModel:
    """Parameters of one job's performance model (see :mod:`estimator.goodput`, :mod:`estimator.silod_model`)."""

    application: str
    perf: PerfParams
    grad: GradParams
    bounds: BatchBounds
    dataset_bytes: float  # bytes of the dataset the job reads each epoch
    bytes_per_sample: float  # bytes read from remote storage per sample
    grad_reports: int = 0  # gradient-statistics reports folded into ``grad``
    gpu_type: str = ""  # GPU type the perf params describe; "" = the reference type (estimator.gpu_types)

    def __post_init__(self):
        if not (1.0 <= self.perf.gamma <= 10.0) or min(self.perf[:6]) < 0:
            raise ValueError(f"perf params out of range: {self.perf}")
        if self.grad.sqr < 0 or self.grad.var < 0:
            raise ValueError(f"grad params must be non-negative: {self.grad}")
        b = self.bounds
        if not (0 < b.init_batch_size <= b.max_batch_size and 0 < b.min_local_bsz <= b.max_local_bsz):
            raise ValueError(f"batch bounds inconsistent: {b}")
        if self.dataset_bytes < 0 or self.bytes_per_sample < 0:
            raise ValueError("dataset_bytes and bytes_per_sample must be non-negative")

    @classmethod
    def from_profile(cls, application: str) -> "JobModel":
        """Initial model of a job of ``application``: its profile's fit, typical gradient noise, dataset.

        ``KeyError`` when the application has no packaged profile.
        """
        return _profile_model(application)

    def with_dataset(self, dataset_bytes: float | None = None, bytes_per_sample: float | None = None) -> "JobModel":
        """Copy with the job's own dataset figures; ``None`` or 0 keeps the current value."""
        return dataclasses.replace(
            self,
            dataset_bytes=float(dataset_bytes) if dataset_bytes else self.dataset_bytes,
            bytes_per_sample=float(bytes_per_sample) if bytes_per_sample else self.bytes_per_sample,
        )

    def to_params(self) -> dict[str, float]:
        """Flat ``{key_with_unit: value}`` for ``JobModelParams.params``."""
        params = dict(zip(PERF_KEYS, map(float, self.perf)))
        params.update(zip(GRAD_KEYS, map(float, self.grad)))
        params[GRAD_REPORTS_KEY] = float(self.grad_reports)
        params.update(zip(BOUNDS_KEYS, map(float, self.bounds)))
        params.update(zip(DATASET_KEYS, (float(self.dataset_bytes), float(self.bytes_per_sample))))
        return params

    @classmethod
    def from_params(cls, application: str, params: dict[str, float]) -> "JobModel":
        """Inverse of :meth:`to_params`; keys it does not mention come from the application's profile.

        Unknown keys are ignored (other components may store more, e.g. an observation log).
        ``ValueError`` when a key is missing and the application has no profile.
        """
        try:
            fallback = cls.from_profile(application).to_params()
        except KeyError:
            fallback = {}
        merged = {**fallback, **params}
        needed = PERF_KEYS + GRAD_KEYS + BOUNDS_KEYS + DATASET_KEYS
        missing = [key for key in needed if key not in merged]
        if missing:
            raise ValueError(f"params lack {', '.join(missing)} and {application!r} has no profile to fill them")
        return cls(
            application=application,
            perf=PerfParams(*(float(merged[k]) for k in PERF_KEYS)),
            grad=GradParams(*(float(merged[k]) for k in GRAD_KEYS)),
            bounds=BatchBounds(*(int(round(merged[k])) for k in BOUNDS_KEYS)),
            dataset_bytes=float(merged[DATASET_KEYS[0]]),
            bytes_per_sample=float(merged[DATASET_KEYS[1]]),
            grad_reports=int(merged.get(GRAD_REPORTS_KEY, 0)),
        )


@functools.lru_cache(maxsize=None)
def _profile_model(application: str) -> JobModel:
    from estimator.profiles import load_profile  # deferred: loading fits the profile

    profile = load_profile(application)
    dataset = profile.dataset
    return JobModel(
        application=application,
        perf=profile.perf_params,
        grad=profile.typical_grad_params(),
        bounds=profile.bounds,
        dataset_bytes=float(dataset.total_bytes) if dataset else 0.0,
        bytes_per_sample=float(dataset.bytes_per_sample) if dataset else 0.0,
    )
