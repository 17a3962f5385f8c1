"""Online fitting of a job's model from what it reports.

Three paths:

- **Step times -> PerfParams.** :func:`fit_perf_params` fits the Pollux step-time model
  (:mod:`estimator.goodput`) to measured ``(nodes, replicas, local_bsz, accum_steps,
  step_time, sync_time)`` by bounded least squares on log times, as Pollux does: all
  parameters stay positive, ``gamma`` in [1, 10]. ``step_time - sync_time`` is taken as the
  compute of the ``accum_steps + 1`` micro-batches (Pollux's convention), so both the compute
  model and the whole step are fitted. Parameters the observations cannot identify are held
  at a prior, normally the application's profile fit, so a job that has only run on one
  node keeps the profile's inter-node behaviour instead of an arbitrary value:

  ============================  ==============================================================
  parameter                     free when the observations contain
  ============================  ==============================================================
  ``beta_c``                    any observation
  ``alpha_c``                   two or more distinct local batch sizes
  ``alpha_r``                   a single-node job with 2+ replicas
  ``beta_r``                    single-node jobs with 2+ distinct replica counts (>= 2)
  ``alpha_n``                   a multi-node job
  ``beta_n``                    multi-node jobs with 2+ distinct replica counts
  ``gamma``                     any multi-replica observation
  ============================  ==============================================================

  With one batch size only, ``alpha_c`` keeps the prior's share of the compute time (Pollux
  without a prior splits it half and half). ``gamma`` is only weakly determined when
  synchronisation is short next to compute; a tiny pull towards 1 settles it then.

- **Gradient statistics -> GradParams.** :func:`update_grad_params` keeps an exponential
  moving average of reported ``grad_sqr`` / ``grad_var``; the first report replaces the
  prior outright.

- **IO.** :func:`remote_read_bytes_per_s` and :func:`bytes_per_sample_from_io` turn observed
  hit ratios and step rates into remote traffic and an effective bytes-per-sample figure;
  :func:`is_io_bound` flags steps that ran slower than compute allows, whose step times
  measure IO stalls rather than compute and must not be fed to :func:`fit_perf_params`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.optimize
from numpy.typing import ArrayLike

from estimator.goodput import GradParams, PerfParams, compute_time, step_time

PARAM_NAMES = PerfParams._fields
_LOWER = np.array([1e-8] * 6 + [1.0])
_UPPER = np.array([np.inf] * 6 + [10.0])
# Pull towards gamma = 1 and small retrogression, weak enough to only break ties between
# fits the data cannot tell apart (2% noise gives squared log residuals ~4e-4).
_GAMMA_PULL = 1e-6
# Starting points for gamma: the objective is not convex in it.
_GAMMA_STARTS = (1.2, 3.0, 8.0)


@dataclass(frozen=True)
class StepObservations:
    """Measured steps, one entry per configuration (arrays of equal length)."""

    nodes: np.ndarray
    replicas: np.ndarray
    local_bsz: np.ndarray  # samples per GPU micro-batch (atomic batch)
    accum_steps: np.ndarray  # extra micro-batches per optimizer step
    step_time: np.ndarray  # seconds per optimizer step
    sync_time: np.ndarray  # seconds of synchronisation within it; 0 = unknown if replicas > 1

    @classmethod
    def of(cls, nodes, replicas, local_bsz, accum_steps, step_time, sync_time) -> "StepObservations":
        arrays = np.broadcast_arrays(*(np.atleast_1d(np.asarray(a, dtype=np.float64)) for a in (nodes, replicas, local_bsz, accum_steps, step_time, sync_time)))
        names = ("nodes", "replicas", "local_bsz", "accum_steps", "step_time", "sync_time")
        for name, array in zip(names, arrays):
            if not np.all(np.isfinite(array)) or np.any(array < 0):
                raise ValueError(f"{name} must be finite and non-negative")
        if np.any(arrays[0] < 1) or np.any(arrays[1] < arrays[0]) or np.any(arrays[2] <= 0) or np.any(arrays[4] <= 0):
            raise ValueError("need nodes >= 1, replicas >= nodes, local_bsz > 0 and step_time > 0")
        return cls(*(a.copy() for a in arrays))

    def compute_per_microbatch(self) -> tuple[np.ndarray, np.ndarray]:
        """``(mask, seconds)``: rows whose compute time is known and that time per micro-batch."""
        single = self.replicas <= 1
        compute = np.where(single, self.step_time, self.step_time - self.sync_time)
        known = (single | (self.sync_time > 0)) & (compute > 0)
        return known, np.where(known, compute, 1.0) / (self.accum_steps + 1.0)


def _free_mask(obs: StepObservations) -> np.ndarray:
    single_node = (obs.nodes == 1) & (obs.replicas > 1)
    multi_node = obs.nodes > 1
    free = np.zeros(7, dtype=bool)
    free[1] = True  # beta_c
    free[0] = len(np.unique(obs.local_bsz)) >= 2
    free[4] = single_node.any()
    free[5] = len(np.unique(obs.replicas[single_node])) >= 2
    free[2] = multi_node.any()
    free[3] = len(np.unique(obs.replicas[multi_node])) >= 2
    free[6] = (obs.replicas > 1).any()
    return free


def _default_prior(obs: StepObservations) -> np.ndarray:
    """Pollux's prior without a profile: compute split in half, optimistic (tiny) sync."""
    known, per_micro = obs.compute_per_microbatch()
    compute = per_micro[known] if known.any() else obs.step_time / (obs.accum_steps + 1.0)
    bsz = obs.local_bsz[known] if known.any() else obs.local_bsz
    alpha_c = float(np.mean(compute)) / 2.0
    beta_c = max(float(np.mean((compute - alpha_c) / bsz)), 1e-8)
    return np.array([alpha_c, beta_c, 1e-8, 1e-8, 1e-8, 1e-8, 1.0])


def fit_perf_params(
    nodes: ArrayLike,
    replicas: ArrayLike,
    local_bsz: ArrayLike,
    accum_steps: ArrayLike,
    step_time_s: ArrayLike,
    sync_time_s: ArrayLike,
    prior: PerfParams | None = None,
) -> PerfParams:
    """Fit :class:`PerfParams` to measured steps (module docstring); returns params within bounds.

    ``prior`` supplies the values of parameters the data cannot identify and the starting
    point; without it, Pollux's defaults (optimistic: unobserved sync costs ~0, except that
    inter-node sync is assumed at least 1.1x intra-node sync).
    """
    obs = StepObservations.of(nodes, replicas, local_bsz, accum_steps, step_time_s, sync_time_s)
    free = _free_mask(obs)
    base = np.clip(np.asarray(prior if prior is not None else _default_prior(obs), dtype=np.float64), _LOWER, _UPPER)
    known, per_micro = obs.compute_per_microbatch()
    if not free[0] and prior is not None:
        # One batch size: keep the prior's constant/linear split, scaled to the measured compute.
        rows = known if known.any() else np.ones_like(known)
        measured = per_micro[rows] if known.any() else obs.step_time / (obs.accum_steps + 1.0)
        scale = float(np.mean(measured / compute_time(PerfParams(*base), obs.local_bsz[rows])))
        base[0] = max(base[0] * scale, _LOWER[0])

    log_step = np.log(obs.step_time)
    log_compute = np.log(per_micro[known])
    # Compute time is step - sync: when sync dominates, that difference is mostly noise.
    # Weighting each log residual by compute / sqrt(step^2 + sync^2) (inverse of its noise
    # under equal relative noise on step and sync) gives all residuals about equal variance.
    total_compute = per_micro[known] * (obs.accum_steps[known] + 1.0)
    compute_weight = total_compute / np.hypot(obs.step_time[known], obs.sync_time[known])
    norm = 1.0 / np.sqrt(len(log_step) + int(known.sum()))

    def params_of(x: np.ndarray) -> np.ndarray:
        full = base.copy()
        full[free] = x
        return full

    def residuals(x: np.ndarray) -> np.ndarray:
        perf = PerfParams(*params_of(x))
        predicted_step = step_time(perf, obs.nodes, obs.replicas, obs.local_bsz, obs.accum_steps)
        predicted_compute = compute_time(perf, obs.local_bsz[known])
        return np.concatenate(
            [
                norm * (np.log(predicted_step) - log_step),
                norm * compute_weight * (np.log(predicted_compute) - log_compute),
                [np.sqrt(_GAMMA_PULL) * (perf.gamma - 1.0)],
            ]
        )

    def jacobian(x: np.ndarray) -> np.ndarray:
        perf = PerfParams(*params_of(x))
        predicted_step, step_gradient = step_time_gradient(perf, obs.nodes, obs.replicas, obs.local_bsz, obs.accum_steps)
        compute_rows = obs.local_bsz[known]
        compute_gradient = np.zeros((len(compute_rows), 7))
        compute_gradient[:, 0] = 1.0
        compute_gradient[:, 1] = compute_rows
        gamma_row = np.zeros((1, 7))
        gamma_row[0, 6] = np.sqrt(_GAMMA_PULL)
        full = np.concatenate(
            [
                norm * step_gradient / predicted_step[:, None],
                (norm * compute_weight / compute_time(perf, compute_rows))[:, None] * compute_gradient,
                gamma_row,
            ]
        )
        return full[:, free]

    lower, upper = _LOWER[free], _UPPER[free]
    best = None
    gamma_starts = _GAMMA_STARTS if free[6] else (base[6],)
    for gamma0 in gamma_starts:
        start = base.copy()
        start[6] = gamma0
        # Strictly inside the bounds: least_squares requires a feasible start.
        x0 = np.clip(start[free], lower + 1e-12, np.where(np.isfinite(upper), upper - 1e-9, np.inf))
        x0 = np.maximum(x0, lower * 1.0001 + 1e-12)
        result = scipy.optimize.least_squares(residuals, x0, jac=jacobian, bounds=(lower, upper), method="trf", x_scale="jac")
        if best is None or result.cost < best.cost:
            best = result
    fitted = np.clip(params_of(best.x), _LOWER, _UPPER)
    if prior is None and not free[2]:
        # Pollux's prior: crossing nodes is no cheaper than staying within one.
        fitted[2] = max(fitted[2], fitted[4] * 1.1)
        fitted[3] = max(fitted[3], fitted[5] * 1.1)
    return PerfParams(*map(float, fitted))


def step_time_gradient(perf: PerfParams, nodes, replicas, local_bsz, accum_steps) -> tuple[np.ndarray, np.ndarray]:
    """Step time (seconds) and its derivatives by the 7 parameters, shape ``(N, 7)``.

    With ``O = (T_grad^g + T_sync^g)^(1/g)``: ``dO/dT_grad = (T_grad/O)^(g-1)``,
    ``dO/dT_sync = (T_sync/O)^(g-1)``, and writing ``O = hi (1 + q^g)^(1/g)`` with
    ``q = lo/hi``, ``d ln O/dg = -ln(1 + q^g)/g^2 + q^g ln q / (g (1 + q^g))``.
    """
    nodes, replicas, bsz, accum = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (nodes, replicas, local_bsz, accum_steps)))
    gamma = perf.gamma
    grad = compute_time(perf, bsz)
    extra = np.maximum(replicas - 2.0, 0.0)
    across = (replicas > 1) & (nodes > 1)
    within = (replicas > 1) & (nodes <= 1)
    sync = np.where(across, perf.alpha_n + perf.beta_n * extra, np.where(within, perf.alpha_r + perf.beta_r * extra, 0.0))
    high = np.maximum(np.maximum(grad, sync), 1e-300)
    q = np.minimum(grad, sync) / high
    q_pow = q**gamma
    overlapped = high * (1.0 + q_pow) ** (1.0 / gamma)
    d_grad = accum + (grad / overlapped) ** (gamma - 1.0)
    d_sync = (sync / overlapped) ** (gamma - 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        q_log_term = np.where(q > 0, q_pow * np.log(np.where(q > 0, q, 1.0)), 0.0)
    d_log_gamma = -np.log1p(q_pow) / gamma**2 + q_log_term / (gamma * (1.0 + q_pow))
    gradient = np.stack(
        [
            d_grad,
            d_grad * bsz,
            np.where(across, d_sync, 0.0),
            np.where(across, d_sync * extra, 0.0),
            np.where(within, d_sync, 0.0),
            np.where(within, d_sync * extra, 0.0),
            overlapped * d_log_gamma,
        ],
        axis=1,
    )
    return accum * grad + overlapped, gradient


# --- Observation log ----------------------------------------------------------------------


@dataclass
class ObservationLog:
    """Running mean of step/sync times per configuration, what :func:`fit_perf_params` consumes.

    Keyed like AdaptDL's profile by ``(nodes, replicas, local_bsz, accum_steps)``, so its size
    is bounded by the configurations a job ran in, not by its number of steps. Serializes to
    flat ``dict[str, float]`` (keys ``obs.<i>.<field>_<unit>``) for the metadata store.
    """

    entries: dict[tuple[int, int, int, int], list[float]] = field(default_factory=dict)  # key -> [count, step_sum, sync_sum]

    def add(self, nodes: int, replicas: int, local_bsz: int, accum_steps: int, step_time_s: float, sync_time_s: float, count: float = 1.0) -> None:
        key = (int(nodes), int(replicas), int(local_bsz), int(accum_steps))
        entry = self.entries.setdefault(key, [0.0, 0.0, 0.0])
        entry[0] += count
        entry[1] += step_time_s * count
        entry[2] += sync_time_s * count

    def __len__(self) -> int:
        return len(self.entries)

    def observations(self) -> StepObservations:
        keys = np.array(list(self.entries), dtype=np.float64).reshape(-1, 4)
        sums = np.array(list(self.entries.values()), dtype=np.float64).reshape(-1, 3)
        return StepObservations.of(keys[:, 0], keys[:, 1], keys[:, 2], keys[:, 3], sums[:, 1] / sums[:, 0], sums[:, 2] / sums[:, 0])

    def fit(self, prior: PerfParams | None) -> PerfParams:
        """Refit from everything logged; the prior alone when nothing is logged."""
        if not self.entries:
            if prior is None:
                raise ValueError("no observations and no prior")
            return prior
        obs = self.observations()
        return fit_perf_params(obs.nodes, obs.replicas, obs.local_bsz, obs.accum_steps, obs.step_time, obs.sync_time, prior)

    _FIELDS = ("nodes_count", "replicas_count", "local_bsz_samples", "accum_steps_count", "weight_count", "step_time_s", "sync_time_s")

    def to_params(self) -> dict[str, float]:
        params = {}
        for i, (key, (count, step_sum, sync_sum)) in enumerate(self.entries.items()):
            values = (*key, count, step_sum / count, sync_sum / count)
            params.update({f"obs.{i}.{name}": float(v) for name, v in zip(self._FIELDS, values)})
        return params

    @classmethod
    def from_params(cls, params: dict[str, float]) -> "ObservationLog":
        log = cls()
        indices = sorted({int(k.split(".")[1]) for k in params if k.startswith("obs.")})
        for i in indices:
            v = [params[f"obs.{i}.{name}"] for name in cls._FIELDS]
            log.add(int(v[0]), int(v[1]), int(v[2]), int(v[3]), v[5], v[6], count=v[4])
        return log


# --- Gradient statistics ------------------------------------------------------------------

GRAD_EMA_WEIGHT = 0.3  # weight of the newest report; ~3 reports dominate


def update_grad_params(
    current: GradParams, observed_count: int, grad_sqr: ArrayLike, grad_var: ArrayLike, weight: float = GRAD_EMA_WEIGHT
) -> tuple[GradParams, int]:
    """Fold reports (oldest first) into an EMA; returns ``(params, reports folded so far)``.

    Reports with both statistics 0 mean "not measured" and are skipped. The first measured
    report replaces ``current`` (the profile prior) rather than averaging with it, because
    the job's own statistics beat another run's.
    """
    sqr_values = np.atleast_1d(np.asarray(grad_sqr, dtype=np.float64))
    var_values = np.atleast_1d(np.asarray(grad_var, dtype=np.float64))
    sqr, var, count = float(current.sqr), float(current.var), int(observed_count)
    for s, v in zip(*np.broadcast_arrays(sqr_values, var_values)):
        if not (np.isfinite(s) and np.isfinite(v)) or s < 0 or v < 0:
            raise ValueError("grad_sqr and grad_var must be finite and non-negative")
        if s == 0 and v == 0:
            continue
        if count == 0:
            sqr, var = float(s), float(v)
        else:
            sqr = (1.0 - weight) * sqr + weight * float(s)
            var = (1.0 - weight) * var + weight * float(v)
        count += 1
    return GradParams(sqr, var), count


# --- IO observations ----------------------------------------------------------------------


def remote_read_bytes_per_s(samples_per_s: ArrayLike, hit_ratio: ArrayLike, bytes_per_sample: ArrayLike) -> np.ndarray:
    """Remote bytes/s a job read: misses ``(1 - h)`` of ``samples_per_s``, ``s`` bytes each."""
    h = np.clip(np.asarray(hit_ratio, dtype=np.float64), 0.0, 1.0)
    return np.asarray(samples_per_s, dtype=np.float64) * np.asarray(bytes_per_sample, dtype=np.float64) * (1.0 - h)


def bytes_per_sample_from_io(remote_bytes_per_s: ArrayLike, samples_per_s: ArrayLike, hit_ratio: ArrayLike) -> np.ndarray:
    """Effective bytes per sample ``b / (X (1 - h))``; NaN where nothing missed or no samples ran."""
    misses = np.asarray(samples_per_s, dtype=np.float64) * (1.0 - np.clip(np.asarray(hit_ratio, dtype=np.float64), 0.0, 1.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(misses > 0, np.asarray(remote_bytes_per_s, dtype=np.float64) / np.where(misses > 0, misses, 1.0), np.nan)


def is_io_bound(observed_samples_per_s: ArrayLike, compute_samples_per_s: ArrayLike, tolerance: float = 0.1) -> np.ndarray:
    """True where a job ran more than ``tolerance`` below its predicted compute rate.

    Such steps were (most likely) waiting for input; their step times describe the IO grant,
    not the GPUs, and should be kept out of :func:`fit_perf_params`.
    """
    return np.asarray(observed_samples_per_s, dtype=np.float64) < (1.0 - tolerance) * np.asarray(compute_samples_per_s, dtype=np.float64)
