"""Inference tasks for DeepBoot simulations: workload rows, a task generator, and replica lifecycles.

**Rows.** A DeepBoot workload mixes training rows (the Pollux columns) and inference rows in
one CSV with the columns ``name,time,application,num_replicas,batch_size,duration,num_task``.
An inference row has ``application = infer-<model>-<k>`` (the k-th service of that model),
``num_replicas = 1`` (a task takes one GPU), ``duration`` = GPU seconds the task runs once
its replica is up, and ``num_task`` = requests it serves (carried along, not used for
timing). :func:`parse_inference_tasks` returns the inference rows of such a file and skips
the others (training rows are :mod:`simulator.workload`'s business).

**Generator.** :func:`generate_inference_tasks` draws arrivals from a seeded numpy generator
with a ``steady`` (Poisson), ``diurnal`` (rate ``mean x (1 + amplitude x sin(2 pi t / period))``)
or ``bursty`` (calm and burst phases of exponential length, bursts ``burst_factor`` times as
busy) pattern; all three have the same mean rate.

**Lifecycle.** The replica lifecycle (RUNNING -> PROTECT -> SLEEP -> END, protect times, cold
starts) and :class:`InferencePool` are in :mod:`scheduler.deepboot.replicas`, shared with the
live scheduler, and re-exported here.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

# The names and the replica lifecycle live with the scheduler (the live scheduler runs them too).
from scheduler.deepboot.replicas import (  # noqa: F401  (re-exported)
    _APPLICATION, PREFIX, InferencePool, LifecycleConfig, ProtectSchedule, Replica, ReplicaError, is_inference, model_of,
)
from simulator.errors import SimulatorInputError

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size", "duration", "num_task")
@dataclass(frozen=True)
class InferenceTask:
    name: str
    arrival_s: float        # seconds from the start of the workload
    application: str        # infer-<model>-<k>
    duration_s: float       # GPU seconds once a replica is up
    batch_size: int = 1
    num_task: int = 1       # requests served (not used for timing)

    @property
    def model(self) -> str:
        return model_of(self.application)


# --- reading and writing rows ---------------------------------------------------------------


def parse_inference_tasks(text: str, source: str = "workload") -> tuple[InferenceTask, ...]:
    """The inference rows of a (possibly mixed) workload CSV, by arrival; errors name the row and column."""
    reader = csv.reader(io.StringIO(text))
    header = [h.strip() for h in next(reader, [])]
    if "application" not in header:
        raise SimulatorInputError(f"workload {source}: header lacks column 'application'; expected {','.join(COLUMNS)}")
    tasks: list[InferenceTask] = []
    seen: dict[str, int] = {}
    for line, row in enumerate(reader, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) < len(header):
            raise SimulatorInputError(f"workload {source}: row {line}: {len(row)} fields, the header has {len(header)}")
        if not is_inference(row[header.index("application")]):
            continue
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise SimulatorInputError(f"workload {source}: row {line} is an inference task but the header lacks column {missing[0]!r}")
        tasks.append(_task(dict(zip(header, (cell.strip() for cell in row))), f"workload {source}: row {line}", seen, line))
    return tuple(sorted(tasks, key=lambda t: t.arrival_s))  # stable: ties keep file order


def _task(cells: dict[str, str], where: str, seen: dict[str, int], line: int) -> InferenceTask:
    def bad(column: str, expected: str) -> SimulatorInputError:
        return SimulatorInputError(f"{where}, column {column!r}: expected {expected}, got {cells[column]!r}")

    name = cells["name"]
    if not name:
        raise bad("name", "a task name")
    if name in seen:
        raise SimulatorInputError(f"{where}, column 'name': task {name!r} already defined in row {seen[name]}")
    seen[name] = line
    arrival = _number(cells["time"])
    if arrival is None or arrival < 0:
        raise bad("time", "seconds (a number >= 0)")
    if not _APPLICATION.match(cells["application"]):
        raise bad("application", "infer-<model>-<k>, e.g. infer-bert-1")
    if _number(cells["num_replicas"]) != 1:
        raise bad("num_replicas", "1 (an inference task takes one GPU)")
    batch = _number(cells["batch_size"])
    if batch is None or batch < 1 or batch != int(batch):
        raise bad("batch_size", "a whole number >= 1")
    duration = _number(cells["duration"])
    if duration is None or duration <= 0:
        raise bad("duration", "GPU seconds (a number > 0)")
    requests = _number(cells["num_task"])
    if requests is None or requests < 1 or requests != int(requests):
        raise bad("num_task", "a whole number >= 1")
    return InferenceTask(name, arrival, cells["application"], duration, int(batch), int(requests))


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def load_inference_tasks(path: str | Path) -> tuple[InferenceTask, ...]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SimulatorInputError(f"workload {path}: cannot read: {exc}") from None
    return parse_inference_tasks(text, str(path))


def format_inference_rows(tasks: Iterable[InferenceTask], *, header: bool = True) -> str:
    """CSV text of ``tasks`` in the mixed-workload columns (times to the millisecond)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if header:
        writer.writerow(COLUMNS)
    for t in tasks:
        writer.writerow((t.name, _short(t.arrival_s), t.application, 1, t.batch_size, _short(t.duration_s), t.num_task))
    return out.getvalue()


def mixed_rows(jobs, tasks: Iterable[InferenceTask]) -> str:
    """One CSV of training jobs (``simulator.workload.JobSpec``) and inference tasks, by arrival.

    Training rows leave ``duration`` and ``num_task`` empty: they are inference columns.
    """
    rows = [(j.arrival_s, 0, (j.name, _short(j.arrival_s), j.application, j.num_replicas, j.batch_size, "", "")) for j in jobs]
    rows += [(t.arrival_s, 1, (t.name, _short(t.arrival_s), t.application, 1, t.batch_size, _short(t.duration_s), t.num_task))
             for t in tasks]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows(row for _, _, row in sorted(rows, key=lambda r: (r[0], r[1])))
    return out.getvalue()


def _short(value: float) -> str:
    value = round(float(value), 3)
    return str(int(value)) if value.is_integer() else repr(value)


def write_inference_tasks(tasks: Iterable[InferenceTask], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_inference_rows(tasks), encoding="utf-8")


# --- generating tasks -----------------------------------------------------------------------

Pattern = Literal["steady", "diurnal", "bursty"]


@dataclass(frozen=True)
class ArrivalPattern:
    """How task arrivals vary over time; every pattern averages ``rate_per_s``."""

    kind: Pattern = "steady"
    rate_per_s: float = 0.1
    period_s: float = 86_400.0          # diurnal: one day
    amplitude: float = 0.8              # diurnal: peak = (1 + amplitude) x mean, in [0, 1]
    burst_factor: float = 10.0          # bursty: rate in a burst / rate when calm
    burst_share: float = 0.1            # bursty: long-run share of time in bursts, in (0, 1)
    mean_burst_s: float = 60.0          # bursty: mean length of one burst

    def __post_init__(self):
        if self.kind not in ("steady", "diurnal", "bursty"):
            raise ValueError(f"pattern must be steady, diurnal or bursty, got {self.kind!r}")
        if not (self.rate_per_s > 0 and self.period_s > 0 and 0 <= self.amplitude <= 1):
            raise ValueError("need rate_per_s > 0, period_s > 0 and 0 <= amplitude <= 1")
        if not (self.burst_factor >= 1 and 0 < self.burst_share < 1 and self.mean_burst_s > 0):
            raise ValueError("need burst_factor >= 1, 0 < burst_share < 1 and mean_burst_s > 0")

    def arrivals(self, rng: np.random.Generator, horizon_s: float) -> np.ndarray:
        """Arrival times in ``[0, horizon_s)``: a Poisson process at the peak rate, thinned to the pattern's rate."""
        if self.kind == "diurnal":
            peak = self.rate_per_s * (1 + self.amplitude)
            times = _poisson(rng, peak, horizon_s)
            rate = self.rate_per_s * (1 + self.amplitude * np.sin(2 * np.pi * times / self.period_s))
            return times[rng.random(times.size) * peak < rate]
        if self.kind == "bursty":
            # Calm rate r and burst rate f r average to the mean: r (1 - s) + f r s = mean.
            calm = self.rate_per_s / (1 - self.burst_share + self.burst_factor * self.burst_share)
            peak = calm * self.burst_factor
            times = _poisson(rng, peak, horizon_s)
            in_burst = self._bursts(rng, horizon_s, times)
            return times[rng.random(times.size) * peak < np.where(in_burst, peak, calm)]
        return _poisson(rng, self.rate_per_s, horizon_s)

    def _bursts(self, rng: np.random.Generator, horizon_s: float, times: np.ndarray) -> np.ndarray:
        """Whether each of ``times`` falls in a burst; phases alternate calm/burst with exponential lengths."""
        mean_calm = self.mean_burst_s * (1 - self.burst_share) / self.burst_share
        edges, t, burst = [], 0.0, False
        while t < horizon_s:
            t += rng.exponential(self.mean_burst_s if burst else mean_calm)
            edges.append(t)
            burst = not burst
        # Phase k (calm for even k) ends at edges[k].
        phase = np.searchsorted(np.array(edges), times, side="right")
        return phase % 2 == 1


def _poisson(rng: np.random.Generator, rate: float, horizon_s: float) -> np.ndarray:
    count = rng.poisson(rate * horizon_s)
    return np.sort(rng.uniform(0.0, horizon_s, count))  # given the count, arrivals are uniform


def generate_inference_tasks(
    *,
    seed: int,
    horizon_s: float,
    pattern: ArrivalPattern = ArrivalPattern(),
    models: Sequence[str] = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"),
    services_per_model: int = 1,
    duration_s: tuple[float, float] = (1.0, 10.0),
) -> tuple[InferenceTask, ...]:
    """Tasks arriving over ``[0, horizon_s)``: a uniformly chosen service ``infer-<model>-<k>``, duration uniform in ``duration_s``."""
    if horizon_s <= 0 or services_per_model < 1 or not models:
        raise ValueError("need horizon_s > 0, services_per_model >= 1 and at least one model")
    low, high = duration_s
    if not 0 < low <= high:
        raise ValueError(f"duration_s must be (low, high) with 0 < low <= high, got {duration_s!r}")
    rng = np.random.default_rng(seed)
    times = pattern.arrivals(rng, horizon_s)
    services = [f"{PREFIX}{m}-{k}" for m in models for k in range(1, services_per_model + 1)]
    picks = rng.integers(len(services), size=times.size)
    durations = rng.uniform(low, high, size=times.size)
    return tuple(
        InferenceTask(
            name=f"inference-{model_of(services[p])}-{i}",
            arrival_s=round(float(t), 3),
            application=services[p],
            duration_s=round(float(d), 3),
        )
        for i, (t, p, d) in enumerate(zip(times, picks, durations))
    )
