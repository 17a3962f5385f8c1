"""The demo's mixed workload on a running lab (``silod lab workload``).

The workload is silod/demo.py's: its two generated datasets, its elastic training jobs and its
burst of inference tasks. Here it goes to the lab's compose topology instead of ``silod up``:
the datasets are uploaded to the storage host and registered under its compose host name
(``objectstore:5000``) from inside a worker host's namespace, so every node's cache server
fills from there; the jobs go to the scheduler's host. Training ranks land on the training
worker hosts (and, under compose's deepboot policy, on the inference host's idle GPUs), the
inference tasks on the inference host. Progress names the hosts each job's ranks run on,
taken from the plans and the nodes' advertised agent addresses.

``short_workload()`` is a cut-down version (two training jobs, three inference tasks, a
quarter of the samples, files and GPU seconds) for tests/lab and a quick look.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from silod import demo
from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2, scheduler_pb2, scheduler_pb2_grpc

BUCKET = "demo"
TERMINAL = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)
ACTIVE = (common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_RESIZING)


class WorkloadError(RuntimeError):
    pass


@dataclass(frozen=True)
class Workload:
    datasets: tuple[tuple[str, int, int], ...]               # demo.DATASETS rows: (name, files, bytes per file)
    training: tuple[tuple[str, str, int, int, int, float], ...]   # demo.TRAINING_JOBS rows
    inference: tuple[tuple[str, float], ...]                  # demo.INFERENCE_BURST rows
    burst_after_s: float                                      # after the first training job runs
    timeout_s: float = 600.0


def demo_workload() -> Workload:
    return Workload(demo.DATASETS, demo.TRAINING_JOBS, demo.INFERENCE_BURST, demo.BURST_AFTER_S)


def short_workload(fraction: float = 0.25) -> Workload:
    """The demo's first training job of each dataset and its first three inference tasks, with
    ``fraction`` of their samples, GPU seconds and dataset files."""
    full = demo_workload()
    training, seen = [], set()
    for row in full.training:
        if row[1] and row[1] not in seen:
            seen.add(row[1])
            name, dataset, lo, hi, samples, step_s = row
            training.append((name, dataset, lo, hi, max(demo.BATCH_SIZE, int(samples * fraction)), step_s))
    return replace(full, datasets=tuple((n, max(4, int(files * fraction)), size) for n, files, size in full.datasets),
                   training=tuple(training),
                   inference=tuple((app, round(seconds * fraction, 2)) for app, seconds in full.inference[:3]),
                   burst_after_s=full.burst_after_s * fraction, timeout_s=240.0)


@dataclass(frozen=True)
class LabInfo:
    """What the workload needs of a running lab: ``lab.json`` in its state dir."""
    state_dir: Path
    prefix: str
    hosts: dict[str, str]            # compose service -> its host's address
    ports: dict[str, list[int]]      # compose service -> ports it listens on
    s3_env: dict[str, str]           # the object store credentials compose gives the cache servers

    @classmethod
    def load(cls, state_dir: str | Path) -> "LabInfo":
        path = Path(state_dir).resolve() / "lab.json"
        try:
            raw = json.loads(path.read_text())
            return cls(path.parent, raw["prefix"], raw["hosts"], raw["ports"], raw.get("s3_env", {}))
        except (OSError, ValueError, KeyError) as exc:
            raise WorkloadError(f"no running lab described in {path} ({exc}): start one with `silod lab up`") from exc

    def address(self, service: str, port: int | None = None) -> str:
        if service not in self.hosts:
            raise WorkloadError(f"the lab has no {service!r} host")
        return f"{self.hosts[service]}:{port if port is not None else self.ports[service][0]}"

    def run_on(self, host: str, argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``argv`` inside ``host``'s namespace, where the compose host names resolve."""
        return subprocess.run(["ip", "netns", "exec", f"{self.prefix}-{host}", *argv], capture_output=True, text=True,
                              timeout=timeout, env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                                                    "HOME": str(self.state_dir), **env})


@dataclass(frozen=True)
class WorkerHost:
    host: str        # the agent's compose host name (its advertised address)
    node: str
    pool: str        # "training" or "inference"
    gpus: int


@dataclass
class WorkloadResult:
    jobs: list[common_pb2.Job]
    hosts: dict[str, list[str]]               # job id -> worker hosts its ranks were placed on
    workers: dict[str, WorkerHost]            # node name -> its host
    dashboard_nodes: list[dict] = field(default_factory=list)  # the dashboard's node rows at the end
    lent_gpu_s: float = 0.0

    @property
    def succeeded(self) -> bool:
        return bool(self.jobs) and all(j.state == common_pb2.JOB_STATE_SUCCEEDED for j in self.jobs)


def _worker_hosts(meta: metadata_pb2_grpc.MetadataServiceStub) -> dict[str, WorkerHost]:
    out = {}
    for n in meta.ListNodes(metadata_pb2.ListNodesRequest(alive_only=True), timeout=10).nodes:
        pool = "inference" if n.spec.pool == common_pb2.NODE_POOL_INFERENCE else "training"
        out[n.spec.name] = WorkerHost(n.spec.agent_address.rpartition(":")[0] or n.spec.name, n.spec.name, pool,
                                      n.spec.gpus)
    return out


def _plans_since(meta: metadata_pb2_grpc.MetadataServiceStub, since: float) -> list[plan_pb2.AllocationPlan]:
    plans, token = [], ""
    while True:
        page = meta.ListPlans(metadata_pb2.ListPlansRequest(page_size=100, page_token=token), timeout=10)
        fresh = [p for p in page.plans if p.created_at.ToDatetime().timestamp() >= since]
        plans.extend(fresh)
        token = page.next_page_token
        if not token or len(fresh) < len(page.plans):   # newest first: the rest are older
            return plans


def _placed(plan: plan_pb2.AllocationPlan | None) -> dict[str, dict[str, int]]:
    """job id -> node -> GPUs, in ``plan``."""
    if plan is None:
        return {}
    return {a.job_id: {p.node: len(p.gpu_indices) for p in a.placements} for a in plan.jobs if a.placements}


def upload_datasets(lab: LabInfo, workload: Workload, out: Callable[[str], None]) -> None:
    """The demo's datasets (only the first files of each, as many as ``workload`` names) into
    the storage host's bucket, registered with its compose host name as the endpoint."""
    import s3fs

    # No region: s3fs would send it as a LocationConstraint, which us-east-1 must not have.
    fs = s3fs.S3FileSystem(key=lab.s3_env.get("AWS_ACCESS_KEY_ID", "silod"),
                           secret=lab.s3_env.get("AWS_SECRET_ACCESS_KEY", "silod-secret"),
                           client_kwargs={"endpoint_url": f"http://{lab.address('objectstore')}"})
    try:
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        _upload(lab, fs, workload, out)
    except OSError as exc:
        raise WorkloadError(f"uploading the datasets to objectstore ({lab.address('objectstore')}) failed: {exc}") from exc


def _upload(lab: LabInfo, fs, workload: Workload, out: Callable[[str], None]) -> None:  # type: ignore[no-untyped-def]
    files_of = {name: files for name, files, _ in workload.datasets}
    client = next(h for h in lab.hosts if h.startswith("agent-"))
    with tempfile.TemporaryDirectory(prefix="silod-lab-workload-") as tmp:
        demo.make_datasets(Path(tmp))
        for name, wanted in files_of.items():
            local = sorted((Path(tmp) / "demo" / name).iterdir())[:wanted]
            fs.put([str(p) for p in local], f"{BUCKET}/{name}/")
            size = sum(p.stat().st_size for p in local)
            out(f"    {name}: {len(local)} files, {size / 1e6:.1f} MB -> s3://{BUCKET}/{name} on objectstore "
                f"({lab.address('objectstore')})")
            argv = ["silod", "dataset", "register", name, f"s3://{BUCKET}/{name}", "--replace",
                    "--option", f"endpoint_url=http://objectstore:{lab.ports['objectstore'][0]}",
                    "--metadata", f"metadata:{lab.ports['metadata'][0]}", "--description", f"lab workload: {name}"]
            out(f"    $ ip netns exec {lab.prefix}-{client} {' '.join(argv)}")
            done = lab.run_on(client, argv, lab.s3_env)
            if done.returncode != 0:
                raise WorkloadError(f"registering {name} on {client} failed: {done.stdout}{done.stderr}")


def _training_spec(row: tuple[str, str, int, int, int, float]) -> common_pb2.JobSpec:
    """A demo.TRAINING_JOBS row as the demo's job file describes it."""
    name, dataset, lo, hi, samples, step_s = row
    return common_pb2.JobSpec(name=name, application="cifar10", min_gpus=lo, max_gpus=hi, batch_size=demo.BATCH_SIZE,
                              max_batch_size=demo.MAX_BATCH_SIZE, sample_budget=samples,
                              emulated_step_compute_s=step_s, dataset=dataset)


def _inference_spec(k: int, row: tuple[str, float]) -> common_pb2.JobSpec:
    app, seconds = row
    return common_pb2.JobSpec(name=f"infer-{k}", kind=common_pb2.JOB_KIND_INFERENCE, application=app, min_gpus=1,
                              max_gpus=1, inference_duration_s=seconds)


def _where(nodes: dict[str, int], workers: dict[str, WorkerHost]) -> str:
    return ", ".join(f"{workers[n].host if n in workers else n} x{g}" for n, g in sorted(nodes.items())) or "-"


def run_workload(lab: LabInfo, workload: Workload, out: Callable[[str], None] = print) -> WorkloadResult:
    """Upload, register, submit and watch ``workload`` on ``lab`` until every job has ended."""
    started_wall = time.time()
    run = f"{int(started_wall)}"
    with grpc.insecure_channel(lab.address("metadata")) as md_channel, \
            grpc.insecure_channel(lab.address("scheduler")) as sch_channel:
        meta = metadata_pb2_grpc.MetadataServiceStub(md_channel)
        jobs_api = scheduler_pb2_grpc.JobServiceStub(sch_channel)
        workers = _worker_hosts(meta)
        out(f"silod lab workload: silod/demo.py's mixed workload ({len(workload.training)} training jobs, "
            f"{len(workload.inference)} inference tasks) on {len(workers)} worker hosts")
        for w in sorted(workers.values(), key=lambda w: (w.pool, w.host)):
            out(f"    {w.host:<16} node {w.node:<10} {w.pool:<9} {w.gpus} GPUs  {lab.hosts.get(w.host, '?')}")
        if not any(w.pool == "inference" for w in workers.values()):
            out("    (no inference host: the inference tasks will wait)")
        if "dashboard" in lab.hosts:
            out(f"    dashboard: http://{lab.address('dashboard')}/")

        out("\n[1/4] datasets to the storage host")
        upload_datasets(lab, workload, out)

        def submit(spec: common_pb2.JobSpec) -> str:
            job = jobs_api.SubmitJob(scheduler_pb2.SubmitJobRequest(
                spec=spec, client_request_id=f"lab-workload-{run}-{spec.name}"), timeout=30)
            out(f"    submitted {spec.name:<16} -> {job.id}")
            return job.id

        out(f"\n[2/4] {len(workload.training)} elastic training jobs; {len(workload.inference)} inference tasks "
            f"follow {workload.burst_after_s:g} s after the first one runs")
        ids = [submit(_training_spec(row)) for row in workload.training]

        out("\n[3/4] watching (job, state, hosts x GPUs, done)")
        jobs = _watch(meta, jobs_api, ids, lambda: [submit(_inference_spec(k, row)) for k, row in
                                                     enumerate(workload.inference)], workload, workers, out)
        plans = _plans_since(meta, started_wall)
        hosts: dict[str, set[str]] = {j.id: set() for j in jobs}
        for plan in plans:
            for job_id, nodes in _placed(plan).items():
                if job_id in hosts:
                    hosts[job_id] |= {workers[n].host if n in workers else n for n in nodes}
        inference_nodes = {w.node for w in workers.values() if w.pool == "inference"}
        timeline = demo.gpu_timeline(plans, inference_nodes)
        result = WorkloadResult(jobs, {j: sorted(h) for j, h in hosts.items()}, workers,
                                lent_gpu_s=demo.lent_gpu_seconds(timeline, time.time()) if timeline else 0.0)
    result.dashboard_nodes = _dashboard_nodes(lab)
    _summary(result, timeline, out)
    return result


def _watch(meta: metadata_pb2_grpc.MetadataServiceStub, jobs_api: scheduler_pb2_grpc.JobServiceStub, ids: list[str],
           submit_burst: Callable[[], list[str]], workload: Workload, workers: dict[str, WorkerHost],
           out: Callable[[str], None]) -> list[common_pb2.Job]:
    """Poll the jobs until all have ended (or the workload's timeout), printing a line whenever a
    job's state, hosts or quarter of progress changes; ``submit_burst()`` runs once,
    ``burst_after_s`` after the first training job was seen running, and adds its job ids."""
    t0 = time.monotonic()
    first_running: float | None = None
    burst_sent = False
    shown: dict[str, tuple[str, str, int]] = {}
    while True:
        now = time.monotonic()
        jobs = [jobs_api.GetJob(metadata_pb2.GetJobRequest(job_id=j), timeout=10) for j in ids]
        # A job seen only after it ended ran too (a short one can start and end between polls).
        if first_running is None and any(j.state in ACTIVE + TERMINAL for j in jobs):
            first_running = now
        if not burst_sent and first_running is not None and now - first_running >= workload.burst_after_s:
            burst_sent = True
            out(f"    {now - t0:6.1f}s an inference burst arrives")
            ids = ids + submit_burst()
            continue
        try:
            placed = _placed(meta.GetLatestPlan(metadata_pb2.GetLatestPlanRequest(), timeout=10))
        except grpc.RpcError:   # NOT_FOUND before the first plan
            placed = {}
        for job in jobs:
            where = _where(placed.get(job.id, {}), workers) if job.state in ACTIVE else "-"
            state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
            key = (state, where, int(4 * job.progress.fraction_done))
            if shown.get(job.id) != key:
                shown[job.id] = key
                out(f"    {now - t0:6.1f}s {job.spec.name:<16} {state:<9} {where:<32} "
                    f"{100 * job.progress.fraction_done:5.1f}%")
        if burst_sent and all(j.state in TERMINAL for j in jobs):
            return jobs
        if now - t0 > workload.timeout_s:
            out(f"    gave up after {workload.timeout_s:g} s: "
                f"{', '.join(j.spec.name for j in jobs if j.state not in TERMINAL)} still not done")
            return jobs
        time.sleep(1.0)


def _dashboard_nodes(lab: LabInfo) -> list[dict]:
    import urllib.request

    if "dashboard" not in lab.hosts:
        return []
    with urllib.request.urlopen(f"http://{lab.address('dashboard')}/api/overview", timeout=20) as reply:
        return json.loads(reply.read())["nodes"]


def _summary(result: WorkloadResult, timeline: list, out: Callable[[str], None]) -> None:
    out("\n[4/4] summary")
    out(f"    {'NAME':<16} {'KIND':<9} {'STATE':<10} {'JCT':>7} {'HITS':>5}  RAN ON")
    for job in result.jobs:
        kind = "inference" if job.spec.kind == common_pb2.JOB_KIND_INFERENCE else "training"
        state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
        jct = (job.finished_at.ToDatetime() - job.created_at.ToDatetime()).total_seconds() if job.finished_at.seconds else 0
        hits = f"{100 * job.progress.cache_hit_ratio:4.0f}%" if job.spec.dataset else "    -"
        out(f"    {job.spec.name:<16} {kind:<9} {state:<10} {jct:>6.1f}s {hits}  {' '.join(result.hosts.get(job.id, []))}")
    training = [j for j in result.jobs if j.spec.kind != common_pb2.JOB_KIND_INFERENCE and j.finished_at.seconds]
    if training:
        mean = sum((j.finished_at.ToDatetime() - j.created_at.ToDatetime()).total_seconds() for j in training) / len(training)
        out(f"    average training JCT: {mean:.1f} s")
    if timeline:
        out(f"    inference-host GPUs lent to training: up to {max(row[2] for row in timeline)} at once, "
            f"{result.lent_gpu_s:.0f} GPU-seconds in all")
    if result.dashboard_nodes:
        shown = ", ".join(f"{n['name']} ({n['pool']}, {'alive' if n['alive'] else 'down'})" for n in result.dashboard_nodes)
        out(f"    the dashboard lists {len(result.dashboard_nodes)} nodes: {shown}")
    out(f"    {'all jobs succeeded' if result.succeeded else 'NOT all jobs succeeded'}")
