"""How big the metadata store grows in a day of a busy 1,000-node cluster, with and without
retention (services/metadata/store/retention.py).

    .venv/bin/python benchmarks/metadata_retention.py [--nodes 1000] [--jobs 3000] [--hours 2] [--out FILE.json]

Writes what a busy cluster writes, through the metadata store's own code, into two fresh
SQLite databases (one compacted with the default policy as the service would, every five
simulated minutes; one never), with simulated timestamps:

- a plan every ``--plan-every-s`` (60 s: a round that changed something) placing ``--jobs``
  jobs on ``--nodes`` nodes of 8 GPUs;
- two metric samples per running job per report (``--report-every-s``, 10 s), as the scheduler
  appends from the agents' reports;
- ``--jobs-per-hour`` jobs that finish (five state events each) and as many new ones.

A day at full rate does not fit this 2-core machine's time budget: the script writes
``--hours`` simulated hours at full rate, measures bytes per plan, per sample and per event
from them, and extrapolates both databases to 24 hours (the retained one's size is flat once
the retention windows are full: 6 h of plans, 24 h of samples). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.metadata.clock import to_timestamp  # noqa: E402
from services.metadata.migrate import upgrade_engine  # noqa: E402
from services.metadata.store import MetadataStore  # noqa: E402
from services.metadata.store.retention import RetentionPolicy  # noqa: E402
from google.protobuf import json_format  # noqa: E402

from silod.v1 import common_pb2, plan_pb2  # noqa: E402

GPUS_PER_NODE = 8


def _store(path: Path) -> MetadataStore:
    store = MetadataStore.open(f"sqlite:///{path}")
    upgrade_engine(store.db.engine)
    return store


def _plan(version: int, jobs: list[str], nodes: int, at: datetime) -> plan_pb2.AllocationPlan:
    plan = plan_pb2.AllocationPlan(version=version, policy="pollux", cache_mode="silod")
    plan.created_at.CopyFrom(to_timestamp(at))
    slots = [(f"node-{n:04d}", g) for n in range(nodes) for g in range(GPUS_PER_NODE)]
    per_job = max(1, len(slots) // max(1, len(jobs)))
    for i, job_id in enumerate(jobs):
        entry = plan.jobs.add(job_id=job_id, batch_size=256, generation=version, cache_policy="lrfu-cost",
                              gpu_type="a100", master_port=29500 + i % 1000)
        mine = slots[i * per_job:(i + 1) * per_job] or slots[:1]
        by_node: dict[str, list[int]] = {}
        for node, gpu in mine:
            by_node.setdefault(node, []).append(gpu)
        for node, gpus in by_node.items():
            entry.placements.add(node=node, gpu_indices=gpus)
            entry.cache_grants.add(node=node, cache_quota_bytes=8 << 30, remote_io_bytes_per_s=50_000_000)
    return plan


def simulate(path: Path, args: argparse.Namespace, compact: bool) -> dict[str, float]:
    store = _store(path)
    policy = RetentionPolicy()
    start = datetime.now(timezone.utc) - timedelta(hours=args.hours)
    spec = common_pb2.JobSpec(name="bench", application="cifar10", min_gpus=1, max_gpus=8, batch_size=256, epochs=10)
    running = [store.jobs.create(spec).id for _ in range(args.jobs)]
    seconds = int(args.hours * 3600)
    version = 0
    written = {"plans": 0, "samples": 0, "finished": 0}
    plan_bytes = sample_bytes = 0
    finish_every = 3600.0 / max(args.jobs_per_hour, 1)
    next_finish = finish_every
    for t in range(0, seconds, args.report_every_s):
        now = start + timedelta(seconds=t)
        if t % args.plan_every_s == 0:
            version += 1
            plan = _plan(version, running, args.nodes, now)
            store.plans.commit(plan)
            plan_bytes += len(json_format.MessageToJson(plan, indent=None))
            written["plans"] += 1
        samples = []
        for job_id in running:
            for name, value in (("step_time_s", 0.25), ("samples_per_s", 1024.0)):
                sample = common_pb2.MetricSample(job_id=job_id, name=name, value=value, labels={"node": "node-0001",
                                                                                              "rank": "0"})
                sample.time.CopyFrom(to_timestamp(now))
                samples.append(sample)
        store.metrics.append(samples)
        sample_bytes += len(samples) * len(json_format.MessageToJson(samples[0], indent=None))
        written["samples"] += len(samples)
        while t >= next_finish:
            done = running.pop(0)
            job = store.jobs.get(done)
            for state in (common_pb2.JOB_STATE_SCHEDULED, common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_SUCCEEDED):
                job = store.jobs.transition(done, job.state, state)
            running.append(store.jobs.create(spec).id)
            written["finished"] += 1
            next_finish += finish_every
        if compact and t % 300 == 0:
            store.retention.compact(policy, now=now)
    if compact:
        store.retention.compact(policy, now=start + timedelta(seconds=seconds))
    counts = store.retention.counts()
    store.close()
    size = os.path.getsize(path) + sum(os.path.getsize(p) for p in path.parent.glob(path.name + "-*"))
    return {"bytes": float(size), "plan_share": plan_bytes / max(plan_bytes + sample_bytes, 1),
            **{f"rows_{k}": float(v) for k, v in counts.items()},
            **{f"written_{k}": float(v) for k, v in written.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=3000, help="running jobs (default 3000: 8,000 GPUs busy)")
    parser.add_argument("--hours", type=float, default=2.0, help="simulated hours written at full rate")
    parser.add_argument("--plan-every-s", type=int, default=60)
    parser.add_argument("--report-every-s", type=int, default=10)
    parser.add_argument("--jobs-per-hour", type=int, default=500)
    parser.add_argument("--out", type=Path, help="JSON results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        kept = simulate(Path(tmp) / "kept.db", args, compact=False)
        retained = simulate(Path(tmp) / "retained.db", args, compact=True)
        took = time.monotonic() - started
    hours = args.hours
    policy = RetentionPolicy()
    # Growth per hour, split between plans and the rest by the plans' share of the stored JSON.
    per_hour = kept["bytes"] / hours
    plans_per_hour = per_hour * kept["plan_share"]
    rest_per_hour = per_hour - plans_per_hour
    kept_day = per_hour * 24
    retained_day = plans_per_hour * min(24.0, policy.plans_s / 3600) + rest_per_hour * min(24.0, policy.metrics_s / 3600)
    result = {"nodes": args.nodes, "jobs": args.jobs, "simulated_hours": hours, "seconds": round(took, 1),
              "without_retention": kept, "with_retention": retained,
              "extrapolated_24h_bytes": {"without_retention": kept_day, "with_retention": retained_day},
              "extrapolated_30d_bytes": {"without_retention": 30 * kept_day, "with_retention": retained_day}}
    print(f"{args.nodes} nodes x {GPUS_PER_NODE} GPUs, {args.jobs} running jobs, {hours:g} simulated hours "
          f"({took:.0f} s to write both)")
    for label, r in (("without retention", kept), ("with retention", retained)):
        print(f"  {label:<18} {r['bytes'] / 2**20:8.1f} MiB after {hours:g} h: {int(r['rows_plans'])} plans, "
              f"{int(r['rows_metric_samples']):,} metric samples, {int(r['rows_job_events']):,} job events")
    print(f"  plans are {kept['plan_share']:.0%} of what is written; without retention the store grows "
          f"{kept_day / 2**30:.1f} GiB a day for ever ({30 * kept_day / 2**30:.0f} GiB after 30 days); with the "
          f"default policy ({policy.plans_s / 3600:g} h of plans, {policy.metrics_s / 3600:g} h of samples) it "
          f"levels off at {retained_day / 2**30:.1f} GiB once a day has passed")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
