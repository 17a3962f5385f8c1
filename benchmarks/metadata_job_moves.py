"""Time of the metadata store's batch of job state moves (TransitionJobs): what a scheduling
round's commit spends moving the jobs it placed and preempted.

    .venv/bin/python benchmarks/metadata_job_moves.py [--jobs 1000] [--db sqlite:///F | postgresql://...]
    .venv/bin/python benchmarks/metadata_job_moves.py --scratch-postgres postgresql://postgres@127.0.0.1:5432/postgres

``--db`` wants an empty, or new, database; ``--scratch-postgres`` creates a database of its own
on that server and drops it afterwards.

One batch places every job (PENDING -> SCHEDULED, "placed by plan 2 (generation g)" with g of
1-3, as a round's commit words it), the next requeues them all (SCHEDULED -> PENDING), three
times over, each batch answered whole and answered state only (TransitionJobsRequest.state_only,
as the scheduler asks), in turn. Figures per move: ``wall_ms`` (the database server's work
included: it runs beside this process) and ``cpu_ms`` (this process alone), the median batch of
each kind; ``state_only_cpu_ratio``: state-only CPU over whole, measured side by side. Then a
batch of progress writes of every job (UpdateJobsProgress, as task reports make them),
``progress_wall_ms_per_write`` and ``progress_cpu_ms_per_write``. Through the store's own code
on one thread, without gRPC.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.metadata_node_writes import add_database_arguments, database  # noqa: E402
from services.metadata.migrate import upgrade_engine  # noqa: E402
from services.metadata.store import MetadataStore  # noqa: E402
from services.runtime.errors import ServiceError  # noqa: E402
from silod.v1 import common_pb2  # noqa: E402

PENDING, SCHEDULED = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED
REPEATS = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000, help="moves per batch (the service takes up to 1,000)")
    add_database_arguments(parser)
    args = parser.parse_args(argv)
    with database(args) as url:
        print(json.dumps(run(url, args.jobs)))
    return 0


def run(url: str, jobs: int) -> dict[str, object]:
    store = MetadataStore.open(url)
    upgrade_engine(store.db.engine)
    created = store.jobs.create_many([(common_pb2.JobSpec(name=f"moves-{i}", min_gpus=1, max_gpus=1, batch_size=64,
                                                          epochs=1), "") for i in range(jobs)])
    ids = [job.id for job in created]
    timings: dict[str, list[tuple[float, float]]] = {
        f"{kind}{answer}": [] for kind in ("place", "requeue") for answer in ("", "_state_only")}
    for repeat in range(REPEATS):
        for state_only in (False, True):
            plan = 2 + 4 * repeat + 2 * state_only
            place = [(job_id, PENDING, SCHEDULED, f"placed by plan {plan} (generation {1 + i % 3})")
                     for i, job_id in enumerate(ids)]
            requeue = [(job_id, SCHEDULED, PENDING, f"preempted by plan {plan + 1}; requeued") for job_id in ids]
            for kind, moves in (("place", place), ("requeue", requeue)):
                gc.collect()
                wall, cpu = time.perf_counter(), time.process_time()
                results = store.jobs.transition_many(moves, state_only=state_only)
                timings[kind + ("_state_only" if state_only else "")].append(
                    (time.perf_counter() - wall, time.process_time() - cpu))
                refused = [r for r in results if isinstance(r, ServiceError)]
                assert not refused, refused[:3]
                assert all(r.state == moves[0][2] for r in results)
                assert all(r.HasField("spec") != state_only for r in results)
    events = store.jobs.list_events(ids[0])
    assert len(events) == 1 + 4 * REPEATS, events  # created, then every move
    # A batch of progress writes (UpdateJobsProgress: what rank 0's task reports write), each
    # job's progress and allocation, as the scheduler's report batches carry them.
    progress_timings = []
    for repeat in range(REPEATS):
        updates = [(job_id, common_pb2.JobProgress(samples_done=1000 * repeat + i, steps_done=repeat + 1),
                    common_pb2.ResourceVector(gpus=1 + i % 4)) for i, job_id in enumerate(ids)]
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        written = store.jobs.update_progress_many(updates)
        progress_timings.append((time.perf_counter() - wall, time.process_time() - cpu))
        assert not any(written), [w for w in written if w][:3]
    assert store.jobs.get(ids[-1]).progress.samples_done == 1000 * (REPEATS - 1) + jobs - 1
    store.close()
    result: dict[str, object] = {"jobs": jobs, "database": url.split(":", 1)[0].split("+", 1)[0]}
    for kind, pairs in timings.items():
        result[f"{kind}_wall_ms_per_move"] = round(statistics.median(w for w, _ in pairs) * 1000 / jobs, 3)
        result[f"{kind}_cpu_ms_per_move"] = round(statistics.median(c for _, c in pairs) * 1000 / jobs, 3)
    result["progress_wall_ms_per_write"] = round(statistics.median(w for w, _ in progress_timings) * 1000 / jobs, 3)
    result["progress_cpu_ms_per_write"] = round(statistics.median(c for _, c in progress_timings) * 1000 / jobs, 3)
    whole = sum(c for kind in ("place", "requeue") for _, c in timings[kind])
    brief = sum(c for kind in ("place", "requeue") for _, c in timings[kind + "_state_only"])
    result["state_only_cpu_ratio"] = round(brief / whole, 2)
    return result


if __name__ == "__main__":
    sys.exit(main())
