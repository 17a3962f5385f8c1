"""Time in-process batch prediction: 10,000 (job, candidate allocation) pairs per call.

Run: ``python benchmarks/estimator_predict.py [--pairs N] [--runs R]``. Target: well under
50 ms per 10,000 pairs. Two workloads:

- ``round``: what a scheduling round asks. 100 jobs of the six profiled applications, each
  with 100 candidates (GPU counts 1-64, packed or spread, several cache and IO grants),
  every candidate asking for the best batch size. Jobs and shapes repeat across cache/IO
  variants, which the predictor exploits.
- ``distinct``: worst case for the batch-size search. Every pair has its own job and
  shape, so nothing is shared.

Prints one line per workload with the median of ``--runs`` timed calls (after one warm-up).
The gRPC half of the benchmark comes with the estimator service.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

try:
    import estimator  # noqa: F401
except ImportError:  # run from a clone without installing
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from estimator.job_model import JobModel  # noqa: E402
from estimator.predict import ModelTable, predict  # noqa: E402
from estimator.profiles import POLLUX_APPLICATIONS  # noqa: E402


def _jobs(count: int, rng: np.random.Generator) -> list[JobModel]:
    apps = POLLUX_APPLICATIONS
    jobs = []
    for i in range(count):
        base = JobModel.from_profile(apps[i % len(apps)])
        jobs.append(base.with_dataset(dataset_bytes=base.dataset_bytes * rng.uniform(0.5, 2.0)))
    return jobs


def round_workload(table: ModelTable, pairs: int, rng: np.random.Generator):
    jobs = len(table)
    per_job = max(pairs // jobs, 1)
    index = np.repeat(np.arange(jobs), per_job)[:pairs]
    gpus = rng.choice([1, 2, 4, 8, 12, 16, 24, 32, 48, 64], index.size)
    spread = rng.random(index.size) < 0.25
    nodes = np.where(spread, np.minimum(gpus, np.maximum(gpus // 2, 1)), 0)
    cache = rng.choice([0.0, 0.25, 0.5, 1.0], index.size) * table.dataset_bytes[index]
    io = rng.choice([0.0, 1e8, 5e8, 1e9, 4e9], index.size)
    return index, gpus, nodes, cache, io


def distinct_workload(table: ModelTable, pairs: int, rng: np.random.Generator):
    index = rng.integers(0, len(table), pairs)
    gpus = rng.integers(1, 65, pairs)
    nodes = np.minimum(gpus, rng.integers(1, 17, pairs))
    cache = rng.uniform(0, 1, pairs) * table.dataset_bytes[index]
    io = rng.uniform(0, 2e9, pairs)
    return index, gpus, nodes, cache, io


def time_calls(table: ModelTable, candidates, runs: int) -> float:
    predict(table, *candidates)  # warm-up
    timings = []
    for _ in range(runs):
        start = time.perf_counter()
        predict(table, *candidates)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10_000, help="pairs per predict() call")
    parser.add_argument("--runs", type=int, default=15, help="timed calls per workload")
    parser.add_argument("--jobs", type=int, default=100, help="distinct jobs in the round workload")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)

    start = time.perf_counter()
    jobs = _jobs(args.jobs, rng)
    profiles_s = time.perf_counter() - start
    start = time.perf_counter()
    table = ModelTable(jobs)
    table_s = time.perf_counter() - start
    print(f"setup: profiles loaded and fitted in {profiles_s:.2f} s (once per process); ModelTable of {len(table)} jobs in {table_s * 1e3:.1f} ms")

    for name, workload in (("round", round_workload), ("distinct", distinct_workload)):
        candidates = workload(table, args.pairs, rng)
        median = time_calls(table, candidates, args.runs)
        pairs = len(candidates[0])
        print(f"estimator_predict in-process [{name}]: {pairs} pairs, median {median * 1e3:.1f} ms over {args.runs} runs ({median / pairs * 1e6:.2f} us/pair)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
