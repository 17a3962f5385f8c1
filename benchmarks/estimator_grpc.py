"""Time Predict over gRPC: 10,000 (job, candidate allocation) pairs per call to a real ``silod estimator``.

Run: ``python benchmarks/estimator_grpc.py [--pairs N] [--runs R]``. Targets per 10,000 pairs:
in-process < 50 ms, over gRPC on loopback < 250 ms.

Starts ``silod estimator`` as a child process on 127.0.0.1 (no metadata service: models come
from the application profiles, as for jobs that have not reported yet) and times the same
workloads as ``benchmarks/estimator_predict.py`` both ways in one run:

- in-process: :func:`estimator.predict.predict` on a prebuilt ModelTable (what that benchmark
  measures);
- gRPC: one ``Predict`` call with one query per job, from a request built once. The time covers
  the client's serialization, loopback transfer, the server reading the request, resolving
  the models, building the ModelTable, predicting, encoding the answer, and the client parsing it.

Prints the median of ``--runs`` timed calls after one warm-up call, and checks once that the
gRPC answer equals the in-process numbers.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
try:
    import estimator  # noqa: F401
except ImportError:  # run from a clone without installing
    sys.path.insert(0, str(_HERE.parent))

import grpc  # noqa: E402

import estimator_predict  # noqa: E402  (the in-process benchmark next to this file)
from estimator.job_model import JobModel  # noqa: E402
from estimator.predict import ModelTable, Predictions, predict  # noqa: E402
from estimator.profiles import POLLUX_APPLICATIONS  # noqa: E402
from silod.launcher import start_service  # noqa: E402
from silod.v1 import estimator_pb2, estimator_pb2_grpc  # noqa: E402

IN_PROCESS_TARGET_S = 0.050
GRPC_TARGET_S = 0.250


def _jobs(count: int, rng: np.random.Generator) -> tuple[list[JobModel], list[tuple[str, int]]]:
    """Job models and what a client sends for them: (application, dataset_bytes)."""
    apps = POLLUX_APPLICATIONS
    models, wire = [], []
    for i in range(count):
        base = JobModel.from_profile(apps[i % len(apps)])
        dataset_bytes = int(base.dataset_bytes * rng.uniform(0.5, 2.0))
        models.append(base.with_dataset(dataset_bytes=dataset_bytes))
        wire.append((apps[i % len(apps)], dataset_bytes))
    return models, wire


def _request(wire: list[tuple[str, int]], candidates) -> estimator_pb2.PredictRequest:
    index, gpus, nodes, cache, io = candidates
    cache = np.floor(cache).astype(np.int64)  # bytes travel as integers
    request = estimator_pb2.PredictRequest()
    queries = [request.queries.add(job_id=f"job-{i:05d}", application=app, dataset_bytes=size) for i, (app, size) in enumerate(wire)]
    for i, g, n, c, b in zip(index.tolist(), gpus.tolist(), nodes.tolist(), cache.tolist(), io.astype(np.int64).tolist()):
        queries[i].candidates.add(gpus=g, nodes=n, cache_bytes=c, remote_io_bytes_per_s=b)
    return request


def _check_equal(response: estimator_pb2.PredictResponse, expected: Predictions) -> None:
    got = [p for result in response.results for p in result.predictions]
    for name in ("goodput_samples_per_s", "throughput_samples_per_s", "batch_size", "speedup"):
        values = np.array([getattr(p, name) for p in got])
        if not np.array_equal(values, getattr(expected, name)):
            raise SystemExit(f"gRPC answer differs from the in-process one in {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10_000, help="pairs per Predict call")
    parser.add_argument("--runs", type=int, default=15, help="timed calls per workload and path")
    parser.add_argument("--jobs", type=int, default=100, help="distinct jobs (one query each)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    models, wire = _jobs(args.jobs, rng)
    table = ModelTable(models)

    failed = False
    with start_service("estimator", "--log-level", "warning") as proc:
        options = [("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 256 * 2**20)]
        with grpc.insecure_channel(proc.address, options=options) as channel:
            stub = estimator_pb2_grpc.EstimatorServiceStub(channel)
            # Warm-up: the server fits its application profiles in the background after start;
            # wait for that so it neither slows the first timed call nor competes for the CPU
            # with the in-process timings.
            warm = estimator_pb2.PredictRequest(queries=[estimator_pb2.PredictQuery(application=app) for app in POLLUX_APPLICATIONS])
            stub.Predict(warm, timeout=60)
            time.sleep(1.0)
            print(f"silod estimator pid {proc.pid} on {proc.address}; {args.pairs} pairs of {args.jobs} jobs per call, median of {args.runs} runs")
            for name, workload in (("round", estimator_predict.round_workload), ("distinct", estimator_predict.distinct_workload)):
                candidates = workload(table, args.pairs, rng)
                index = candidates[0]
                # Requests group candidates by job; the in-process call gets them in that order too.
                order = np.argsort(index, kind="stable")
                grouped = tuple(np.asarray(c)[order] for c in candidates)
                grouped = (grouped[0], grouped[1], grouped[2], np.floor(grouped[3]), grouped[4].astype(np.int64).astype(np.float64))
                in_process = estimator_predict.time_calls(table, grouped, args.runs)

                request = _request(wire, grouped)
                response = stub.Predict(request, timeout=60)  # warm-up call
                _check_equal(response, predict(table, *grouped))
                timings = []
                for _ in range(args.runs):
                    start = time.perf_counter()
                    stub.Predict(request, timeout=60)
                    timings.append(time.perf_counter() - start)
                over_grpc = statistics.median(timings)

                pairs = len(index)
                for path, seconds, target in (("in-process", in_process, IN_PROCESS_TARGET_S), ("gRPC", over_grpc, GRPC_TARGET_S)):
                    scaled_target = target * pairs / 10_000
                    verdict = "ok" if seconds < scaled_target else "OVER TARGET"
                    failed |= seconds >= scaled_target
                    print(
                        f"estimator_predict {path:10s} [{name}]: {pairs} pairs, median {seconds * 1e3:6.1f} ms "
                        f"({seconds / pairs * 1e6:5.2f} us/pair; target < {scaled_target * 1e3:.0f} ms: {verdict})"
                    )
                print(f"  request {request.ByteSize() / 1e3:.0f} kB, response {response.ByteSize() / 1e3:.0f} kB")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
