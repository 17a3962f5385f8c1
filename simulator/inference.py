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

**Lifecycle.** A :class:`Replica` goes RUNNING -> PROTECT -> SLEEP -> END
(:mod:`scheduler.deepboot.state`): when its task finishes it is kept warm and protected for
``30 s + 15 s x reuses`` (at most 120 s; :class:`ProtectSchedule`), then sleeps — still warm,
but its GPU is lendable — until its GPU is lent to training or given to another
application's task (or ``sleep_s`` passes, unlimited by default). A task of its application
reuses a PROTECT or SLEEP replica with no start-up cost; any other start pays the
application's cold start (DeepBoot artifact: 4-8 s per model). Time is injected: every method
takes ``now``. :class:`InferencePool` keeps a cluster's replicas and applies ATS-I decisions.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from scheduler.deepboot.ats_i import InferenceDecision
from scheduler.deepboot.costs import INFERENCE_COLD_START_S
from scheduler.deepboot.state import ReplicaState, ReplicaView, busy_gpus
from scheduler.policy import Plan
from simulator.errors import SimulatorInputError

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size", "duration", "num_task")
PREFIX = "infer-"
_APPLICATION = re.compile(r"^infer-(?P<model>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*?)-(?P<k>\d+)$")


def is_inference(application: str) -> bool:
    """Rows whose application starts with ``infer-`` are inference tasks."""
    return application.strip().startswith(PREFIX)


def model_of(application: str) -> str:
    """``infer-bert-2`` -> ``bert``; ``ValueError`` if it is not ``infer-<model>-<k>``."""
    match = _APPLICATION.match(application)
    if not match:
        raise ValueError(f"not an inference application (infer-<model>-<k>): {application!r}")
    return match["model"]


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


# --- replica lifecycle ----------------------------------------------------------------------


@dataclass(frozen=True)
class ProtectSchedule:
    """Protect time after a task: ``base_s + per_reuse_s x reuses``, at most ``max_s`` (30/45/60/.../120 s)."""

    base_s: float = 30.0
    per_reuse_s: float = 15.0
    max_s: float = 120.0

    def __post_init__(self):
        if not (0 <= self.base_s <= self.max_s and self.per_reuse_s >= 0):
            raise ValueError("need 0 <= base_s <= max_s and per_reuse_s >= 0")

    def protect_s(self, reuses: int) -> float:
        return min(self.base_s + self.per_reuse_s * reuses, self.max_s)


@dataclass(frozen=True)
class LifecycleConfig:
    protect: ProtectSchedule = ProtectSchedule()
    sleep_s: float = math.inf                            # a sleeper ends after this long (unless lent or evicted first)
    cold_start_s: Mapping[str, float] = field(default_factory=lambda: dict(INFERENCE_COLD_START_S))  # model -> s
    default_cold_start_s: float = 6.0                    # models the table lacks

    def cold_start(self, application: str) -> float:
        return float(self.cold_start_s.get(model_of(application), self.default_cold_start_s))


class ReplicaError(RuntimeError):
    """A transition the lifecycle does not allow (a bug in the caller)."""


class Replica:
    """One replica's state machine; timed transitions (PROTECT -> SLEEP -> END) happen when observed."""

    def __init__(self, replica_id: str, application: str, node: str, gpu: int, *, now: float, config: LifecycleConfig):
        model_of(application)  # validates the name
        self.replica_id, self.application, self.node, self.gpu = replica_id, application, node, gpu
        self.config = config
        self.reuses = 0                  # tasks served after the first
        self._state = ReplicaState.RUNNING
        self._since = now
        self._until = math.inf           # end of the current timed state
        self._seen = now

    def state(self, now: float) -> ReplicaState:
        if now < self._seen:
            raise ReplicaError(f"{self.replica_id}: time went backwards ({now} < {self._seen})")
        self._seen = now
        while now >= self._until:        # PROTECT ran out -> SLEEP; SLEEP ran out -> END
            if self._state is ReplicaState.PROTECT:
                self._enter(ReplicaState.SLEEP, self._until, self._until + self.config.sleep_s)
            else:
                self._enter(ReplicaState.END, self._until, math.inf)
        return self._state

    def next_change_s(self) -> float:
        """When the state will change by itself (inf: only a call changes it)."""
        return self._until

    def finish(self, now: float) -> float:
        """The task is done: RUNNING -> PROTECT; returns the end of the protect time."""
        self._expect(now, (ReplicaState.RUNNING,), "finish")
        self._enter(ReplicaState.PROTECT, now, now + self.config.protect.protect_s(self.reuses))
        return self._until

    def reuse(self, now: float) -> None:
        """A task of its application takes it: PROTECT or SLEEP -> RUNNING, no start-up."""
        self._expect(now, (ReplicaState.PROTECT, ReplicaState.SLEEP), "reuse")
        self.reuses += 1
        self._enter(ReplicaState.RUNNING, now, math.inf)

    def end(self, now: float) -> None:
        """Its GPU goes elsewhere (lent to training, or another application's task)."""
        self._expect(now, (ReplicaState.PROTECT, ReplicaState.SLEEP), "end")
        self._enter(ReplicaState.END, now, math.inf)

    def view(self, now: float) -> ReplicaView:
        return ReplicaView(self.replica_id, self.application, self.node, self.gpu, self.state(now), self._since)

    def _expect(self, now: float, allowed, action: str) -> None:
        state = self.state(now)
        if state not in allowed:
            raise ReplicaError(f"{self.replica_id}: cannot {action} a replica in state {state.value}")

    def _enter(self, state: ReplicaState, since: float, until: float) -> None:
        self._state, self._since, self._until = state, since, until


class InferencePool:
    """A cluster's inference replicas: what the engine keeps between events."""

    def __init__(self, config: LifecycleConfig = LifecycleConfig()):
        self.config = config
        self._replicas: dict[str, Replica] = {}
        self._next_id = 0

    def views(self, now: float) -> tuple[ReplicaView, ...]:
        """Live replicas (ended ones are forgotten)."""
        result = []
        for replica_id, replica in list(self._replicas.items()):
            if replica.state(now) is ReplicaState.END:
                del self._replicas[replica_id]
            else:
                result.append(replica.view(now))
        return tuple(result)

    def busy(self, now: float) -> dict[str, tuple[int, ...]]:
        """``ClusterSnapshot.inference_busy``: GPUs of RUNNING and PROTECT replicas."""
        return busy_gpus(self.views(now))

    def replica(self, replica_id: str) -> Replica:
        return self._replicas[replica_id]

    def start(self, decision: InferenceDecision, task: InferenceTask, now: float) -> tuple[str, float]:
        """Run ``task`` where ATS-I decided; returns ``(replica id, finish time)``.

        A reused replica starts at once; otherwise the sleeper (``sleep``) ends and a new
        replica pays its cold start. The caller applies ``decision.job_allocation`` to the
        training plan for a ``reclaim``.
        """
        if decision.kind == "wait":
            raise ReplicaError(f"{task.name}: ATS-I found no GPU; keep the task pending")
        if decision.kind == "reuse":
            self._replicas[decision.replica_id].reuse(now)
            return decision.replica_id, now + task.duration_s
        if decision.kind == "sleep":
            self._replicas[decision.replica_id].end(now)
        replica_id = f"{task.application}#{self._next_id}"
        self._next_id += 1
        self._replicas[replica_id] = Replica(replica_id, task.application, decision.node, decision.gpu, now=now, config=self.config)
        return replica_id, now + self.config.cold_start(task.application) + task.duration_s

    def finish(self, replica_id: str, now: float) -> float:
        """Its task is done; returns when its protect time ends."""
        return self._replicas[replica_id].finish(now)

    def end_lent(self, plan: Plan, now: float) -> tuple[str, ...]:
        """End the SLEEP replicas whose GPU ``plan`` gives to training; returns their ids."""
        taken = {(node, i) for allocation in plan.allocations.values() for node, indices in allocation.placement for i in indices}
        ended = []
        for view in self.views(now):
            if view.state is ReplicaState.SLEEP and (view.node, view.gpu) in taken:
                self._replicas[view.replica_id].end(now)
                ended.append(view.replica_id)
        return tuple(ended)

    def next_change_s(self) -> float:
        """Earliest timed transition of any replica (the engine wakes up then to re-plan lending)."""
        return min((r.next_change_s() for r in self._replicas.values()), default=math.inf)
