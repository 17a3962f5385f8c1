"""A `silod up` cluster driven from a benchmark: start it, register datasets, submit jobs, wait for
them, and read back what happened (job times, every rank's step lines, the plans over time).

Used by ``benchmarks/profile_ddp_digits.py`` (profiling the real DDP example) and
``benchmarks/ddp_fidelity.py`` (the same workload live and in the simulator). Not a test
harness: it starts real processes and leaves their logs under its work directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from silod.v1 import (cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2, metadata_pb2_grpc, scheduler_pb2,
                      scheduler_pb2_grpc)

TERMINAL = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)


@dataclass
class PlanEntry:
    """One committed plan as the benchmarks read it: when, and per job its GPUs per node and IO rate."""

    version: int
    at: float  # seconds since the epoch
    reason: str
    gpus: dict[str, dict[str, int]] = field(default_factory=dict)  # job id -> node -> GPUs
    io: dict[str, float] = field(default_factory=dict)  # job id -> bytes/s granted (sum over nodes)
    cache: dict[str, float] = field(default_factory=dict)  # job id -> cache quota bytes (sum over nodes)


class LiveCluster:
    """``silod up`` in ``work`` with the given flags, as a context manager (SIGINT on exit)."""

    def __init__(self, work: Path, *, nodes: int, gpus_per_node: int, policy: str, cache: str,
                 storage_bandwidth_bytes_per_s: float = 0.0, cache_disk_bytes: int = 10 << 30,
                 cache_memory_bytes: int = 0, interval_s: float = 2.0, restart_cost_s: float | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.work = work
        self.state = work / "state"
        self.argv = [sys.executable, "-m", "silod.cli", "up", "--state-dir", str(self.state), "--nodes", str(nodes),
                     "--gpus-per-node", str(gpus_per_node), "--policy", policy, "--cache", cache,
                     "--interval-s", str(interval_s), "--cache-disk-bytes", str(cache_disk_bytes),
                     "--cache-memory-bytes", str(cache_memory_bytes), "--no-dashboard", "--log-level", "warning",
                     "--storage-bandwidth-bytes-per-s", str(int(storage_bandwidth_bytes_per_s))]
        self.env = {**os.environ, **(env or {})}
        if restart_cost_s is not None:
            self.env["SILOD_RESTART_COST_S"] = str(restart_cost_s)
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, str] = {}
        # (time, node, the cache server's JobCacheStats of each job as a dict), sampled every
        # cache_sample_s while the cluster runs: what each job hit, missed and read from peers.
        self.cache_samples: list[tuple[float, str, dict[str, dict]]] = []
        self.cache_sample_s = 0.5
        self._stop_sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> "LiveCluster":
        self.work.mkdir(parents=True, exist_ok=True)
        self._log = open(self.work / "up.log", "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 180
        while not self.info:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"silod up did not start; see {self.work / 'up.log'}")
            try:
                self.info = json.loads((self.state / "cluster.json").read_text())
            except (OSError, ValueError):
                time.sleep(0.5)
        self.md = metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(self.info["metadata"]))
        self.jobs = scheduler_pb2_grpc.JobServiceStub(grpc.insecure_channel(self.info["scheduler"]))
        self._sampler = threading.Thread(target=self._sample_caches, name="cache-stats", daemon=True)
        self._sampler.start()
        return self

    def _sample_caches(self) -> None:
        from google.protobuf.json_format import MessageToDict

        stubs: dict[str, cache_pb2_grpc.CacheServiceStub] = {}
        while not self._stop_sampling.wait(self.cache_sample_s):
            try:
                if not stubs:
                    nodes = self.md.ListNodes(metadata_pb2.ListNodesRequest(), timeout=5).nodes
                    stubs = {n.spec.name: cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(n.spec.cache_address))
                             for n in nodes if n.spec.cache_address}
                for node, stub in stubs.items():
                    stats = stub.Stats(cache_pb2.StatsRequest(), timeout=2)
                    jobs = {j.job_id: MessageToDict(j, preserving_proto_field_name=True) for j in stats.jobs}
                    self.cache_samples.append((time.time(), node, jobs))
            except grpc.RpcError:
                continue  # a cache server starting or stopping: the next sample

    def cache_stats(self, job_id: str) -> dict[str, list[tuple[float, dict]]]:
        """Per node, the job's cache stats over time (``JobCacheStats`` fields, ints as strings)."""
        out: dict[str, list[tuple[float, dict]]] = {}
        for at, node, jobs in self.cache_samples:
            if job_id in jobs:
                out.setdefault(node, []).append((at, jobs[job_id]))
        return out

    def __exit__(self, *exc: object) -> None:
        self._stop_sampling.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def register(self, name: str, url: str, *options: str) -> None:
        argv = [sys.executable, "-m", "silod.cli", "dataset", "register", name, url, "--metadata", self.info["metadata"]]
        for option in options:
            argv += ["--option", option]
        subprocess.run(argv, check=True, capture_output=True, timeout=300)

    def submit(self, spec: common_pb2.JobSpec) -> str:
        return self.jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30, wait_for_ready=True).id

    def wait(self, ids: list[str], timeout_s: float) -> dict[str, common_pb2.Job]:
        """The jobs once all of them ended; RuntimeError on timeout (with their states)."""
        deadline = time.monotonic() + timeout_s
        while True:
            page = self.md.ListJobs(metadata_pb2.ListJobsRequest(page_size=1000), timeout=10)
            found = {j.id: j for j in page.jobs if j.id in ids}
            if len(found) == len(ids) and all(j.state in TERMINAL for j in found.values()):
                return found
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"silod up exited; see {self.work / 'up.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError("jobs not finished: " + str({k: common_pb2.JobState.Name(j.state) for k, j in found.items()}))
            time.sleep(1.0)

    def steps(self, job_id: str) -> list[dict]:
        """Every ``step {...}`` line the job's ranks logged (examples/train_ddp_digits.py), all nodes."""
        found = []
        for log in self.state.glob(f"**/jobs/{job_id}/rank-*.log"):
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("step {"):
                    found.append(json.loads(line[5:]))
        return found

    def plans(self) -> list[PlanEntry]:
        """Every committed plan, oldest first."""
        out: list[PlanEntry] = []
        token = ""
        while True:
            page = self.md.ListPlans(metadata_pb2.ListPlansRequest(page_size=100, page_token=token), timeout=30)
            for plan in page.plans:
                entry = PlanEntry(plan.version, plan.created_at.ToDatetime().timestamp(), plan.reason)
                for job in plan.jobs:
                    per_node: dict[str, int] = {}
                    for p in job.placements:
                        per_node[p.node] = per_node.get(p.node, 0) + len(p.gpu_indices)
                    if per_node:
                        entry.gpus[job.job_id] = per_node
                    entry.io[job.job_id] = float(sum(g.remote_io_bytes_per_s for g in job.cache_grants))
                    entry.cache[job.job_id] = float(sum(g.cache_quota_bytes for g in job.cache_grants))
                out.append(entry)
            token = page.next_page_token
            if not token:
                return sorted(out, key=lambda e: e.version)
