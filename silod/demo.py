"""`make demo`: silod on one machine, from datasets in a slow store to jobs sharing GPUs with inference.

What it does, with real processes on loopback:

1. writes two generated datasets into a local directory served as S3 by ``silod
   store-emulator`` with a throttled link (the "remote" store);
2. starts ``silod up``: 2 training and 2 inference nodes (2 emulated GPUs each), the
   ``deepboot`` policy (idle inference GPUs are lent to elastic training) and ``silod``
   cache co-allocation; prints the web dashboard's URL;
3. registers both datasets and submits a mixed workload: elastic training jobs reading the
   datasets through their node's cache server (GPU compute is emulated with a sleep per step,
   as the DLCache paper did), then a burst of inference tasks that takes the inference GPUs back;
4. shows live progress, then a summary (JCT per job, cache hit ratios, GPUs lent) and a PNG
   chart of GPU use over time, and shuts the cluster down cleanly.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from silod.cli.main import main as silod

NODES, INFERENCE_NODES, GPUS_PER_NODE = 2, 2, 2
STORE_MB_S = 8.0            # the throttled "remote" link every cache miss crosses
CACHE_BYTES = 24_000_000    # disk cache per node: the smaller dataset fits, the larger one partly

# (dataset name, files, bytes per file): ImageNet-like samples and small text records.
DATASETS = (("images", 160, 110_000), ("text", 400, 12_000))

# (name, dataset, min GPUs, max GPUs, samples, seconds of emulated compute per step).
TRAINING_JOBS = (
    ("resnet-images", "images", 1, 4, 1_600, 0.05),
    ("vit-images", "images", 1, 2, 960, 0.05),
    ("bert-text", "text", 1, 4, 3_200, 0.04),
    ("gpt-mini", "", 2, 4, 4_800, 0.03),
)
# A burst of inference tasks arrives while training runs: (application, seconds of GPU time).
INFERENCE_BURST = (("infer-resnet50-1", 6.0), ("infer-resnet50-1", 6.0), ("infer-bert-1", 5.0),
                   ("infer-bert-1", 5.0), ("infer-resnet50-1", 4.0))
BURST_AFTER_S = 8.0
BATCH_SIZE = 16
MAX_BATCH_SIZE = 64  # goodput policies retune the batch; capped so every job takes tens of steps


def make_datasets(root: Path, seed: int = 7) -> list[tuple[str, int, int]]:
    """Random-byte files under ``root/demo/<dataset>/``; returns (name, files, bytes)."""
    rng = random.Random(seed)
    made = []
    for name, files, size in DATASETS:
        folder = root / "demo" / name
        folder.mkdir(parents=True, exist_ok=True)
        total = 0
        for i in range(files):
            data = rng.randbytes(rng.randint(size * 3 // 4, size * 5 // 4))
            (folder / f"{name}-{i:05d}.bin").write_bytes(data)
            total += len(data)
        made.append((name, files, total))
    return made


def _step(n: int, total: int, text: str) -> None:
    print(f"\n[{n}/{total}] {text}", flush=True)


def _run(*argv: str) -> None:
    print("    $ silod " + " ".join(argv), flush=True)
    code = silod(list(argv))
    if code:
        raise SystemExit(f"demo: `silod {' '.join(argv)}` failed with exit code {code}")


def _capture(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = silod(list(argv))
    return code, buf.getvalue()


def _stop_with_parent(parent: int) -> None:
    """Linux: SIGTERM the child (a clean shutdown) if the demo, ``parent``, dies, e.g. piped into
    `head`; a child whose demo died before the signal was set ends at once."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(143)


def _start_store(store: Path, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    ready = workdir / "store-emulator.ready"
    log = open(workdir / "store-emulator.log", "wb")
    argv = [sys.executable, "-m", "silod.cli", "store-emulator", "--root", str(store), "--listen", "127.0.0.1:0",
            "--bandwidth-mb-s", f"{STORE_MB_S:g}", "--latency-ms", "5", "--ready-file", str(ready)]
    print("    $ silod " + " ".join(argv[3:]), flush=True)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=functools.partial(_stop_with_parent, os.getpid()))
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"store emulator did not start; see {workdir / 'store-emulator.log'}")
        time.sleep(0.1)
    return proc, ready.read_text().strip()


def _start_cluster(workdir: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    argv = [sys.executable, "-m", "silod.cli", "up", "--nodes", str(NODES), "--inference-nodes", str(INFERENCE_NODES),
            "--gpus-per-node", str(GPUS_PER_NODE), "--policy", "deepboot", "--cache", "silod",
            "--cache-disk-bytes", str(CACHE_BYTES), "--state-dir", str(workdir), "--interval-s", "1"]
    print("    $ silod " + " ".join(argv[3:]), flush=True)
    up = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=functools.partial(_stop_with_parent, os.getpid()))
    deadline = time.monotonic() + 180
    while not (cluster_file := workdir / "cluster.json").exists():
        if up.poll() is not None:
            raise RuntimeError(f"`silod up` exited with code {up.returncode} before the cluster was ready")
        if time.monotonic() > deadline:
            up.send_signal(signal.SIGTERM)
            up.wait(60)
            raise RuntimeError("`silod up` not ready after 180 s")
        time.sleep(0.1)
    return up, json.loads(cluster_file.read_text())


def _submit(workdir: Path, name: str, body: str) -> str:
    path = workdir / "jobs" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"name: {name}\n{body}")
    code, out = _capture("submit", str(path), "--state-dir", str(workdir))
    if code:
        raise SystemExit(f"demo: `silod submit {path}` failed with exit code {code}")
    print(f"    $ silod submit {path}  ->  {out.strip()}", flush=True)
    return out.strip()


def _watch_all(scheduler: str, job_ids: list[str], submit_burst) -> list:  # type: ignore[no-untyped-def, type-arg]
    """Progress of every job until all are terminal (a rich display on a TTY, plain lines
    otherwise); ``submit_burst()`` runs once, BURST_AFTER_S into the watch, and returns more ids."""
    import grpc

    from silod.v1 import common_pb2, metadata_pb2, scheduler_pb2_grpc

    terminal = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)
    started = time.monotonic()
    burst_sent = False
    with grpc.insecure_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.JobServiceStub(channel)

        def poll() -> list:  # type: ignore[type-arg]
            nonlocal burst_sent
            if not burst_sent and time.monotonic() - started >= BURST_AFTER_S:
                burst_sent = True
                job_ids.extend(submit_burst())
            return [stub.GetJob(metadata_pb2.GetJobRequest(job_id=j), timeout=10) for j in job_ids]

        def line(job) -> str:  # type: ignore[no-untyped-def]
            state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
            hits = f" hits={100 * job.progress.cache_hit_ratio:3.0f}%" if job.spec.dataset else ""
            return f"{job.spec.name:<16} {state:<9} gpus={job.allocated.gpus}{hits}"

        def done(jobs) -> bool:  # type: ignore[no-untyped-def]
            return burst_sent and all(j.state in terminal for j in jobs)

        deadline = started + 240
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn

            with Progress(TextColumn("{task.description:<44}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%")) as bar:
                tasks: dict[str, Any] = {}
                while True:
                    jobs = poll()
                    for job in jobs:
                        if job.id not in tasks:
                            tasks[job.id] = bar.add_task(job.id, total=1.0)
                        bar.update(tasks[job.id], completed=job.progress.fraction_done, description=line(job))
                    if done(jobs) or time.monotonic() > deadline:
                        return jobs
                    time.sleep(0.5)
        shown: dict[str, tuple[int, int]] = {}
        while True:
            jobs = poll()
            for job in jobs:
                key = (job.state, int(4 * job.progress.fraction_done))
                if shown.get(job.id) != key:
                    shown[job.id] = key
                    print(f"    {line(job)} {100 * job.progress.fraction_done:5.1f}%", flush=True)
            if done(jobs) or time.monotonic() > deadline:
                return jobs
            time.sleep(0.5)


def gpu_timeline(plans: list, inference_nodes: set[str]) -> list[tuple[float, int, int, int]]:  # type: ignore[type-arg]
    """(time, GPUs training on training nodes, GPUs lent to training, GPUs running inference) per plan, oldest first."""
    from silod.v1 import plan_pb2

    rows = []
    for plan in sorted(plans, key=lambda p: p.version):
        inference_tasks = {r.task_id for r in plan.replicas if r.state == plan_pb2.REPLICA_STATE_RUNNING}
        own = lent = infer = 0
        for job in plan.jobs:
            for placement in job.placements:
                n = len(placement.gpu_indices)
                if job.job_id in inference_tasks:
                    infer += n
                elif placement.node in inference_nodes:
                    lent += n
                else:
                    own += n
        rows.append((plan.created_at.ToDatetime().timestamp(), own, lent, infer))
    return rows


def lent_gpu_seconds(timeline: list[tuple[float, int, int, int]], end: float) -> float:
    """GPU-seconds of inference GPUs lent to training: each plan's loans last until the next plan."""
    total = 0.0
    for (t, _, lent, _), following in zip(timeline, [*timeline[1:], (end, 0, 0, 0)]):
        total += lent * max(0.0, following[0] - t)
    return total


def _chart(timeline: list[tuple[float, int, int, int]], end: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = timeline[0][0]
    xs = [t - t0 for t, *_ in timeline] + [end - t0]
    series = [[row[k] for row in timeline] + [timeline[-1][k]] for k in (1, 2, 3)]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.stackplot(xs, *series, step="post", labels=["training (training nodes)", "lent to training", "inference"],
                 colors=["#2f6fd6", "#e08a1e", "#7a4fcf"])
    ax.axhline(GPUS_PER_NODE * (NODES + INFERENCE_NODES), color="#999", lw=0.8, ls="--")
    ax.set_xlabel("seconds since the first plan")
    ax.set_ylabel("GPUs")
    ax.set_title("silod demo: GPU use by plan (deepboot lends idle inference GPUs)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary(jobs: list, plans: list, workdir: Path) -> None:  # type: ignore[type-arg]
    from silod.v1 import common_pb2

    print(f"    {'NAME':<16} {'KIND':<9} {'STATE':<10} {'GPUS':>5} {'JCT':>7} {'HITS':>5}")
    for job in jobs:
        state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
        kind = "inference" if job.spec.kind == common_pb2.JOB_KIND_INFERENCE else "training"
        jct = (job.finished_at.ToDatetime() - job.created_at.ToDatetime()).total_seconds() if job.finished_at.seconds else 0
        gpus = f"{job.spec.min_gpus}-{job.spec.max_gpus}" if job.spec.min_gpus != job.spec.max_gpus else str(job.spec.min_gpus)
        hits = f"{100 * job.progress.cache_hit_ratio:4.0f}%" if job.spec.dataset else "    -"
        print(f"    {job.spec.name:<16} {kind:<9} {state:<10} {gpus:>5} {jct:>6.1f}s {hits}")
    training = [j for j in jobs if j.spec.kind != common_pb2.JOB_KIND_INFERENCE and j.finished_at.seconds]
    if training:
        mean = sum((j.finished_at.ToDatetime() - j.created_at.ToDatetime()).total_seconds() for j in training) / len(training)
        print(f"    average training JCT: {mean:.1f} s")
    inference_nodes = {f"infer-{i}" for i in range(INFERENCE_NODES)}
    timeline = gpu_timeline(plans, inference_nodes)
    if timeline:
        end = time.time()
        most = max(row[2] for row in timeline)
        print(f"    GPUs lent to training: up to {most} at once, {lent_gpu_seconds(timeline, end):.0f} GPU-seconds in all")
        chart = workdir / "demo-gpus.png"
        _chart(timeline, end, chart)
        print(f"    chart: {chart}")


def _plans(metadata: str) -> list:  # type: ignore[type-arg]
    import grpc

    from silod.v1 import metadata_pb2, metadata_pb2_grpc

    plans = []
    with grpc.insecure_channel(metadata) as channel:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        token = ""
        while True:
            page = stub.ListPlans(metadata_pb2.ListPlansRequest(page_size=100, page_token=token), timeout=10)
            plans.extend(page.plans)
            token = page.next_page_token
            if not token:
                return plans


def _stop(proc: subprocess.Popen[bytes], what: str) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    print(f"    {what} exited with code {code}")
    return code


def run_demo(workdir: Path) -> int:
    started = time.monotonic()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    store = workdir / "store"
    steps = 6
    print(f"silod demo — {NODES} training + {INFERENCE_NODES} inference emulated nodes x {GPUS_PER_NODE} GPUs, "
          f"datasets in a {STORE_MB_S:g} MB/s store")

    _step(1, steps, f"generating two datasets in {store} and serving them as S3 over a {STORE_MB_S:g} MB/s link")
    for name, files, size in make_datasets(store):
        print(f"    {name}: {files} files, {size / 1e6:.1f} MB")
    try:
        emulator, store_address = _start_store(store, workdir)
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1

    code = 1
    try:
        _step(2, steps, "starting the cluster (policy deepboot, cache co-allocation silod)")
        try:
            up, cluster = _start_cluster(workdir)
        except RuntimeError as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 1
        md = cluster["metadata"]
        try:
            if cluster.get("dashboard"):
                print(f"\n    dashboard: {cluster['dashboard']}  (open it in a browser while the demo runs)")

            _step(3, steps, "registering the datasets (manifests listed from the store)")
            for name, _, _ in DATASETS:
                _run("dataset", "register", name, f"s3://demo/{name}", "--option", f"endpoint_url=http://{store_address}",
                     "--option", "anon=true", "--metadata", md, "--description", f"demo: generated {name}")
            _run("dataset", "list", "--metadata", md)

            _step(4, steps, f"submitting {len(TRAINING_JOBS)} elastic training jobs; "
                  f"{len(INFERENCE_BURST)} inference tasks follow after {BURST_AFTER_S:g} s")
            job_ids = []
            for name, dataset, lo, hi, samples, step_s in TRAINING_JOBS:
                body = (f"application: cifar10\nmin_gpus: {lo}\nmax_gpus: {hi}\nbatch_size: {BATCH_SIZE}\n"
                        f"max_batch_size: {MAX_BATCH_SIZE}\n"
                        f"sample_budget: {samples}\nemulated_step_compute_s: {step_s}\n")
                if dataset:
                    body += f"dataset: {dataset}\n"
                job_ids.append(_submit(workdir, name, body))

            def burst() -> list[str]:
                print("    an inference burst arrives:", flush=True)
                return [_submit(workdir, f"infer-{k}", f"kind: inference\napplication: {app}\nmin_gpus: 1\nmax_gpus: 1\n"
                                f"inference_duration_s: {duration}\n")
                        for k, (app, duration) in enumerate(INFERENCE_BURST)]

            _step(5, steps, "watching (the scheduler lends idle inference GPUs, then takes them back for the burst)")
            jobs = _watch_all(cluster["scheduler"], job_ids, burst)
            print()
            _summary(jobs, _plans(md), workdir)
            if cluster.get("dashboard"):
                print(f"    dashboard (until shutdown): {cluster['dashboard']}")
        finally:
            _step(6, steps, "stopping the cluster and the store (SIGTERM)")
            code = _stop(up, "silod up")
    finally:
        store_code = _stop(emulator, "store emulator")
    print(f"\ndemo finished in {time.monotonic() - started:.1f} s; state kept in {workdir}")
    return 0 if code == 0 and store_code == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m silod.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.environ.get("SILOD_DEMO_DIR", ".silod/demo"),
                        help="where the demo keeps its database, store and logs (wiped first)")
    return run_demo(Path(parser.parse_args(argv).workdir))


if __name__ == "__main__":
    sys.exit(main())
