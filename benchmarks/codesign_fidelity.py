"""Co-design fidelity: one small workload in the simulator and on a live ``silod up`` cluster,
with ``--cache silod`` and ``--cache lru``; prints each job's throughput side by side.

    .venv/bin/python benchmarks/codesign_fidelity.py [--modes silod,lru] [--jobs 6] [--epochs 4]

The workload is IO-bound on purpose, so the data resources decide the throughput: every job
is one emulated cifar10 rank (1 GPU) whose compute is nearly free, reading a dataset of
``--objects`` objects of ``--object-bytes`` from ``silod store-emulator`` (S3 on loopback)
through its node's cache server. The store serves at most ``--bandwidth-mb-s`` in total and the
scheduler is given the same figure as its storage budget. Jobs alternate between two datasets,
each larger than a node's cache, and all arrive at once.

The defaults (640 objects of 64 KiB, 40 MiB per dataset, 16 MiB of cache per node, 4 epochs)
are sized so that what the simulator does not model binds little: an epoch is 5 steps of 128
samples (with 160 objects nearly every step spanned two epochs, and live LRU hit far more than
the model of a shuffled epoch; with 320 still 1.3x), and 61 remote reads per second at 4 MB/s
leave the shared 2-core machine's CPU mostly out of the way (with 32 KiB objects, 122 reads/s,
a job alone reached 82-92 % of its grant under load 10-13).

The simulator runs the same cluster (nodes, GPUs, cache bytes per node, storage budget,
round interval) with the jobs' performance models given the live datasets' size and sample
size (``JobModel.with_dataset``) and their sample budgets. A job's throughput is its samples
over the time it ran (first RUNNING to finished live; first placement to finish in the
simulator, minus the simulator's restart cost, which stands for the launch). Both run fifo and
the same data step after it (:func:`scheduler.data_grants.grant`); the live scheduler prices
jobs with the estimator's fitted models.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from silod.launcher import start_service  # noqa: E402
from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402

TERMINAL = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)
APPLICATION = "cifar10"
BATCH = 128             # cifar10's initial batch size: statistical efficiency 1 in both worlds
STEP_COMPUTE_S = 0.001  # per step of BATCH samples: compute never limits an IO-bound job


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="silod,lru")
    p.add_argument("--jobs", type=int, default=6)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--objects", type=int, default=640)
    p.add_argument("--object-bytes", type=int, default=64 << 10)
    p.add_argument("--cache-bytes", type=int, default=16 << 20, help="per node: disk tier (memory tier 0)")
    p.add_argument("--bandwidth-mb-s", type=float, default=4.0, help="store emulator link = scheduler budget (1e6 B/s)")
    p.add_argument("--interval-s", type=float, default=2.0)
    p.add_argument("--launch-s", type=float, default=3.0,
                   help="simulator restart cost: a live job's launch (process start, imports) before it reads")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", default="", help="write the results as JSON here")
    return p.parse_args()


# ---- simulator -----------------------------------------------------------------------------------
def simulate(args: argparse.Namespace, mode: str, datasets: list[str], arrivals: dict[str, float]) -> dict[str, float]:
    from estimator.job_model import JobModel
    from simulator.cluster import ClusterSpec, uniform_nodes
    from simulator.engine import Simulator
    from simulator.workload import JobSpec, workload_from_jobs

    cluster = ClusterSpec(
        nodes=uniform_nodes(args.nodes, args.gpus_per_node, cache_bytes=float(args.cache_bytes)),
        restart_cost_s=args.launch_s, interval_s=args.interval_s, schedule_on_events=True,
        storage_bandwidth_bytes_per_s=args.bandwidth_mb_s * 1e6,
    )
    # Arrivals as the live run's submissions happened (milliseconds apart): a job admitted alone
    # keeps its GPUs when later ones compete for IO, in both worlds.
    specs = [JobSpec(name=f"job{i}", application=APPLICATION, arrival_s=arrivals.get(f"job{i}", 0.0), num_replicas=1,
                     batch_size=BATCH) for i in range(args.jobs)]
    sim = Simulator(workload_from_jobs(specs), "fifo", cluster, cache_mode=mode)
    model = JobModel.from_profile(APPLICATION).with_dataset(float(args.objects * args.object_bytes), float(args.object_bytes))
    for i, job in enumerate(sim._jobs):  # the live jobs' datasets and budgets (the CSV has no columns for them)
        job.model = model
        job.dataset = datasets[i % len(datasets)]
        job.target = float(args.epochs * args.objects)
        job.max_gpus = 1
    result = sim.run()
    return {r.name: r.target_samples / max(r.finish_s - r.start_s - args.launch_s, 1e-9) for r in result.jobs}


# ---- live ------------------------------------------------------------------------------------------
def live(args: argparse.Namespace, mode: str, datasets: list[str], store_address: str,
         work: Path) -> tuple[dict[str, float], dict[str, float]]:
    """(throughput, arrival offset in seconds) per job."""
    state = work / f"up-{mode}"
    env = {**os.environ, "SILOD_STORAGE_BANDWIDTH_BYTES_PER_S": str(int(args.bandwidth_mb_s * 1e6)),
           "SILOD_RESTART_COST_S": str(args.launch_s)}
    log = open(work / f"up-{mode}.log", "wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "silod.cli", "up", "--state-dir", str(state), "--nodes", str(args.nodes),
         "--gpus-per-node", str(args.gpus_per_node), "--policy", "fifo", "--cache", mode,
         "--interval-s", str(args.interval_s), "--cache-disk-bytes", str(args.cache_bytes),
         "--cache-memory-bytes", "0", "--no-dashboard", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        info = None
        deadline = time.monotonic() + 180
        while info is None:
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"silod up did not start; see {work / f'up-{mode}.log'}")
            try:
                info = json.loads((state / "cluster.json").read_text())
            except (OSError, ValueError):
                time.sleep(0.5)
        for name in datasets:
            subprocess.run([sys.executable, "-m", "silod.cli", "dataset", "register", name, f"s3://bench/{name}",
                            "--option", f"endpoint_url=http://{store_address}", "--option", "anon=true",
                            "--metadata", info["metadata"]], check=True, capture_output=True, timeout=300)
        md = metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(info["metadata"]))
        jobs = scheduler_pb2_grpc.JobServiceStub(grpc.insecure_channel(info["scheduler"]))
        ids = {}
        for i in range(args.jobs):
            spec = common_pb2.JobSpec(name=f"job{i}", application=APPLICATION, min_gpus=1, max_gpus=1,
                                      batch_size=BATCH, epochs=args.epochs, dataset=datasets[i % len(datasets)],
                                      emulated_step_compute_s=STEP_COMPUTE_S)
            ids[jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30, wait_for_ready=True).id] = spec.name
        deadline = time.monotonic() + args.timeout_s
        while True:
            found = {j.id: j for j in md.ListJobs(metadata_pb2.ListJobsRequest(page_size=1000), timeout=10).jobs if j.id in ids}
            if len(found) == len(ids) and all(j.state in TERMINAL for j in found.values()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("live jobs not finished: " + str({ids[k]: common_pb2.JobState.Name(j.state) for k, j in found.items()}))
            time.sleep(1.0)
        out = {}
        first = min(j.created_at.ToDatetime().timestamp() for j in found.values())
        arrivals = {ids[k]: j.created_at.ToDatetime().timestamp() - first for k, j in found.items()}
        for job_id, job in found.items():
            if job.state != common_pb2.JOB_STATE_SUCCEEDED:
                raise RuntimeError(f"{ids[job_id]} ended {common_pb2.JobState.Name(job.state)}")
            ran = job.finished_at.ToDatetime().timestamp() - job.started_at.ToDatetime().timestamp()
            out[ids[job_id]] = args.epochs * args.objects / max(ran, 1e-9)
        return out, arrivals
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()


def main() -> int:
    args = parse()
    modes = [m for m in args.modes.split(",") if m]
    datasets = ["dsa", "dsb"]
    work = Path(tempfile.mkdtemp(prefix="silod-fidelity-"))
    root = work / "store" / "bench"
    for name in datasets:
        (root / name).mkdir(parents=True)
        for i in range(args.objects):
            (root / name / f"{i:05d}.bin").write_bytes(os.urandom(args.object_bytes))
    store = start_service("store-emulator", "--root", str(work / "store"), "--bandwidth-mb-s", str(args.bandwidth_mb_s),
                          "--log-level", "warning", workdir=work / "logs")
    results: dict[str, dict[str, dict[str, float]]] = {}
    load_before = os.getloadavg()
    try:
        for mode in modes:
            started = time.monotonic()
            real, arrivals = live(args, mode, datasets, store.address, work)
            sim = simulate(args, mode, datasets, arrivals)
            results[mode] = {"sim": sim, "live": real}
            print(f"[{mode}] done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    finally:
        store.close()
    print(f"workload: {args.jobs} jobs x 1 GPU, {args.epochs} epochs of {args.objects} x {args.object_bytes} B, "
          f"datasets {datasets}; {args.nodes} nodes x {args.gpus_per_node} GPUs, cache {args.cache_bytes} B/node, "
          f"store = budget {args.bandwidth_mb_s} MB/s; work dir {work}")
    print("load average (1, 5, 15 min) at the start: {:.2f} {:.2f} {:.2f}, at the end: {:.2f} {:.2f} {:.2f}".format(
        *load_before, *os.getloadavg()))
    print("| mode | job | dataset | sim samples/s | live samples/s | live/sim |")
    print("|---|---|---|---:|---:|---:|")
    summary = {}
    for mode, r in results.items():
        errors = []
        for i, name in enumerate(sorted(r["sim"], key=lambda n: int(n[3:]))):
            s, l = r["sim"][name], r["live"].get(name, math.nan)
            errors.append(abs(l / s - 1))
            print(f"| {mode} | {name} | {datasets[i % len(datasets)]} | {s:.1f} | {l:.1f} | {l / s:.2f} |")
        summary[mode] = {
            "sim_mean": sum(r["sim"].values()) / len(r["sim"]), "live_mean": sum(r["live"].values()) / len(r["live"]),
            "max_rel_error": max(errors), "within_15pct": sum(e <= 0.15 for e in errors), "jobs": len(errors),
        }
    for mode, s in summary.items():
        print(f"{mode}: mean throughput sim {s['sim_mean']:.1f}, live {s['live_mean']:.1f} samples/s; "
              f"{s['within_15pct']}/{s['jobs']} jobs within 15%, worst {s['max_rel_error']:.0%}")
    if "silod" in summary and "lru" in summary:
        print(f"live silod / live lru mean throughput: {summary['silod']['live_mean'] / summary['lru']['live_mean']:.2f}x; "
              f"sim: {summary['silod']['sim_mean'] / summary['lru']['sim_mean']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
