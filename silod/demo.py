"""`make demo`: bring up silod on the embedded defaults and walk through the main path.

`silod up` brings a 4-node emulated cluster up (metadata on a SQLite file, estimator,
scheduler, a worker agent and a cache server per node); a sample dataset in a local
directory stands in for the remote store and its manifest is registered; a handful of
emulated jobs are submitted with `silod submit`, watched to completion, summarised (state,
JCT) and the cluster is shut down cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from silod.cli.main import main as silod

SAMPLE_FILES = 48
SAMPLE_BYTES = 64 * 1024  # about the size of a small JPEG


def make_sample_dataset(root: Path, seed: int = 7) -> tuple[int, int]:
    """Write class-per-folder random "images"; return (files, bytes)."""
    rng = random.Random(seed)
    total = 0
    for i in range(SAMPLE_FILES):
        folder = root / f"class-{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        size = rng.randint(SAMPLE_BYTES // 2, SAMPLE_BYTES * 3 // 2)
        (folder / f"img-{i:04d}.bin").write_bytes(rng.randbytes(size))
        total += size
    return SAMPLE_FILES, total


def _step(n: int, total: int, text: str) -> None:
    print(f"\n[{n}/{total}] {text}", flush=True)


def _run(*argv: str) -> None:
    print("    $ silod " + " ".join(argv), flush=True)
    code = silod(list(argv))
    if code:
        raise SystemExit(f"demo: `silod {' '.join(argv)}` failed with exit code {code}")


# (name, GPUs min-max, samples, seconds of emulated compute per step): a mix of short and
# longer, rigid and elastic jobs, more GPUs asked for in total than the cluster has.
DEMO_JOBS = [
    ("resnet-small", 1, 2, 960, 0.02),
    ("resnet-elastic", 2, 4, 3200, 0.02),
    ("bert-rigid", 4, 4, 2400, 0.03),
    ("vit-tiny", 1, 1, 640, 0.02),
    ("gpt-mini", 2, 8, 4800, 0.02),
]
NODES, GPUS_PER_NODE = 4, 2


def _start_cluster(workdir: Path) -> tuple[subprocess.Popen[bytes], dict]:  # type: ignore[type-arg]
    argv = [sys.executable, "-m", "silod.cli", "up", "--nodes", str(NODES), "--gpus-per-node", str(GPUS_PER_NODE),
            "--state-dir", str(workdir), "--interval-s", "1", "--log-level", "info"]
    print("    $ silod " + " ".join(argv[3:]), flush=True)
    up = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_stop_with_parent)
    deadline = time.monotonic() + 120
    while not (cluster_file := workdir / "cluster.json").exists():
        if up.poll() is not None:
            raise RuntimeError(f"`silod up` exited with code {up.returncode} before the cluster was ready")
        if time.monotonic() > deadline:
            up.send_signal(signal.SIGTERM)
            up.wait(60)
            raise RuntimeError("`silod up` not ready after 120 s")
        time.sleep(0.1)
    return up, json.loads(cluster_file.read_text())


def _stop_with_parent() -> None:
    """Linux: SIGTERM `silod up` (a clean shutdown) if the demo dies, e.g. piped into `head`."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _watch_all(scheduler: str, job_ids: list[str]) -> list:  # type: ignore[type-arg]
    """Progress of every job until all are terminal (a rich display on a TTY, plain lines otherwise)."""
    import grpc

    from silod.v1 import common_pb2, metadata_pb2, scheduler_pb2_grpc

    terminal = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)
    with grpc.insecure_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.JobServiceStub(channel)

        def poll() -> list:  # type: ignore[type-arg]
            return [stub.GetJob(metadata_pb2.GetJobRequest(job_id=j), timeout=10) for j in job_ids]

        deadline = time.monotonic() + 300
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn

            with Progress(TextColumn("{task.description:<40}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%")) as bar:
                tasks = {j: bar.add_task(j, total=1.0) for j in job_ids}
                while True:
                    jobs = poll()
                    for job in jobs:
                        state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
                        bar.update(tasks[job.id], completed=job.progress.fraction_done,
                                   description=f"{job.spec.name:<15} {state:<9} gpus={job.allocated.gpus}")
                    if all(j.state in terminal for j in jobs) or time.monotonic() > deadline:
                        return jobs
                    time.sleep(0.5)
        shown: dict[str, tuple[str, int]] = {}
        while True:
            jobs = poll()
            for job in jobs:
                state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
                key = (state, int(4 * job.progress.fraction_done))
                if shown.get(job.id) != key:
                    shown[job.id] = key
                    print(f"    {job.spec.name:<15} {state:<9} {100 * job.progress.fraction_done:5.1f}%  "
                          f"gpus={job.allocated.gpus}", flush=True)
            if all(j.state in terminal for j in jobs) or time.monotonic() > deadline:
                return jobs
            time.sleep(0.5)


def _summary(jobs: list) -> None:  # type: ignore[type-arg]
    from silod.v1 import common_pb2

    print(f"    {'JOB':<18} {'NAME':<15} {'STATE':<10} {'GPUS':>5} {'JCT':>7}")
    for job in jobs:
        state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
        jct = (job.finished_at.ToDatetime() - job.created_at.ToDatetime()).total_seconds() if job.finished_at.seconds else 0
        gpus = f"{job.spec.min_gpus}-{job.spec.max_gpus}" if job.spec.min_gpus != job.spec.max_gpus else str(job.spec.min_gpus)
        print(f"    {job.id:<18} {job.spec.name:<15} {state:<10} {gpus:>5} {jct:>6.1f}s")


def run_demo(workdir: Path) -> int:
    started = time.monotonic()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    store = workdir / "store" / "sample-images"
    print(f"silod demo — a {NODES}-node emulated cluster: metadata, estimator, scheduler, agents and caches")
    steps = 6

    _step(1, steps, f"generating a sample dataset in {store}")
    files, size = make_sample_dataset(store)
    print(f"    {files} files, {size / 2**20:.1f} MiB")

    _step(2, steps, f"starting the cluster: {NODES} emulated nodes x {GPUS_PER_NODE} GPUs, metadata on SQLite "
          f"({workdir / 'metadata.db'})")
    try:
        up, cluster = _start_cluster(workdir)
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    md = cluster["metadata"]
    try:
        _step(3, steps, "registering the dataset and reading it back")
        _run("health", md, "--service", "silod.v1.MetadataService")
        _run("dataset", "register", "sample-images", store.resolve().as_uri(), "--metadata", md,
             "--description", "demo: random bytes in class folders")
        _run("dataset", "list", "--metadata", md)
        _run("dataset", "show", "sample-images", "--objects", "5", "--metadata", md)

        _step(4, steps, f"submitting {len(DEMO_JOBS)} emulated training jobs")
        job_ids = []
        for name, lo, hi, samples, step_s in DEMO_JOBS:
            path = workdir / "jobs" / f"{name}.yaml"
            path.parent.mkdir(exist_ok=True)
            path.write_text(f"name: {name}\napplication: cifar10\nmin_gpus: {lo}\nmax_gpus: {hi}\nbatch_size: 32\n"
                            f"sample_budget: {samples}\nemulated_step_compute_s: {step_s}\n")
            print(f"    $ silod submit {path}", flush=True)
            code, out = _capture("submit", str(path), "--state-dir", str(workdir))
            if code:
                raise SystemExit(f"demo: `silod submit {path}` failed with exit code {code}")
            job_ids.append(out.strip())
            print(f"    {out.strip()}", flush=True)
        _run("jobs", "--state-dir", str(workdir))

        _step(5, steps, "watching the jobs to completion (the scheduler places, resizes and finishes them)")
        jobs = _watch_all(cluster["scheduler"], job_ids)
        print()
        _summary(jobs)
        _run("logs", job_ids[0], "--rank", "0", "--state-dir", str(workdir))
    finally:
        _step(6, steps, "stopping the cluster (SIGTERM: agents, caches, scheduler, estimator, metadata)")
        up.send_signal(signal.SIGTERM)
        try:
            code = up.wait(90)
        except subprocess.TimeoutExpired:
            up.kill()
            code = up.wait()
        print(f"    exited with code {code}")
    print(f"\ndemo finished in {time.monotonic() - started:.1f} s; state kept in {workdir}")
    return 0 if code == 0 else 1


def _capture(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = silod(list(argv))
    return code, buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m silod.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.environ.get("SILOD_DEMO_DIR", ".silod/demo"),
                        help="where the demo keeps its database, store and logs (wiped first)")
    return run_demo(Path(parser.parse_args(argv).workdir))


if __name__ == "__main__":
    sys.exit(main())
