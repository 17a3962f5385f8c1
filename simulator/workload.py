"""Workloads: jobs from Pollux-format CSVs, and what "finished" means for each application.

A workload CSV has the Pollux artifact's columns ``name,time,application,num_replicas,batch_size``
and optionally ``tenant`` (the job's tenant, for tenant quotas; empty or absent: ``default``),
``cpus_per_rank`` (CPU cores each rank requests, fractions allowed) and ``memory_bytes_per_rank``
(bytes of memory each rank requests, a whole number): placement puts a rank only on a node
with that much not yet requested (the cluster's ``cpus`` and ``memory_bytes``); empty, 0 or
absent = none requested. Other columns are ignored. ``--workload`` takes a path, or the name of a packaged
workload (``workload-6``, ``workloads/workload-6.csv``, ``workloads-2.0/workload-6``); the
packaged ones live in ``simulator/workloads/<dir>/`` (see SOURCE.md there).

A job finishes after a fixed amount of *efficiency-weighted* progress, the Pollux artifact's
definition: its simulator ends a job when the job's progress, counted in steps at the
application's initial batch size, reaches the progress the validation runs record at the end
of epoch ``MAX_EPOCHS[app]`` (the smallest over the runs at different batch sizes). In samples
that is ``init_batch_size x progress`` — see :func:`target_samples` and docs/evaluation.md.

A DeepBoot workload may mix in inference rows (application ``infer-<model>-<k>``, columns
``...,duration,num_task``): they are not training jobs, so :func:`parse_workload` skips them
and :func:`mixed_workload` hands them to :mod:`simulator.inference`'s parser
(``Workload.inference``). Which parser reads a file or a name is :mod:`simulator.loading`'s choice.
"""

from __future__ import annotations

import csv
import functools
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from simulator.errors import SimulatorInputError

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")
REQUEST_COLUMNS = ("cpus_per_rank", "memory_bytes_per_rank")  # optional: what each rank requests
_REQUEST_LIMITS = {"cpus_per_rank": 4096.0, "memory_bytes_per_rank": 2**50}  # as the metadata service's
_REQUEST_EXPECTED = {"cpus_per_rank": "CPU cores per rank (a number in 0..4096)",
                     "memory_bytes_per_rank": "bytes per rank (a whole number in 0..2**50)"}
_PACKAGE = "simulator.workloads"
DEFAULT_DIR = "workloads"
_INFERENCE_PREFIX = "infer-"  # simulator.inference.PREFIX (not imported: that module pulls in the scheduler)


@dataclass(frozen=True)
class JobSpec:
    """One job of a workload, as the CSV gives it."""

    name: str
    application: str
    arrival_s: float        # seconds from the start of the workload
    num_replicas: int       # GPUs the owner asked for (what rigid policies give)
    batch_size: int         # the owner's global batch size
    job_type: str = ""      # Gavel job type whose measured speeds per GPU type the job has ("" = its application's)
    target_samples: float = 0.0  # efficiency-weighted samples to finish; 0 = the application's (target_samples())
    gpu_types: tuple[str, ...] = ()  # GPU types the job may run on; () = any
    tenant: str = "default"  # the tenant the job belongs to (tenant quotas, scheduler.quotas)
    cpus_per_rank: float = 0.0  # CPU cores each rank requests; 0 = none
    memory_bytes_per_rank: int = 0  # bytes of memory each rank requests; 0 = none


@dataclass(frozen=True)
class Workload:
    name: str                       # packaged name (``workloads/workload-6``) or the path given
    jobs: tuple[JobSpec, ...]       # in arrival order (ties: file order)
    inference: tuple = ()           # simulator.inference.InferenceTask rows of a mixed file, by arrival

    def __len__(self) -> int:
        return len(self.jobs)

    def head(self, count: int) -> "Workload":
        """The first ``count`` jobs by arrival (tests and quick looks)."""
        return Workload(f"{self.name}[:{count}]", self.jobs[:count], self.inference)


# --- what finishing means ------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def target_samples(application: str) -> float:
    """Efficiency-weighted samples a job of ``application`` needs to finish.

    ``init_batch_size x min over validation runs of progress[MAX_EPOCHS - 1]`` (progress is
    in steps at the initial batch size, so this is the samples-at-initial-batch-size
    equivalent of ``MAX_EPOCHS`` epochs). For cifar10, imagenet and yolov3 it equals
    ``MAX_EPOCHS x`` the dataset's training samples; for ncf and deepspeech2 the artifact
    trained on smaller datasets than the public ones listed in ``datasets.csv`` (4.97 M and
    7,134 samples per epoch), and the trace's own figure is what reproduces its JCTs.
    """
    from estimator.profiles import MAX_EPOCHS, load_profile

    profile = load_profile(application)
    traces = profile.validation.values()
    epochs = MAX_EPOCHS.get(application) or min(len(t.progress) for t in traces)
    progress = min(float(t.progress[min(epochs, len(t.progress)) - 1]) for t in traces)
    return profile.bounds.init_batch_size * progress


def known_applications() -> list[str]:
    from estimator.profiles import application_names

    return list(application_names())


# --- reading -------------------------------------------------------------------------------


def packaged_workloads() -> list[str]:
    """Names of the packaged workloads, ``<dir>/workload-N``."""
    names = []
    root = resources.files(_PACKAGE)
    for directory in sorted(root.iterdir(), key=lambda e: e.name):
        if directory.is_dir() and directory.name.startswith("workloads"):
            for entry in directory.iterdir():
                if entry.name.endswith(".csv"):
                    names.append(f"{directory.name}/{entry.name[:-4]}")
    return sorted(names, key=_natural)


def _natural(name: str):
    head, _, number = name.rpartition("-")
    return (head, int(number)) if number.isdigit() else (name, 0)


def _packaged(name: str):
    """The packaged resource for ``name``, or None."""
    key = name.strip().replace("\\", "/")
    for prefix in ("simulator/workloads/", "workloads:"):
        if key.startswith(prefix):
            key = key[len(prefix):]
    if key.endswith(".csv"):
        key = key[:-4]
    if "/" not in key:
        key = f"{DEFAULT_DIR}/{key}"
    directory, _, stem = key.partition("/")
    if not directory.startswith("workloads") or "/" in stem or not stem:
        return None
    entry = resources.files(_PACKAGE).joinpath(directory).joinpath(f"{stem}.csv")
    return (key, entry) if entry.is_file() else None


def mixed_workload(name: str, text: str) -> Workload:
    """Training jobs and (DeepBoot) inference tasks of one Pollux-format CSV."""
    from simulator.inference import parse_inference_tasks

    return Workload(name, parse_workload(text, name), parse_inference_tasks(text, name))


def packaged_csv(name: str) -> Workload | None:
    """The packaged Pollux-format workload ``name``, or None if there is none of that name."""
    packaged = _packaged(name)
    if packaged is None:
        return None
    key, entry = packaged
    return mixed_workload(key, entry.read_text(encoding="utf-8"))


def parse_workload(text: str, source: str = "workload") -> tuple[JobSpec, ...]:
    """Jobs of a workload CSV; ``SimulatorInputError`` naming the row and column on bad input."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise SimulatorInputError(f"workload {source}: empty file; expected the header {','.join(COLUMNS)}") from None
    header = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise SimulatorInputError(
            f"workload {source}: header lacks column {missing[0]!r}; expected {','.join(COLUMNS)} (got {','.join(header)})"
        )
    col = {c: header.index(c) for c in COLUMNS}
    tenant_col = header.index("tenant") if "tenant" in header else None
    optional = {c: header.index(c) for c in REQUEST_COLUMNS if c in header}
    apps = set(known_applications())
    jobs: list[JobSpec] = []
    seen: dict[str, int] = {}
    for line, row in enumerate(reader, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) < len(header):
            raise SimulatorInputError(f"workload {source}: row {line}: {len(row)} fields, the header has {len(header)}")

        def cell(column: str) -> str:
            return row[col[column]].strip()

        def bad(column: str, expected: str) -> SimulatorInputError:
            return SimulatorInputError(f"workload {source}: row {line}, column {column!r}: expected {expected}, got {cell(column)!r}")

        name = cell("name")
        if not name:
            raise bad("name", "a job name")
        if name in seen:
            raise SimulatorInputError(f"workload {source}: row {line}, column 'name': job {name!r} already defined in row {seen[name]}")
        seen[name] = line
        try:
            arrival = float(cell("time"))
        except ValueError:
            raise bad("time", "seconds (a number >= 0)") from None
        if not (math.isfinite(arrival) and arrival >= 0):
            raise bad("time", "seconds (a number >= 0)")
        application = cell("application")
        if application.startswith(_INFERENCE_PREFIX):  # an inference task (simulator.inference parses it)
            continue
        if application not in apps:
            raise bad("application", f"one of {', '.join(sorted(apps))}")
        replicas = _whole(cell("num_replicas"))
        if replicas is None or replicas < 1:
            raise bad("num_replicas", "a whole number >= 1")
        batch = _whole(cell("batch_size"))
        if batch is None or batch < 1:
            raise bad("batch_size", "a whole number >= 1")
        tenant = row[tenant_col].strip() if tenant_col is not None else ""
        requests = {}
        for column, index in optional.items():
            text = row[index].strip()
            value = _request(column, text)
            if value is None:
                raise SimulatorInputError(f"workload {source}: row {line}, column {column!r}: expected "
                                          f"{_REQUEST_EXPECTED[column]}, got {text!r}")
            requests[column] = value
        jobs.append(JobSpec(name, application, arrival, replicas, batch, tenant=tenant or "default", **requests))
    if not jobs:
        raise SimulatorInputError(f"workload {source}: no jobs (only a header, or only inference rows)")
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_s, i))
    return tuple(jobs[i] for i in order)


def _request(column: str, text: str) -> float | int | None:
    """A request column's value (empty = 0), or None if it is not one."""
    if not text:
        return 0
    try:
        value = float(text) if column == "cpus_per_rank" else _whole(text)
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and 0 <= value <= _REQUEST_LIMITS[column] else None


def _whole(text: str) -> int | None:
    try:
        value = float(text)
    except ValueError:
        return None
    if not math.isfinite(value) or value != int(value):
        return None
    return int(value)


def write_workload(jobs: Iterable[JobSpec], path: str | Path) -> None:
    """Write jobs in the Pollux CSV format (times as whole seconds when they are whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    jobs = list(jobs)
    requests = any(job.cpus_per_rank or job.memory_bytes_per_rank for job in jobs)  # their columns only then
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS + (REQUEST_COLUMNS if requests else ()))
        for job in jobs:
            time = int(job.arrival_s) if float(job.arrival_s).is_integer() else round(job.arrival_s, 3)
            extra = (f"{job.cpus_per_rank:g}", job.memory_bytes_per_rank) if requests else ()
            writer.writerow((job.name, time, job.application, job.num_replicas, job.batch_size, *extra))


def workload_from_jobs(jobs: Sequence[JobSpec], name: str = "custom") -> Workload:
    """A workload built in code (tests, generators); jobs are sorted by arrival."""
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise SimulatorInputError(f"workload {name}: duplicate job names")
    if not jobs:
        raise SimulatorInputError(f"workload {name}: no jobs")
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_s, i))
    return Workload(name, tuple(jobs[i] for i in order))
