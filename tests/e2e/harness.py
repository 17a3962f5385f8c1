"""A whole silod cluster as real processes on loopback: ``silod metadata``, ``silod scheduler``
and one ``silod worker-agent`` per node, with the checks the end-to-end tests share.

Only the processes' public surfaces are read: gRPC (JobService, MetadataService,
WorkerAgentService), the scheduler's Prometheus endpoint, and the files the agents and the job
SDK write by design (each agent's GPU table audit log ``gpu-table.jsonl``, task logs, the SDK's
``checkpoints.jsonl``).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from silod.v1 import worker_agent_pb2, worker_agent_pb2_grpc
from tests.support.contained import readable
from tests.support.procs import LaunchError, ServiceProcess, free_port, start_service
from worker_agent.gpus import check_exclusive

TERMINAL = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)
LAUNCH_MARK = re.compile(r"^--- silod: generation (\d+) rank (\d+) gpus \[([\d, ]*)\]$", re.M)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def held(history: list[dict[str, Any]]) -> dict[int, str]:
    """GPU -> task still holding it at the end of a GPU table history."""
    holder: dict[int, str] = {}
    for e in history:
        for i in e["gpus"]:
            if e["event"] == "acquire":
                holder[i] = e["task"]
            elif holder.get(i) == e["task"]:
                del holder[i]
    return holder


class Agent:
    def __init__(self, cluster: Cluster, name: str, pool: str = "training") -> None:
        self.name = name
        self.work_dir = cluster.root / f"agent-{name}"
        self.proc: ServiceProcess = start_service(
            "worker-agent",
            "--metadata-address", cluster.metadata.address,
            "--scheduler-address", cluster.scheduler_address,
            "--node-name", name,
            "--gpus", str(cluster.gpus_per_node),
            "--pool", pool,
            "--work-dir", str(self.work_dir),
            # Shared by every node, as shared storage would be: a job moved to another node resumes.
            "--checkpoint-root", str(cluster.checkpoints),
            "--heartbeat-s", "0.5",
            "--report-s", "0.5",
            "--checkpoint-deadline-s", "15",
            "--stop-grace-s", "5",
            "--log-level", "warning",
            *readable(*cluster.read_paths),
            workdir=cluster.root / f"agent-{name}-proc",
        )
        self.channel = grpc.insecure_channel(self.proc.address)
        self.stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(self.channel)

    def tasks(self) -> list[worker_agent_pb2.TaskStatus]:
        return list(self.stub.GetNodeStatus(worker_agent_pb2.GetNodeStatusRequest(), timeout=10).tasks)

    def gpu_history(self) -> list[dict[str, Any]]:
        path = self.work_dir / "gpu-table.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def launches(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """(job, rank, generation, gpus) of every process this agent launched, from its task logs."""
        found = []
        for log in sorted((self.work_dir / "jobs").glob("*/rank-*.log")):
            for m in LAUNCH_MARK.finditer(log.read_text(errors="replace")):
                gpus = tuple(sorted(int(g) for g in m.group(3).replace(" ", "").split(",") if g))
                found.append((log.parent.name, int(m.group(2)), int(m.group(1)), gpus))
        return found

    def log(self, job_id: str, rank: int) -> str:
        path = self.work_dir / "jobs" / job_id / f"rank-{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        self.channel.close()
        self.proc.close()


class Cluster:
    def __init__(self, root: Path, db_url: str, *, nodes: int = 3, gpus_per_node: int = 4, policy: str = "fifo",
                 interval_s: float = 1.0, restart_cost_s: float = 1.0, node_timeout_s: float = 4.0,
                 inference_nodes: int = 0, scheduler_args: tuple[str, ...] = (),
                 read_paths: tuple[Path, ...] = ()) -> None:
        self.root = root
        self.read_paths = read_paths  # what contained ranks read besides the suite's default (a test's store)
        self.checkpoints = root / "checkpoints"
        self.gpus_per_node = gpus_per_node
        self._scheduler_args = (
            "--policy", policy, "--interval-s", str(interval_s), "--restart-cost-s", str(restart_cost_s),
            "--node-timeout-s", str(node_timeout_s), "--log-level", "warning", *scheduler_args,
        )
        self.agents: dict[str, Agent] = {}
        self.killed: dict[str, Agent] = {}
        self.scheduler: ServiceProcess | None = None
        self._channels: list[grpc.Channel] = []
        self.metadata = start_service("metadata", "--db", db_url, "--log-level", "warning",
                                      workdir=root / "metadata")
        try:
            # Pinned ports: agents and clients find a restarted scheduler where the old one was.
            # A free port can be taken before the scheduler binds it (by a service of another
            # test worker): the first start then tries other ones.
            for attempt in range(3):
                self.scheduler_address = f"127.0.0.1:{free_port()}"
                self.metrics_port = free_port()
                try:
                    self.start_scheduler()
                    break
                except LaunchError as exc:
                    if "Address already in use" not in str(exc) or attempt == 2:
                        raise
            md = grpc.insecure_channel(self.metadata.address)
            jobs = grpc.insecure_channel(self.scheduler_address)
            self._channels += [md, jobs]
            self.md = metadata_pb2_grpc.MetadataServiceStub(md)
            self.jobs = scheduler_pb2_grpc.JobServiceStub(jobs)
            self._start_agents([(f"n{i}", "training") for i in range(nodes)]
                               + [(f"i{i}", "inference") for i in range(inference_nodes)])
            wait_until(lambda: len(self.md.ListNodes(metadata_pb2.ListNodesRequest(alive_only=True), timeout=10).nodes)
                       == nodes + inference_nodes, timeout=60, what="every agent registered")
        except BaseException:
            self.close()
            raise

    # ---- processes ---------------------------------------------------------------------------
    def start_scheduler(self) -> None:
        self.scheduler = start_service(
            "scheduler", "--listen", self.scheduler_address, "--metadata-address", self.metadata.address,
            "--metrics-port", str(self.metrics_port), *self._scheduler_args, workdir=self.root / "scheduler", timeout_s=60,
        )

    def _start_agents(self, nodes: list[tuple[str, str]]) -> None:
        """Start the agents at once: each start is mostly Python's imports, and one after the other
        they cost seconds each on a two-core machine. (The scheduler is up before: an agent whose
        plan watch finds no scheduler backs off for up to 5 s.) Whatever started is kept for
        close(), also when another start failed."""
        with ThreadPoolExecutor(max_workers=len(nodes) or 1) as pool:
            futures = {name: pool.submit(Agent, self, name, pool_name) for name, pool_name in nodes}
        failed: BaseException | None = None
        for name, future in futures.items():
            if future.exception() is None:
                self.agents[name] = future.result()
            else:
                failed = failed or future.exception()
        if failed is not None:
            raise failed

    def kill_agent(self, name: str) -> float:
        """SIGKILL node ``name``'s agent (as a machine crash would); returns the wall time of the kill."""
        agent = self.agents.pop(name)
        self.killed[name] = agent
        at = time.time()
        agent.proc.kill()
        return at

    def close(self) -> None:
        for agent in [*self.agents.values(), *self.killed.values()]:
            agent.close()
        if self.scheduler is not None:
            self.scheduler.close()
        for channel in self._channels:
            channel.close()
        self.metadata.close()

    # ---- jobs --------------------------------------------------------------------------------
    def submit(self, name: str, min_gpus: int, max_gpus: int, *, samples: int, step_s: float = 0.02,
               batch_size: int = 32, max_batch_size: int = 0, env: dict[str, str] | None = None) -> str:
        spec = common_pb2.JobSpec(name=name, application="cifar10", min_gpus=min_gpus, max_gpus=max_gpus,
                                  batch_size=batch_size, max_batch_size=max_batch_size, sample_budget=samples,
                                  emulated_step_compute_s=step_s, env=env or {})
        request = scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id=f"e2e-{name}")
        # wait_for_ready: right after a scheduler restart the channel may still be reconnecting.
        return self.jobs.SubmitJob(request, timeout=30, wait_for_ready=True).id

    def job(self, job_id: str) -> common_pb2.Job:
        return self.md.GetJob(metadata_pb2.GetJobRequest(job_id=job_id), timeout=10)

    def all_jobs(self) -> list[common_pb2.Job]:
        return list(self.md.ListJobs(metadata_pb2.ListJobsRequest(page_size=1000), timeout=10).jobs)

    def wait_terminal(self, ids: list[str], timeout: float) -> dict[str, common_pb2.Job]:
        def done() -> dict[str, common_pb2.Job] | None:
            jobs = {j.id: j for j in self.all_jobs() if j.id in ids}
            return jobs if len(jobs) == len(ids) and all(j.state in TERMINAL for j in jobs.values()) else None

        try:
            return wait_until(done, timeout, "every job to finish", interval=0.2)
        except AssertionError:
            jobs = self.all_jobs()
            states = {j.spec.name: (common_pb2.JobState.Name(j.state), j.message, j.progress.samples_done)
                      for j in jobs}
            raise AssertionError(f"jobs not finished after {timeout:g}s: {states}\n"
                                 + self._agents_view([j for j in jobs if j.id in ids and j.state not in TERMINAL])
                                 ) from None

    def _agents_view(self, jobs: list[common_pb2.Job]) -> str:
        """What the agents hold and logged of ``jobs``: a stall is the scheduler's or the ranks'."""
        lines = []
        for job in jobs:
            for name, agent in self.agents.items():
                try:
                    tasks = [t for t in agent.tasks() if t.job_id == job.id]
                except grpc.RpcError as exc:
                    lines.append(f"{job.spec.name} on {name}: agent unreachable ({exc.code().name})")
                    continue
                for t in tasks:
                    lines.append(f"{job.spec.name} on {name}: rank {t.rank} generation {t.generation} {t.state}"
                                 f" exit {t.exit_code} pid {t.pid}")
                log = agent.log(job.id, 0).splitlines()
                if log:
                    lines.append(f"{job.spec.name} rank-0 log on {name}, last lines: {log[-3:]}")
        if self.scheduler is not None:
            lines.append(f"scheduler log, last lines: {self.scheduler.log().splitlines()[-5:]}")
        return "\n".join(lines)

    def resumes(self, job_id: str) -> list[tuple[int, int, float]]:
        """(generation, samples resumed at, launch time) of every rank-0 process of the job, by launch
        time, from the agents' GPU tables (when) and the job's rank-0 logs (where it resumed)."""
        found = []
        for agent in [*self.agents.values(), *self.killed.values()]:
            launched = {e["task"]: e["t"] for e in agent.gpu_history() if e["event"] == "acquire"}
            segments = LAUNCH_MARK.split(agent.log(job_id, 0))[1:]  # (generation, rank, gpus, text) per launch
            for i in range(0, len(segments), 4):
                generation, text = int(segments[i]), segments[i + 3]
                m = re.search(r"emulated: resumed at samples=(\d+)", text)
                if m:
                    found.append((generation, int(m.group(1)), launched[f"{job_id}/0/{generation}"]))
        return sorted(found, key=lambda r: r[2])

    def checkpoint_history(self, job_id: str) -> list[dict[str, Any]]:
        path = self.checkpoints / job_id / "checkpoints.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []

    # ---- checks ------------------------------------------------------------------------------
    def double_held_total(self) -> float:
        """The scheduler's silod_scheduler_gpu_double_held_total (since its last start)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        m = re.search(r"^silod_scheduler_gpu_double_held_total ([0-9.e+]+)$", text, re.M)
        assert m, "the scheduler exports silod_scheduler_gpu_double_held_total"
        return float(m.group(1))

    def assert_gpus_never_double_held(self) -> None:
        """From each agent's own GPU table log: no GPU ever held by two tasks, every launched
        process went through the table, and nothing is held once every job has finished."""
        for agent in self.agents.values():
            wait_until(lambda: not held(agent.gpu_history()), timeout=30, what=f"{agent.name}: every GPU released")
            history = agent.gpu_history()
            check_exclusive(history)
            acquired = sorted((e["task"], tuple(e["gpus"])) for e in history if e["event"] == "acquire")
            launched = sorted((f"{job}/{rank}/{generation}", gpus) for job, rank, generation, gpus in agent.launches())
            assert acquired == launched, f"{agent.name}: GPU table acquires differ from launched processes"
