"""Per-node worker agent (``silod worker-agent``): launches, resizes and stops job processes.

It registers its node with the metadata service (UpsertNode, then Heartbeat every
``heartbeat_s``), watches its node's part of the allocation plan on the scheduler's
AllocationService, runs one subprocess per assigned rank, reports task phases with
ReportTasks, and serves WorkerAgentService to the SDK inside the jobs (silod.job). The
protocol is described in worker_agent/agent.py and the modules it names.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import grpc
from pydantic import Field, field_validator

from services.runtime import errors
from services.runtime.node_settings import PlanFollowerSettings
from services.runtime.server import ServiceDefinition
from services.runtime.settings import ConfigError, ServiceSettings, split_host_port
from silod.v1 import worker_agent_pb2, worker_agent_pb2_grpc
from worker_agent.agent import Agent


class Settings(PlanFollowerSettings):
    node_name: str = Field("", description="Node name registered with the metadata service; empty = hostname")
    pool: Literal["training", "inference"] = Field("training", description="Pool the node serves")
    gpus: int = Field(4, ge=0, le=1024, description="GPUs on the node when NVML (pynvml) is absent or finds none")
    gpu_type: str = Field(
        "", pattern=r"^([a-z0-9][a-z0-9._-]{0,31})?$",
        description="GPU type the node advertises to policies and job constraints (e.g. v100, a100, l4); "
        "empty = derived from the NVML model name (A100-SXM4-40GB -> a100), untyped for emulated GPUs",
    )
    cache_capacity_bytes: int = Field(0, ge=0, description="Bytes of the node's local-disk cache tier (advertised)")
    memory_cache_bytes: int = Field(0, ge=0, description="Bytes of the node's memory cache tier (advertised)")
    metadata_address: str = Field("", description="HOST:PORT of the metadata service (required)")
    scheduler_address: str = Field(
        "", description="HOST:PORT of the AllocationService: the allocation service (silod allocation, as the "
        "deployments run it), or the scheduler, or a comma-separated list of the schedulers that take turns leading "
        "(each is watched at once: a standby holds the watch until it leads); empty = register only, run no tasks"
    )
    cache_address: str = Field("", description="HOST:PORT of this node's cache server, given to tasks as SILOD_CACHE_ADDR")
    advertise_address: str = Field(
        "", description="HOST:PORT other processes reach this agent at; empty = the bound listen address"
    )
    work_dir: str = Field("silod-agent", description="Directory of task logs (jobs/<job>/rank-<r>.log) and checkpoints")
    checkpoint_root: str = Field(
        "", description="Directory of job checkpoints (<root>/<job_id>, given to tasks as SILOD_CHECKPOINT_DIR); "
        "empty = <work_dir>/checkpoints. Shared storage on every node lets a job moved to another node resume"
    )
    heartbeat_s: float = Field(
        5.0, gt=0, description="Seconds between heartbeats to the metadata service; at most a third of the "
        "scheduler's node_timeout_s, which the scheduler checks when the agent watches its plans: refused, the agent "
        "exits 2 naming both")
    report_s: float = Field(2.0, gt=0, description="Seconds between ReportTasks calls (also sent on every phase change)")
    checkpoint_deadline_s: float = Field(
        30.0, ge=0, description="Seconds a task asked to checkpoint and exit gets before SIGKILL"
    )
    stop_grace_s: float = Field(10.0, ge=0, description="Seconds tasks get to checkpoint when the agent shuts down")
    warm_processes: int = Field(
        0, ge=0, le=64, description="Python processes kept started with warm_preload imported, so that a new rank of "
        "a job that resizes in place skips interpreter start-up (each holds ~280 MB); 0 = start every rank cold",
    )
    nvml_module: str = Field(
        "", pattern=r"^([A-Za-z_][A-Za-z0-9_.]*(:[A-Za-z_][A-Za-z0-9_]*)?)?$",
        description="Test hook: MODULE:ATTRIBUTE naming an object with pynvml's functions, used in place of pynvml "
        "(tests feed GPU figures and faults through it); empty = pynvml when installed, else emulated GPUs",
    )
    warm_preload: str = Field(
        "torch,torch.distributed,torch.nn.parallel,torch._dynamo,silod.job,silod.data",
        description="Comma-separated modules a warm process imports ahead of its rank (absent ones are skipped); "
        "torch._dynamo is what creating the first optimizer imports (about 1 s)",
    )

    runtime: Literal["auto", "process", "contained", "container"] = Field(
        "auto", description="How ranks run: contained (a uid, namespaces and cgroup per job; needs root), process "
        "(as the agent's user, uncontained), container (a Docker container per rank, of the job's image; needs root "
        "and the Docker Engine, docs/containers.md), auto = contained when the agent runs as root, else process, "
        "never container (docs/operators.md, 'Job containment')",
    )
    allow_uncontained: bool = Field(
        False, description="Run ranks uncontained (the process runtime) even with auth on; without it such an agent "
        "refuses to start, since any rank could read the node's credential and signal other jobs",
    )
    job_uids: str = Field(
        "1000000-1065535", description="START-END: the Unix uids (and gids) the contained runtime gives jobs, one per "
        "job on the node; must not hold the agent's own or any account's uid",
    )
    contained_read_paths: str = Field(
        "", description="Comma-separated host paths contained ranks may read besides the system directories, "
        "the interpreter and silod (job code, local datasets, the cache server's directories)",
    )
    rank_env_passthrough: str = Field(
        "", description="Comma-separated names of the agent's environment variables contained ranks get (NAME* for "
        "every name that starts so) besides PATH, LANG, LC_ALL, LC_CTYPE, TZ; the process runtime passes the agent's "
        "whole environment but its own settings",
    )
    rank_pids_limit: int = Field(4096, ge=16, le=4_194_304,
                                 description="Processes and threads each contained rank may have")
    docker_host: str = Field(
        "unix:///var/run/docker.sock", pattern=r"^(unix:///\S+|tcp://[^/\s]+)$",
        description="runtime: container: the Docker Engine's API (unix:///PATH, or tcp://HOST:PORT without TLS)",
    )
    default_image: str = Field(
        "", description="runtime: container: the image of a job that names none; empty = such a job's ranks fail, "
        "naming the missing image",
    )
    registry_auth_file: str = Field(
        "", description="runtime: container: a JSON file of the operator's registry credentials, "
        "{\"HOST[:PORT]\": {\"username\": ..., \"password\": ...}}, sent when pulling from that registry",
    )
    container_read_paths: str = Field(
        "", description="runtime: container: comma-separated host paths each rank's container mounts read-only at "
        "the same path (local datasets); the cache server's directories are mounted anyway",
    )
    container_network: str = Field(
        "host", pattern=r"^(host|container:[A-Za-z0-9][A-Za-z0-9_.-]*)$",
        description="runtime: container: the network each rank's container joins: host (the host's), or "
        "container:NAME, the network namespace of the container NAME (an agent that runs in a container names "
        "its own: its ranks then reach what it reaches, by the same names, and the other nodes' ranks reach them "
        "at its address)",
    )
    image_pull_timeout_s: float = Field(
        600.0, gt=0, le=86_400, description="runtime: container: seconds a pull of a job's image may take before "
        "its ranks fail",
    )
    cpus: float = Field(0.0, ge=0.0, le=1e6, description="CPU cores ranks may request on the node; 0 = the machine's")
    memory_bytes: int = Field(0, ge=0, le=2**60, description="Bytes of memory ranks may request on the node; "
                              "0 = the machine's")

    @field_validator("job_uids")
    @classmethod
    def _job_uids(cls, value: str) -> str:
        from worker_agent.runtimes.job_users import UidRangeError, parse_range

        try:
            parse_range(value)
        except UidRangeError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("node_name")
    @classmethod
    def _node_name(cls, value: str) -> str:
        from silod.rpc.identifiers import NODE_NAME

        return cls._identifier(value, NODE_NAME)


def _check_report(request: worker_agent_pb2.ReportProgressRequest) -> None:
    """Every problem of a job's progress report at once (the metadata store's rules for progress)."""
    from services.metadata.validation.common import check_float, check_int
    from services.metadata.validation.jobs import check_progress

    problems = errors.Problems()
    check = problems.check
    check(check_int, request.rank, "rank", minimum=0, maximum=2**31 - 1)
    check(check_int, request.generation, "generation", minimum=0, maximum=2**63 - 1)
    check(check_progress, request.progress, "progress")
    check(check_float, request.step_time_s, "step_time_s", minimum=0.0, maximum=1e6)
    check(check_int, request.batch_size, "batch_size", minimum=0, maximum=2**31 - 1)
    check(check_float, request.cache_hit_ratio, "cache_hit_ratio", minimum=0.0, maximum=1.0)
    check(check_float, request.grad_sqr, "grad_sqr", minimum=0.0, maximum=1e100)
    check(check_float, request.grad_var, "grad_var", minimum=0.0, maximum=1e100)
    problems.raise_if_any()


class WorkerAgentServicer(worker_agent_pb2_grpc.WorkerAgentServiceServicer):
    def __init__(self, holder: dict[str, Agent]) -> None:
        self._holder = holder

    @property
    def agent(self) -> Agent:
        agent = self._holder.get("agent")
        if agent is None:
            raise errors.Unavailable("agent is starting")
        return agent

    async def GetNodeStatus(self, request, context):  # type: ignore[no-untyped-def]
        return self.agent.node_status()

    async def ReportProgress(self, request, context):  # type: ignore[no-untyped-def]
        _check_report(request)  # what is recorded goes on to the scheduler, the metadata store and the estimator
        self.agent.calls.record_progress(request)
        return worker_agent_pb2.ReportProgressResponse()

    async def GetDirective(self, request, context):  # type: ignore[no-untyped-def]
        return self.agent.calls.directive(request)

    async def TailLogs(self, request, context) -> AsyncIterator[worker_agent_pb2.LogChunk]:  # type: ignore[no-untyped-def,override]
        agent = self.agent
        if not request.job_id:
            raise errors.InvalidArgument("must not be empty", field="job_id")
        job_dir = agent.work_dir / "jobs" / request.job_id
        if request.rank >= 0:
            paths = {request.rank: job_dir / f"rank-{request.rank}.log"}
        else:
            paths = {int(p.stem.split("-", 1)[1]): p for p in sorted(job_dir.glob("rank-*.log"))}
        paths = {r: p for r, p in paths.items() if p.is_file()}
        if not paths:
            field = "job_id" if not job_dir.is_dir() else "rank"
            raise errors.NotFound(f"no log of job {request.job_id!r} rank {request.rank} on this node", field=field)
        offsets: dict[int, int] = {}
        for r, p in paths.items():
            size = p.stat().st_size
            offsets[r] = max(0, size - request.tail_bytes) if request.tail_bytes > 0 else 0
        while True:
            # By log file, not current rank: a survivor renumbered by a fast resize keeps writing
            # the log of the rank it was launched as.
            running = any(
                t.job_id == request.job_id and (request.rank < 0 or t.log_path.name == f"rank-{request.rank}.log")
                and not t.exited.is_set()
                for t in agent.tasks.values()
            )
            for r, p in paths.items():
                with open(p, "rb") as f:
                    f.seek(offsets[r])
                    while data := f.read(64 * 1024):
                        offsets[r] += len(data)
                        yield worker_agent_pb2.LogChunk(rank=r, data=data)
            if not request.follow or not running:
                return
            await asyncio.sleep(0.2)


def _reserve_port(listen: str) -> str:
    """Resolve port 0 to a concrete free port now: the agent must advertise its address to the
    metadata service and to its tasks, and start_server reveals the bound port only to its caller.
    (Another process could take the port in between; the bind would then fail loudly.)"""
    host, port = split_host_port(listen)
    if port != 0:
        return listen
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _advertised(settings: Settings) -> str:
    if settings.advertise_address:
        return settings.advertise_address
    host, port = split_host_port(settings.listen)
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def definition(settings: Settings) -> ServiceDefinition:
    settings.listen = _reserve_port(settings.listen)
    holder: dict[str, Agent] = {}

    def register(server: grpc.aio.Server) -> None:
        worker_agent_pb2_grpc.add_WorkerAgentServiceServicer_to_server(WorkerAgentServicer(holder), server)

    async def on_start() -> None:
        if not settings.metadata_address:  # raised here so `silod worker-agent` exits 2 with one line
            raise ConfigError("metadata_address: required (HOST:PORT of the metadata service)")
        Path(settings.work_dir).mkdir(parents=True, exist_ok=True)
        if settings.nvml_module:
            from worker_agent import nvml

            try:
                nvml.load(settings.nvml_module)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"nvml_module: cannot load {settings.nvml_module!r}: {exc}") from None
        agent = Agent(settings, _advertised(settings))
        agent.on_config_error = service.fail  # refused by the scheduler: exit 2 naming the setting
        holder["agent"] = agent
        await agent.start()  # background tasks; registration retries until metadata answers

    async def on_stop() -> None:
        agent = holder.get("agent")
        if agent is not None:
            await agent.shutdown()

    service = ServiceDefinition(
        name="worker-agent",
        service_names=["silod.v1.WorkerAgentService"],
        register=register,
        on_start=on_start,
        on_stop=on_stop,
    )
    return service
