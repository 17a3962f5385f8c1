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


@dataclass(frozen=True)
class PhillyJob:
    time_of_day_s: int
    duration_s: float
    num_gpus: int
    gpu_hours: float


@functools.lru_cache(maxsize=1)
def read_trace() -> tuple[PhillyJob, ...]:
    """The packaged Philly trace; rows with empty or malformed fields are skipped."""
    text = resources.files("simulator.traces").joinpath("philly.csv").read_text(encoding="utf-8")
    reader = csv.DictReader(io.StringIO(text))
    jobs = []
    for row in reader:
        try:
            stamp = row["timestamp"].strip()
            hh, mm, ss = (int(x) for x in stamp.split(" ")[1].split(":"))
            jobs.append(PhillyJob(hh * 3600 + mm * 60 + ss, float(row["duration"]), int(float(row["num_gpus"])), float(row["gpu_time"]) / 3600.0))
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
