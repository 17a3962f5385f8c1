"""Workloads sampled from the Microsoft Philly trace (``simulator/traces/philly.csv``).

The mapping follows the way the Pollux artifact built its workloads from the same trace
(``workloads-realistic`` flavour: GPU counts come from the trace, batch sizes are untuned):

1. keep jobs that ran at least 60 s and used less than 1,000 GPU-hours (``max_gpu_hours``
   lowers that cap);
2. keep those submitted within ``hours`` hours of ``start_hour`` (time of day, any date):
   a job's arrival is its submission time of day minus ``start_hour``, divided by ``load``
   (``load`` 2 packs the same jobs into half the time: twice the arrival rate);
3. sample ``jobs`` of them without replacement with ``random.Random(seed)``;
4. the job's size in GPU-hours picks its application, and with it the epoch budget
   (``MAX_EPOCHS``, see :func:`simulator.workload.target_samples`):

   ===================  ================================  ===============
   Philly GPU-hours      application                       epochs
   ===================  ================================  ===============
   < 1                   cifar10 or ncf (even odds)        100 / 10
   1 - 10                deepspeech2 or bert (even odds)   80 / 2
   10 - 100              yolov3                            50
   >= 100                imagenet                          90
   ===================  ================================  ===============

5. ``num_replicas`` = the trace's ``num_gpus``, capped by what the application's batch
   limits allow (``max_batch // min_local_bsz``) and by ``max_gpus`` (64, the Pollux
   cluster); ``batch_size`` = the application's initial batch size x ``num_replicas``,
   capped at its largest validated batch size.

``mix="io"`` is the IO-bound variant of docs/evaluation.md ("Co-design: cache and remote IO",
"A Philly workload that reads its data"): the same GPU-hour buckets, but every job trains on
image or speech files (no bert on 30 MB of SQuAD text, no ncf on 0.5 GB of rating rows, the
two applications whose input is negligible next to their compute):

===================  ==========================================  ===============
Philly GPU-hours      application (dataset)                       epochs
===================  ==========================================  ===============
< 1                   cifar10 (CIFAR-10, 0.16 GB)                 100
1 - 10                yolov3 (VOC, 2.4 GB) or deepspeech2          50 / 80
                      (LibriSpeech, 60 GB), even odds
10 - 100              yolov3                                      50
>= 100                imagenet (ImageNet-1k, 146 GB)              90
===================  ==========================================  ===============

The same seed and arguments always give the same CSV.
"""

from __future__ import annotations

import csv
import datetime
import functools
import io
import math
import random
from dataclasses import dataclass
from importlib import resources

from simulator.errors import SimulatorInputError
from simulator.workload import JobSpec

# (upper bound in GPU-hours, applications to pick from with even odds)
APPLICATION_BY_GPU_HOURS = ((1.0, ("cifar10", "ncf")), (10.0, ("deepspeech2", "bert")), (100.0, ("yolov3",)), (math.inf, ("imagenet",)))
# The IO-bound mix: only applications that read image or speech files (module docstring).
IO_APPLICATION_BY_GPU_HOURS = ((1.0, ("cifar10",)), (10.0, ("deepspeech2", "yolov3")), (100.0, ("yolov3",)), (math.inf, ("imagenet",)))
MIXES = {"pollux": APPLICATION_BY_GPU_HOURS, "io": IO_APPLICATION_BY_GPU_HOURS}
MIN_DURATION_S = 60.0
MAX_GPU_HOURS = 1000.0
_EPOCH = datetime.date(1970, 1, 1)


@dataclass(frozen=True)
class PhillyJob:
    time_of_day_s: int
    duration_s: float
    num_gpus: int
    gpu_hours: float
    submit_s: float = 0.0      # submission, seconds since 1970-01-01 (the trace's clock, no time zone)
    cluster: str = ""          # the anonymised virtual cluster id


@functools.lru_cache(maxsize=1)
def read_trace() -> tuple[PhillyJob, ...]:
    """The packaged Philly trace; rows with empty or malformed fields are skipped."""
    text = resources.files("simulator.traces").joinpath("philly.csv").read_text(encoding="utf-8")
    reader = csv.DictReader(io.StringIO(text))
    jobs = []
    for row in reader:
        try:
            stamp = row["timestamp"].strip()
            day, clock = stamp.split(" ")
            hh, mm, ss = (int(x) for x in clock.split(":"))
            year, month, date = (int(x) for x in day.split("-"))
            submit = (datetime.date(year, month, date) - _EPOCH).days * 86400 + hh * 3600 + mm * 60 + ss
            jobs.append(PhillyJob(hh * 3600 + mm * 60 + ss, float(row["duration"]), int(float(row["num_gpus"])),
                                  float(row["gpu_time"]) / 3600.0, float(submit), (row.get("cluster") or "").strip()))
        except (KeyError, ValueError, IndexError, AttributeError):
            continue
    return tuple(jobs)


def application_for(gpu_hours: float, rng: random.Random, mix: str = "pollux") -> str:
    for bound, apps in MIXES[mix]:
        if gpu_hours < bound:
            return apps[0] if len(apps) == 1 else rng.choice(apps)
    raise AssertionError("unreachable")


def generate_philly(
    jobs: int,
    seed: int = 0,
    *,
    hours: float = 8.0,
    start_hour: float = 0.0,
    load: float = 1.0,
    max_gpus: int = 64,
    mix: str = "pollux",
    max_gpu_hours: float = MAX_GPU_HOURS,
) -> tuple[JobSpec, ...]:
    """``jobs`` jobs sampled from the Philly trace (see the module docstring), sorted by arrival."""
    if jobs < 1:
        raise SimulatorInputError(f"--jobs must be >= 1, got {jobs}")
    if not (0 < hours <= 24):
        raise SimulatorInputError(f"--hours must be in (0, 24], got {hours}")
    if not (0 <= start_hour < 24):
        raise SimulatorInputError(f"--start-hour must be in [0, 24), got {start_hour}")
    if not (load > 0 and math.isfinite(load)):
        raise SimulatorInputError(f"--load must be > 0, got {load}")
    if max_gpus < 1:
        raise SimulatorInputError(f"--max-gpus must be >= 1, got {max_gpus}")
    if mix not in MIXES:
        raise SimulatorInputError(f"mix must be one of {', '.join(MIXES)}, got {mix!r}")
    if not (0 < max_gpu_hours <= MAX_GPU_HOURS):
        raise SimulatorInputError(f"--max-gpu-hours must be in (0, {MAX_GPU_HOURS:g}], got {max_gpu_hours}")
    from estimator.profiles import load_profile

    start = start_hour * 3600.0
    window = hours * 3600.0
    candidates = []
    for job in read_trace():
        if job.duration_s < MIN_DURATION_S or job.gpu_hours >= max_gpu_hours or job.num_gpus < 1:
            continue
        offset = (job.time_of_day_s - start) % 86400.0
        if offset < window:
            candidates.append((offset, job))
    if len(candidates) < jobs:
        raise SimulatorInputError(f"--jobs {jobs}: only {len(candidates)} Philly jobs fall in the chosen window")
    rng = random.Random(seed)
    picked = rng.sample(candidates, jobs)
    specs = []
    for offset, job in picked:
        app = application_for(job.gpu_hours, rng, mix)
        bounds = load_profile(app).bounds
        replicas = max(1, min(job.num_gpus, max_gpus, bounds.max_batch_size // bounds.min_local_bsz))
        batch = min(bounds.init_batch_size * replicas, bounds.max_batch_size)
        specs.append((round(offset / load), app, replicas, batch))
    specs.sort(key=lambda s: s[0])
    return tuple(JobSpec(f"{app}-{i}", app, float(t), replicas, batch) for i, (t, app, replicas, batch) in enumerate(specs))


def trace_jobs(cluster: str | None = None) -> tuple[PhillyJob, ...]:
    """The trace's jobs (of one virtual cluster with ``cluster``) by submission, ties in file order."""
    jobs = read_trace()
    if cluster is not None:
        known = {job.cluster for job in jobs}
        if cluster not in known:
            raise SimulatorInputError(f"Philly virtual cluster {cluster!r}: not in the trace; known: {', '.join(sorted(known))}")
        jobs = tuple(job for job in jobs if job.cluster == cluster)
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].submit_s, i))
    return tuple(jobs[i] for i in order)


def replay_philly(
    seed: int = 0,
    *,
    cluster: str | None = None,
    max_gpus: int | None = None,
    mix: str = "pollux",
    min_duration_s: float = 0.0,
    max_gpu_hours: float = math.inf,
) -> tuple[JobSpec, ...]:
    """Every job of the Philly trace (or of its virtual cluster ``cluster``) at its own arrival time.

    A job arrives at its submission minus the first submission of the jobs replayed, asks for
    the trace's ``num_gpus`` (capped only by its application's batch limits, and ``max_gpus``
    when given), and gets its application and epoch budget from its GPU-hours exactly as
    :func:`generate_philly` maps a sampled job (``random.Random(seed)`` draws the even-odds
    choices, in arrival order). Nothing is sampled or filtered by default; ``min_duration_s``
    and ``max_gpu_hours`` keep only jobs that ran at least that long and used less than that
    (the sampler's filters are 60 s and 1,000 GPU-hours). Jobs are named
    ``<application>-<index>`` in arrival order; the same arguments give the same jobs.
    """
    if mix not in MIXES:
        raise SimulatorInputError(f"mix must be one of {', '.join(MIXES)}, got {mix!r}")
    if max_gpus is not None and max_gpus < 1:
        raise SimulatorInputError(f"--max-gpus must be >= 1, got {max_gpus}")
    from estimator.profiles import load_profile

    chosen = [job for job in trace_jobs(cluster)
              if job.num_gpus >= 1 and job.duration_s >= min_duration_s and job.gpu_hours < max_gpu_hours]
    if not chosen:
        raise SimulatorInputError("the Philly replay has no jobs (filters too strict)")
    rng = random.Random(seed)
    first = chosen[0].submit_s
    bounds: dict[str, object] = {}
    specs = []
    for index, job in enumerate(chosen):
        app = application_for(job.gpu_hours, rng, mix)
        if app not in bounds:
            bounds[app] = load_profile(app).bounds
        b = bounds[app]
        replicas = max(1, min(job.num_gpus, max_gpus or job.num_gpus, b.max_batch_size // b.min_local_bsz))
        batch = min(b.init_batch_size * replicas, b.max_batch_size)
        specs.append(JobSpec(f"{app}-{index}", app, job.submit_s - first, replicas, batch))
    return tuple(specs)


@dataclass(frozen=True)
class TraceShape:
    """What the Philly trace (or one virtual cluster) asked of its cluster, as it ran there."""

    jobs: int
    first_submit: str          # "YYYY-MM-DD HH:MM:SS"
    last_submit: str
    days: float                # last submission - first, in days
    gpu_hours: float           # sum of num_gpus x duration
    mean_busy_gpus: float      # GPUs busy on average from the first submission to the last finish
    peak_busy_gpus: int        # most GPUs busy at once (jobs as they ran on Philly)
    gpus_per_job: tuple[tuple[int, int], ...]   # (GPUs, jobs) by GPUs
    weeks: tuple[tuple[str, int, float, int], ...]  # (week starting, jobs submitted, mean busy GPUs, peak busy GPUs)


def trace_shape(cluster: str | None = None) -> TraceShape:
    """Jobs, days and GPU demand over time of the trace as it ran on Philly (durations from the
    trace: queueing on Philly is not in them), by week from the first submission."""
    jobs = trace_jobs(cluster)
    first = jobs[0].submit_s
    changes: dict[float, int] = {}
    for job in jobs:
        changes[job.submit_s] = changes.get(job.submit_s, 0) + job.num_gpus
        end = job.submit_s + job.duration_s
        changes[end] = changes.get(end, 0) - job.num_gpus
    end = max(job.submit_s + job.duration_s for job in jobs)
    week = 7 * 86400.0
    weeks = int(math.ceil((jobs[-1].submit_s - first + 1) / week))
    area = [0.0] * weeks          # GPU-seconds busy within each week
    peak = [0] * weeks
    submitted = [0] * weeks
    for job in jobs:
        submitted[int((job.submit_s - first) // week)] += 1
    busy, peak_all, last = 0, 0, first
    for t in sorted(changes):
        _spread(area, busy, last - first, t - first, week)
        busy += changes[t]
        last = t
        peak_all = max(peak_all, busy)
        w = int((t - first) // week)
        if 0 <= w < weeks:
            peak[w] = max(peak[w], busy)

    def stamp(s: float) -> str:
        return (datetime.datetime(1970, 1, 1) + datetime.timedelta(seconds=s)).strftime("%Y-%m-%d %H:%M:%S")

    counts: dict[int, int] = {}
    for job in jobs:
        counts[job.num_gpus] = counts.get(job.num_gpus, 0) + 1
    gpu_hours = sum(job.gpu_hours for job in jobs)
    return TraceShape(
        jobs=len(jobs), first_submit=stamp(first), last_submit=stamp(jobs[-1].submit_s),
        days=(jobs[-1].submit_s - first) / 86400.0, gpu_hours=gpu_hours,
        mean_busy_gpus=gpu_hours * 3600.0 / (end - first), peak_busy_gpus=peak_all,
        gpus_per_job=tuple(sorted(counts.items())),
        weeks=tuple((stamp(first + w * week)[:10], submitted[w], area[w] / min(week, end - first - w * week), peak[w])
                    for w in range(weeks)),
    )


def describe_shape(shape: TraceShape, name: str = "Philly trace") -> str:
    """``shape`` as text for a terminal or a page: totals, GPUs per job, then a row a week."""
    lines = [f"{name}: {shape.jobs:,} jobs submitted {shape.first_submit} to {shape.last_submit} ({shape.days:.1f} days)",
             f"{shape.gpu_hours:,.0f} GPU-hours as run on Philly; GPUs busy: {shape.mean_busy_gpus:,.0f} on average, "
             f"{shape.peak_busy_gpus:,} at the peak",
             "jobs by GPUs: " + ", ".join(f"{gpus}: {count:,}" for gpus, count in shape.gpus_per_job),
             "",
             "| week of | jobs | GPUs busy (mean) | GPUs busy (peak) |",
             "|---|---:|---:|---:|"]
    lines += [f"| {week} | {jobs:,} | {mean:,.0f} | {peak:,} |" for week, jobs, mean, peak in shape.weeks]
    return "\n".join(lines)


def _spread(area: list[float], busy: int, begin: float, end: float, width: float) -> None:
    """Add ``busy`` GPUs over [begin, end) to the per-``width`` buckets of ``area``."""
    if busy == 0 or end <= begin:
        return
    w = int(begin // width)
    while begin < end and w < len(area):
        stop = min(end, (w + 1) * width)
        area[w] += busy * (stop - begin)
        begin, w = stop, w + 1
