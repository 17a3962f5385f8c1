"""Profile the real DDP example (examples/train_ddp_digits.py) into the estimator's profile format.

    .venv/bin/python benchmarks/profile_ddp_digits.py [--out estimator/profiles/digits]

Runs the example as real silod jobs on a `silod up` cluster of 2 nodes x 1 emulated GPU (PyTorch
DDP over gloo on CPU, the digits read from `silod store-emulator` through the nodes' cache
servers, unthrottled, a cache larger than the dataset), one rigid job at a time, at every
placement and local batch size asked for (default: placements 1 and 11, i.e. one rank, and one
rank on each node; 8, 16, 32 and 64 samples per rank). Each job runs ``--epochs`` epochs; the
first is the cold one (its misses are read from the store) and is left out: a step's time is
the median gap between rank 0's consecutive steps in the later epochs, when every sample is a
cache hit, so it is the job's compute speed T(g) (the SiloD model adds the IO side).

What is written, in the Pollux artifact's format (estimator/profiles/SOURCE.md):

* ``placements.csv``: placement, local_bsz, step_time, sync_time. ``sync_time`` is not measured
  apart (DDP overlaps the all-reduce with the backward pass): it is the step time at the
  placement minus the one-rank step time at the same local batch size (0 for one rank), the
  time the extra ranks add.
* ``scalability.csv``: no rows (no larger jobs fit this machine).
* ``overheads.csv``: per world size, the median ``launch_s`` (the plan placing a job to its first
  step: processes, imports, the process group, the first batch) and ``finish_s`` (its last step
  to the job recorded as finished: final checkpoint, exit, the agent's report) of the jobs
  profiled; the simulator charges these instead of its fixed restart cost.
* ``validation-<B>.csv`` for the jobs' global batch size ``--batch`` (the workload's): one row
  per epoch of the two-rank job at that batch size, with the gradient statistics the job
  measured (``ctx.distributed`` compares the ranks' gradients) as the estimator stored them;
  ``metric`` is the epoch's mean training loss (the example has no validation set); the gradient
  statistics are the estimator's estimate at the end of the job (one value for every row).

The emulated GPU: ``--sample-sleep-s`` per sample of a rank's share of the step
(``SILOD_EXAMPLE_SAMPLE_SLEEP_S``), on top of the real forward/backward/optimizer step on CPU.
This keeps each rank's CPU use to a fraction of a core, so two ranks and the services share
this 2-core machine without starving each other; the fraction is printed per row (CPU seconds
of the step / step time is not measured per rank: it is the step time minus the sleep).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from live_cluster import LiveCluster  # noqa: E402
from silod.launcher import start_service  # noqa: E402
from silod.v1 import common_pb2  # noqa: E402

EXAMPLE = REPO / "examples" / "train_ddp_digits.py"
APPLICATION = "cifar10"  # the profile being written does not exist yet: priced as cifar10 while profiling


def job_env(sample_sleep_s: float) -> dict[str, str]:
    """The environment every rank of the digits jobs gets (profiling and the fidelity workload)."""
    return {"SILOD_EXAMPLE_SAMPLE_SLEEP_S": str(sample_sleep_s), "OMP_NUM_THREADS": "1",
            "SILOD_CHECKPOINT_EVERY_S": "3600"}


def prepare_store(root: Path, datasets: list[str]) -> None:
    """The digits PNGs under ``root/bench/<dataset>`` for every dataset name (identical copies)."""
    first = root / "bench" / datasets[0]
    if not first.exists():
        import subprocess

        subprocess.run([sys.executable, str(EXAMPLE), "prepare", str(first)], check=True, capture_output=True)
    for name in datasets[1:]:
        if not (root / "bench" / name).exists():
            shutil.copytree(first, root / "bench" / name)


def step_time(steps: list[dict], skip_epochs: int = 1) -> tuple[float, int]:
    """(median seconds between rank 0's consecutive steps after the first ``skip_epochs``, steps used)."""
    rank0 = sorted((s for s in steps if s["rank"] == 0), key=lambda s: s["step"])
    gaps = [b["t"] - a["t"] for a, b in zip(rank0, rank0[1:]) if a["epoch"] >= skip_epochs and b["epoch"] == a["epoch"]]
    return (statistics.median(gaps), len(gaps)) if gaps else (float("nan"), 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "estimator" / "profiles" / "digits")
    p.add_argument("--placements", default="1,11", help="comma-separated per-node rank counts (2 nodes x 1 GPU)")
    p.add_argument("--local-bsz", default="8,16,32,64")
    p.add_argument("--batch", type=int, default=32, help="global batch size of the validation trace")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--sample-sleep-s", type=float, default=0.008)
    p.add_argument("--work", type=Path, default=None, help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="silod-profile-"))
    prepare_store(work / "store", ["digits"])
    store = start_service("store-emulator", "--root", str(work / "store"), "--log-level", "warning", workdir=work / "logs")
    rows: list[tuple[str, int, float, float]] = []
    measured: dict[tuple[str, int], float] = {}
    grad_job = ""
    launches: dict[int, list[float]] = {}  # world size -> seconds from the plan placing a job to its first step
    finishes: dict[int, list[float]] = {}  # world size -> seconds from its last step to its recorded finish
    load = [os.getloadavg()[0]]
    started = time.monotonic()
    cpu0 = os.times()
    try:
        with LiveCluster(work / "cluster", nodes=2, gpus_per_node=1, policy="fifo", cache="silod",
                         cache_disk_bytes=64 << 20, interval_s=1.0) as cluster:
            cluster.register("digits", "s3://bench/digits", f"endpoint_url=http://{store.address}", "anon=true")
            for placement in args.placements.split(","):
                world = sum(int(c) for c in placement)
                for local in (int(b) for b in args.local_bsz.split(",")):
                    spec = common_pb2.JobSpec(
                        name=f"profile-{placement}-{local}", application=APPLICATION, dataset="digits",
                        min_gpus=world, max_gpus=world, batch_size=local * world, epochs=args.epochs,
                        command=[sys.executable, str(EXAMPLE)], env=job_env(args.sample_sleep_s), resize_in_place=True)
                    job_id = cluster.submit(spec)
                    job = cluster.wait([job_id], 900)[job_id]
                    if job.state != common_pb2.JOB_STATE_SUCCEEDED:
                        raise RuntimeError(f"{spec.name} ended {common_pb2.JobState.Name(job.state)}; logs in {work}")
                    steps = cluster.steps(job_id)
                    seconds, used = step_time(steps)
                    placed = min(plan.at for plan in cluster.plans() if job_id in plan.gpus)
                    launches.setdefault(world, []).append(min(s["t"] for s in steps) - placed)
                    finishes.setdefault(world, []).append(job.finished_at.ToDatetime().timestamp() - max(s["t"] for s in steps))
                    measured[(placement, local)] = seconds
                    load.append(os.getloadavg()[0])
                    print(f"placement {placement} local_bsz {local}: step {seconds * 1000:.1f} ms over {used} steps "
                          f"(sleep {local * args.sample_sleep_s * 1000:.0f} ms), load {load[-1]:.2f}", flush=True)
                    if world > 1 and local * world == args.batch:
                        grad_job = job_id
            grad = cluster.md.GetJobModel(common_pb2.GetJobModelRequest(job_id=grad_job), timeout=10) if grad_job else None
            grad_steps = cluster.steps(grad_job) if grad_job else []
    finally:
        store.close()
    for (placement, local), seconds in sorted(measured.items()):
        alone = measured.get(("1", local), seconds)
        rows.append((placement, local, seconds, 0.0 if placement == "1" else max(seconds - alone, 0.0)))
    write_profile(args.out, rows, args.batch, grad, grad_steps)
    write_overheads(args.out, launches, finishes)
    cpu = os.times()
    for world in sorted(launches):
        print(f"{world} rank(s): launch (plan placing a job -> its first step) median {statistics.median(launches[world]):.2f} s "
              f"({min(launches[world]):.1f}-{max(launches[world]):.1f}), finish (last step -> finished) median "
              f"{statistics.median(finishes[world]):.2f} s ({min(finishes[world]):.1f}-{max(finishes[world]):.1f}): overheads.csv")
    print(f"wrote {args.out}; {time.monotonic() - started:.0f} s wall; this process and its children "
          f"{cpu.children_user - cpu0.children_user + cpu.user - cpu0.user:.0f} s CPU (not the cluster's); "
          f"load average {min(load):.2f}-{max(load):.2f}; logs in {work}")
    return 0


def write_overheads(out: Path, launches: dict[int, list[float]], finishes: dict[int, list[float]]) -> None:
    with open(out / "overheads.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["num_replicas", "launch_s", "finish_s", "jobs"])
        for world in sorted(launches):
            w.writerow([world, f"{statistics.median(launches[world]):.3f}", f"{statistics.median(finishes[world]):.3f}",
                        len(launches[world])])


def write_profile(out: Path, rows: list[tuple[str, int, float, float]], batch: int, grad, steps: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "placements.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["placement", "local_bsz", "step_time", "sync_time"])
        for placement, local, step, sync in rows:
            w.writerow([placement, local, f"{step:.6f}", f"{sync:.6f}"])
    with open(out / "scalability.csv", "w", newline="") as f:
        csv.writer(f).writerow(["num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time"])
    params = dict(grad.params) if grad is not None else {}
    sqr, var = params.get("grad.sqr_norm2", 0.0), params.get("grad.var_norm2", 0.0)
    if sqr <= 0:
        raise RuntimeError("the two-rank job reported no gradient statistics")
    rank0 = [s for s in steps if s["rank"] == 0 and s.get("loss") is not None]
    epochs = sorted({s["epoch"] for s in rank0})
    with open(out / f"validation-{batch}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["progress", "iteration", "metric", "grad_sqr", "grad_var"])
        for epoch in epochs:
            losses = [s["loss"] for s in rank0 if s["epoch"] == epoch]
            iteration = max(s["step"] for s in rank0 if s["epoch"] == epoch)
            # progress: steps at the initial batch size (here the trace's own), as in the artifact
            w.writerow([f"{iteration:.1f}", iteration, f"{statistics.mean(losses):.6f}", f"{sqr:.9g}", f"{var:.9g}"])


if __name__ == "__main__":
    sys.exit(main())
