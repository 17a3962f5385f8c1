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

Two spellings of a trace are read: silod's CSV (``job_type,total_steps,arrival_s,scale_factor``,
what the packaged traces and ``silod simulate convert`` hold) and Gavel's own tab-separated
``.trace`` rows, in either of its layouts (:data:`TSV_LAYOUTS`): 7 fields, as in its msr traces,
or 10, as its trace generator writes them. The layout is told from each row's field count.
"""

from __future__ import annotations

import csv
import functools
import io
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

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


CSV_COLUMNS = ("job_type", "total_steps", "arrival_s", "scale_factor")
# Gavel's tab-separated layouts by field count: the fields a simulation reads, by position.
TSV_LAYOUTS = {
    7: ("job_type", "command", "num_steps_arg", "needs_data_dir", "total_steps", "arrival_s", "scale_factor"),
    10: ("job_type", "command", "working_directory", "num_steps_arg", "needs_data_dir", "total_steps",
         "scale_factor", "priority_weight", "SLO", "arrival_s"),
}


@dataclass(frozen=True)
class TraceRow:
    """One job of a Gavel trace: what silod reads of it."""

    line: int  # in the file, for messages
    job_type: str
    total_steps: int
    arrival_s: float
    scale_factor: int  # GPUs


def looks_like_gavel_tsv(text: str) -> bool:
    """Gavel's own format: tab-separated rows, no header."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    return "\t" in first


def looks_like_gavel_csv(text: str) -> bool:
    first = next((line for line in text.splitlines() if line.strip()), "")
    return {c.strip() for c in first.split(",")} >= {"job_type", "total_steps"}


def read_gavel_tsv(text: str, source: str) -> list[TraceRow]:
    """The rows of a ``.trace`` file as Gavel writes it (7 or 10 tab-separated fields a row)."""
    rows = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        fields = raw.rstrip("\r\n").split("\t")
        layout = TSV_LAYOUTS.get(len(fields))
        if layout is None:
            raise SimulatorInputError(
                f"workload {source} row {line}: {len(fields)} tab-separated fields; a Gavel trace row has 7 "
                f"({', '.join(TSV_LAYOUTS[7])}) or 10 ({', '.join(TSV_LAYOUTS[10])})")
        rows.append(_row(dict(zip(layout, fields)), line, source, lambda name, l=layout: f"field {l.index(name) + 1} ({name})"))
    if not rows:
        raise SimulatorInputError(f"workload {source}: no rows")
    return rows


def read_gavel_csv(text: str, source: str) -> list[TraceRow]:
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise SimulatorInputError(f"workload {source}: header lacks column {missing[0]!r}; expected {','.join(CSV_COLUMNS)}")
    rows = [_row(row, line, source, lambda name: f"column {name!r}") for line, row in enumerate(reader, start=2)]
    if not rows:
        raise SimulatorInputError(f"workload {source}: no rows")
    return rows


def _row(fields: dict[str, str], line: int, source: str, where: Callable[[str], str]) -> TraceRow:
    def bad(name: str, expected: str) -> SimulatorInputError:
        return SimulatorInputError(f"workload {source} row {line} {where(name)}: expected {expected}, "
                                   f"got {fields.get(name)!r}")

    job_type = (fields.get("job_type") or "").strip()
    if job_type not in measured_steps_per_s():
        raise SimulatorInputError(f"workload {source} row {line} {where('job_type')}: unknown Gavel job type "
                                  f"{job_type!r} (the known ones: estimator/profiles/gavel/throughputs.csv)")
    try:
        steps = int(fields["total_steps"])
    except (KeyError, TypeError, ValueError):
        raise bad("total_steps", "a whole number >= 1") from None
    if steps < 1:
        raise bad("total_steps", "a whole number >= 1")
    try:
        arrival = float(fields["arrival_s"])
    except (KeyError, TypeError, ValueError):
        raise bad("arrival_s", "seconds (a number >= 0)") from None
    if not (math.isfinite(arrival) and arrival >= 0):
        raise bad("arrival_s", "seconds (a number >= 0)")
    try:
        gpus = int(fields["scale_factor"])
    except (KeyError, TypeError, ValueError):
        raise bad("scale_factor", "a whole number of GPUs >= 1") from None
    if gpus < 1:
        raise bad("scale_factor", "a whole number of GPUs >= 1")
    return TraceRow(line, job_type, steps, arrival, gpus)


def write_gavel_csv(rows: Iterable[TraceRow], path: str | Path) -> int:
    """silod's CSV of a Gavel trace (what ``silod simulate convert`` writes); the row count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            writer.writerow((row.job_type, row.total_steps, repr(float(row.arrival_s)), row.scale_factor))
            count += 1
    return count


def parse_gavel_trace(text: str, source: str = "gavel trace") -> tuple[JobSpec, ...]:
    """The jobs of a Gavel trace in either spelling (silod's CSV, Gavel's tab-separated rows)."""
    rows = read_gavel_tsv(text, source) if looks_like_gavel_tsv(text) else read_gavel_csv(text, source)
    return jobs_of(rows)


def jobs_of(rows: list[TraceRow]) -> tuple[JobSpec, ...]:
    measured = measured_steps_per_s()
    jobs = []
    for index, row in enumerate(rows):
        application = application_of(row.job_type)
        seconds_on_v100 = row.total_steps / measured[row.job_type]["v100"]
        jobs.append(JobSpec(
            name=f"gavel-{index:05d}", application=application, arrival_s=row.arrival_s, num_replicas=row.scale_factor,
            batch_size=JobModel.from_profile(application).bounds.init_batch_size, job_type=row.job_type,
            target_samples=seconds_on_v100 * _one_gpu_goodput(application),
        ))
    return tuple(sorted(jobs, key=lambda j: j.arrival_s))


@functools.lru_cache(maxsize=None)
def _one_gpu_goodput(application: str) -> float:
    model = JobModel.from_profile(application)
    return float(predict_one(model, 1, 1, 0, float("inf"), model.bounds.init_batch_size).goodput_samples_per_s[0])
