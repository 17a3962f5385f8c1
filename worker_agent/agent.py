"""The worker agent's state machine: plan application, task processes, reports, heartbeats.

Protocol decisions (see also service.py):

* Plans: ``AllocationService.Watch`` is consumed by one task; only the newest NodePlan is kept
  pending and an applier applies each version at most once (versions <= applied are ignored),
  then Acks it. Applying diffs the desired tasks (job_id, rank, generation, gpus) against the
  local ones: tasks no longer desired (or of another generation, or on other GPUs) are stopped
  first, and only once they have exited are their GPUs released and new tasks launched.
* Fast resize (AFE, ``TaskAssignment.fast_resize``): a live task of the job whose GPUs are
  exactly those of an assignment of a newer generation *survives*: it keeps its process and
  GPUs, is re-keyed to the new (rank, generation) at once (reports go under the new identity,
  STARTING until its SDK calls with it) and its directive becomes REFORM with the new world,
  which the SDK picks up on its next poll. The agent also answers the survivor's SDK under the
  old identity until then. If the job has a survivor on this node, its other old tasks are
  removed with directive EXIT (exit 0, no checkpoint: the survivors keep the state), else the
  usual checkpoint-and-exit stop applies. New ranks launch once removed ones have exited. A
  survivor's GPUs and run file stay under the key it was launched as (``launch_key``), so the
  GPU table's acquires are exactly the launched processes. See docs/development.md.
* Stopping a task: its directive becomes CHECKPOINT_AND_EXIT (GetDirective reports the seconds
  left), SIGTERM goes to its process group at once (the SDK's handler turns it into
  ``should_checkpoint()``), and SIGKILL follows when the deadline passes.
* GPUs: :class:`GpuTable` refuses to give a device to a task while another local task holds it.
  A task holds its GPUs from launch until its process has exited.
* Reports: ``ReportTasks`` every ``report_s`` and right after any phase change; EXITED tasks
  are repeated until the response lists them in ``acknowledged_exits`` ("job_id/rank/generation").
* Agent death (SIGKILL, OOM kill, crash): every task's process is started with
  PR_SET_PDEATHSIG=SIGKILL (see :data:`_DIE_WITH_AGENT`), so it dies with its agent as it would
  with the machine. The scheduler requeues the job once the node's heartbeats stop; a task
  orphaned instead would keep running unsupervised and write the job's checkpoint directory
  concurrently with the requeued generation. Processes a task started itself (same process
  group) do not inherit the death signal: the SDK in them sees its agent gone
  (``SILOD_AGENT_PID``), writes no more checkpoints and asks the job to exit; and the next agent
  on the same work_dir stops whole process groups it finds recorded in ``run/`` before applying
  any plan.
* Credentials (auth on): a rank's SILOD_AUTH_TOKEN is a credential of its own job, minted for
  this node by the metadata service (MintJobCredential) when the job's first rank here launches
  and kept while the job has tasks here; the cluster token never reaches a rank's environment.
  Without one the rank is not launched (exit 127, the reason in its log).
* Agent shutdown (SIGTERM): every task gets the checkpoint directive + SIGTERM, SIGKILL after
  ``stop_grace_s``; tasks stopped this way are not reported EXITED (exit 0 after a checkpoint
  would read as job completion); the node's heartbeats stop and the scheduler treats it as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from silod.rpc.channels import open_channel
from services.runtime.auth import auth_enabled, caller_token
from services.runtime.structured_logging import get_logger
from silod.v1 import (
    allocation_pb2,
    allocation_pb2_grpc,
    common_pb2,
    metadata_pb2,
    metadata_pb2_grpc,
    plan_pb2,
    worker_agent_pb2,
)
from worker_agent import node_protocol, nvml
from worker_agent.gpu_monitor import GpuMonitor
from worker_agent.gpus import GpuTable, resolve_gpu_type
from worker_agent import task_metrics
from worker_agent.warm_start import WarmPool

_log = get_logger("silod.worker_agent")

_STATE_NAMES = {
    allocation_pb2.TASK_PHASE_STARTING: "starting",
    allocation_pb2.TASK_PHASE_RUNNING: "running",
    allocation_pb2.TASK_PHASE_CHECKPOINTING: "checkpointing",
    allocation_pb2.TASK_PHASE_EXITED: "exited",
}


# Run as ``python -S -c _DIE_WITH_AGENT AGENT_PID COMMAND...``: sets PR_SET_PDEATHSIG and execs
# the task's command (the death signal survives exec). A separate exec rather than Popen's
# preexec_fn because the agent has gRPC threads, and code run between fork and exec in a
# threaded process can deadlock. If the agent died before prctl took effect, exit at once.
# Without prctl (not Linux; /proc is needed elsewhere too) tasks outlive a killed agent.
_DIE_WITH_AGENT = (
    "import ctypes, os, signal, sys\n"
    "PR_SET_PDEATHSIG = 1\n"
    "prctl = getattr(ctypes.CDLL(None, use_errno=True), 'prctl', None)\n"
    "if prctl is not None and prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:\n"
    "    sys.exit('silod: prctl(PR_SET_PDEATHSIG) failed: ' + os.strerror(ctypes.get_errno()))\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(137)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    print(f'--- silod: cannot launch {sys.argv[2:]!r}: {exc}', flush=True)\n"
    "    os._exit(127)\n"
)


class JobCredentialError(Exception):
    """The metadata service would not mint a credential for a job's ranks here."""


def task_key(job_id: str, rank: int, generation: int) -> str:
    return f"{job_id}/{rank}/{generation}"


@dataclass
class Task:
    assignment: plan_pb2.TaskAssignment
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    phase: int = allocation_pb2.TASK_PHASE_STARTING
    exit_code: int = 0
    progress: common_pb2.JobProgress = field(default_factory=common_pb2.JobProgress)
    step_time_s: float = 0.0
    batch_size: int = 0
    grad_sqr: float = 0.0  # gradient statistics the SDK measured (0 = none)
    grad_var: float = 0.0
    stop_deadline: float = 0.0  # monotonic; 0 = not asked to stop
    stop_asked_at: float = 0.0  # monotonic time of the SIGTERM that asked it to stop
    killed_at_deadline: bool = False  # it missed its checkpoint deadline and got SIGKILL
    reform_since: float = 0.0  # monotonic; a fast-resize survivor not yet heard from under its new identity
    stopped_by_shutdown: bool = False  # the agent, not the plan, stopped it: never report it EXITED
    leave: bool = False  # removed by a fast resize: asked to exit without a checkpoint
    launch_key: str = ""  # key it was launched as: its GPU table holder name and run file
    aliases: set[tuple[int, int]] = field(default_factory=set)  # (rank, generation) it ran as before a fast resize
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def job_id(self) -> str:
        return self.assignment.job_id

    @property
    def rank(self) -> int:
        return self.assignment.rank

    @property
    def generation(self) -> int:
        return self.assignment.generation

    @property
    def key(self) -> str:
        return task_key(self.job_id, self.rank, self.generation)

    @property
    def gpus(self) -> list[int]:
        return list(self.assignment.gpu_indices)

    def report(self) -> allocation_pb2.TaskReport:
        return allocation_pb2.TaskReport(
            job_id=self.job_id,
            rank=self.rank,
            generation=self.generation,
            phase=self.phase,
            exit_code=self.exit_code,
            gpu_indices=[] if self.phase == allocation_pb2.TASK_PHASE_EXITED else self.gpus,
            progress=self.progress,
            step_time_s=self.step_time_s,
            batch_size=self.batch_size or self.assignment.batch_size,
            grad_sqr=self.grad_sqr,
            grad_var=self.grad_var,
        )

    def status(self) -> worker_agent_pb2.TaskStatus:
        return worker_agent_pb2.TaskStatus(
            job_id=self.job_id,
            rank=self.rank,
            world_size=self.assignment.world_size,
            pid=self.proc.pid if self.proc is not None and not self.exited.is_set() else 0,
            gpu_indices=self.gpus,
            generation=self.generation,
            state=_STATE_NAMES.get(self.phase, "starting"),
            exit_code=self.exit_code,
        )


class Agent:
    def __init__(self, settings: Any, agent_address: str) -> None:
        self.settings = settings
        self.agent_address = agent_address
        # NVML (worker_agent.nvml) gives the GPUs and their health; without it they are emulated.
        session = nvml.open_session(getattr(settings, "nvml_module", ""))
        gpus, model = (session.count, session.model) if session is not None else (settings.gpus, "emulated")
        self.work_dir = Path(settings.work_dir).resolve()
        (self.work_dir / "jobs").mkdir(parents=True, exist_ok=True)
        self.checkpoint_root = Path(settings.checkpoint_root or self.work_dir / "checkpoints").resolve()
        self.checkpoint_root.mkdir(parents=True, exist_ok=True)
        self.spec = common_pb2.NodeSpec(
            name=settings.node_name or socket.gethostname(),
            pool=common_pb2.NODE_POOL_INFERENCE if settings.pool == "inference" else common_pb2.NODE_POOL_TRAINING,
            gpus=gpus,
            gpu_model=model,
            gpu_type=resolve_gpu_type(getattr(settings, "gpu_type", ""), model),
            cache_capacity_bytes=settings.cache_capacity_bytes,
            memory_cache_bytes=settings.memory_cache_bytes,
            agent_address=agent_address,
            cache_address=settings.cache_address,
        )
        self.gpu_table = GpuTable(gpus, self.work_dir / "gpu-table.jsonl")
        task_metrics.track_ranks(self.spec.name, lambda: len(self._live()))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat_now = asyncio.Event()
        self.gpu_monitor = GpuMonitor(session, self.spec.name, self._gpu_fault_seen) if session is not None else None
        self.tasks: dict[str, Task] = {}  # live tasks and exited ones not yet acknowledged
        self.finished: set[str] = set()  # keys of tasks that exited; never relaunched for the same generation
        self.applied_version = 0
        self.applied_versions: list[int] = []
        self.plan_epoch = 0  # the newest scheduler leadership epoch seen on a plan (fencing)
        self.refused_plans: list[tuple[int, int]] = []  # (version, epoch) of plans from an older epoch
        self._acks: set[asyncio.Task[None]] = set()  # refusals' Acks in flight
        self._pending: plan_pb2.NodePlan | None = None
        self._pending_since = 0.0  # monotonic time the pending plan arrived
        self._plan_ready = asyncio.Event()
        self._report_now = asyncio.Event()
        self._registered = asyncio.Event()
        self._bg: list[asyncio.Task[None]] = []  # heartbeat first, then watch, apply, report
        self._reapers: set[asyncio.Task[None]] = set()  # one per process; never cancelled before it exits
        self._stopping = False
        self._apply_lock = asyncio.Lock()
        self._job_tokens: dict[str, str] = {}  # job id -> the credential its ranks here hold (auth on)
        token = caller_token(settings)  # its node credential, else the cluster token
        self._meta_channel = open_channel(settings.metadata_address, token=token, aio=True)
        self._metadata = metadata_pb2_grpc.MetadataServiceStub(self._meta_channel)
        self._alloc_channel = None
        self._alloc = None
        # Several schedulers (--scheduler-address a,b; --leader-election on them): the watch moves to
        # the next address whenever it breaks; a standby answers UNAVAILABLE, the leader streams plans.
        self._scheduler_addresses = [a.strip() for a in settings.scheduler_address.split(",") if a.strip()]
        self._alloc_channels: dict[str, Any] = {}
        self._scheduler_index = 0
        self._token = token
        if self._scheduler_addresses:
            self._use_scheduler(0)
        self.warm: WarmPool | None = None
        if getattr(settings, "warm_processes", 0) > 0 and settings.scheduler_address:
            preload = [m.strip() for m in settings.warm_preload.split(",") if m.strip()]
            self.warm = WarmPool(settings.warm_processes, preload, {**self.base_env(), "PYTHONUNBUFFERED": "1"},
                                 self.work_dir, self._spawn)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._stop_leftovers()
        if self.warm is not None:
            await self.warm.fill()
        self._bg.append(asyncio.ensure_future(self._register_and_heartbeat()))
        if self._alloc is not None:
            self._bg.append(asyncio.ensure_future(self._watch_loop()))
            self._bg.append(asyncio.ensure_future(self._apply_loop()))
            self._bg.append(asyncio.ensure_future(self._report_loop()))

    async def shutdown(self) -> None:
        """Stop every task (checkpoint directive + SIGTERM, SIGKILL after the grace), report, close."""
        self._stopping = True
        for t in self._bg[1:]:  # keep heartbeating while tasks stop
            t.cancel()
        async with self._apply_lock:
            live = self._live()
            for t in live:
                t.stopped_by_shutdown = True
            await asyncio.gather(*(self._stop_task(t, self.settings.stop_grace_s) for t in live))
        with contextlib.suppress(Exception):
            await self._report_once(timeout=3)
        for t in self._bg:
            t.cancel()
        for t in self._bg:
            with contextlib.suppress(BaseException):
                await t
        if self.warm is not None:
            await self.warm.close()
        if self.gpu_monitor is not None:
            await asyncio.to_thread(self.gpu_monitor.close)  # joins the Xid thread
        await self._meta_channel.close()
        for channel in self._alloc_channels.values():
            await channel.close()

    # ---- processes of a previous incarnation ------------------------------------------------
    @property
    def _run_dir(self) -> Path:
        return self.work_dir / "run"

    @staticmethod
    def _start_time(pid: int) -> str:
        """The process's start time (Linux /proc), to tell it from a later process reusing the pid."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return ""
        return stat.rsplit(")", 1)[1].split()[19]

    @staticmethod
    def _group_members(pgid: int) -> list[int]:
        """Live (non-zombie) processes of process group ``pgid`` (Linux /proc)."""
        members = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry.name))
        return members

    def _leftover_group(self, record: dict[str, Any]) -> bool:
        """Is the process group of a recorded task still there?

        Each task leads its own session and group (pgid == its pid). The leader itself dies with
        the agent that started it (PR_SET_PDEATHSIG), but processes it started stay in its group.
        The pid of a dead leader cannot be reused while its group has members, so members of that
        group are the task's. A live process with that pid but another start time is a stranger."""
        pid = int(record.get("pid", 0))
        if pid <= 0:
            return False
        start = self._start_time(pid)
        if start and start != record.get("start_time"):
            return False
        return bool(self._group_members(pid))

    async def _stop_leftovers(self) -> None:
        """Stop tasks a previous agent on this work_dir left running (it was killed, not stopped):
        their GPUs are not in our table, so they must be gone before any plan is applied.
        Their process groups get SIGTERM (the SDK checkpoints) and SIGKILL after ``stop_grace_s``."""
        self._run_dir.mkdir(parents=True, exist_ok=True)
        leftovers = []
        for path in self._run_dir.glob("*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            if self._leftover_group(record):
                leftovers.append((int(record["pid"]), record))
            else:
                path.unlink(missing_ok=True)
        for pid, record in leftovers:
            _log.warning("stopping a task left by a previous agent", extra={"task": record.get("task"), "pgid": pid})
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.stop_grace_s
        for pid, record in leftovers:
            killed_at = 0.0
            while self._group_members(pid):
                now = time.monotonic()
                if not killed_at and now >= deadline:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                    killed_at = now
                elif killed_at and now - killed_at > 10.0:  # unkillable (stuck in the kernel): nothing more to do
                    _log.error("a task left by a previous agent survives SIGKILL", extra={"pgid": pid})
                    break
                await asyncio.sleep(0.05)
        for path in self._run_dir.glob("*.json"):
            path.unlink(missing_ok=True)

    def _run_file(self, task: Task) -> Path:
        return self._run_dir / (task.launch_key.replace("/", "_") + ".json")

    def _live(self) -> list[Task]:
        return [t for t in self.tasks.values() if not t.exited.is_set()]

    # ---- registration ----------------------------------------------------------------------
    def _gpu_fault_seen(self) -> None:
        """A GPU fault was queued (from the NVML event thread): heartbeat at once, so the
        scheduler moves the job off that GPU without waiting for the next interval."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._heartbeat_now.set)

    async def _heartbeat_request(self) -> metadata_pb2.HeartbeatRequest:
        request = metadata_pb2.HeartbeatRequest(node=self.spec.name, applied_plan_version=self.applied_version)
        if self.gpu_monitor is not None:
            try:
                request.gpu_telemetry.extend(await self.gpu_monitor.sample())
            except Exception:  # noqa: BLE001 - a failing sample must not stop the node's heartbeats
                _log.exception("sampling the GPUs failed")
            request.gpu_faults.extend(self.gpu_monitor.pending_faults())
        return request

    async def _register_and_heartbeat(self) -> None:
        def on_reply(request: metadata_pb2.HeartbeatRequest, node: common_pb2.Node) -> None:
            if self.gpu_monitor is not None:
                self.gpu_monitor.delivered(list(request.gpu_faults))
                self.gpu_monitor.record(node)

        await node_protocol.register_and_heartbeat(
            self._metadata, self.spec, interval_s=self.settings.heartbeat_s, wake=self._heartbeat_now,
            registered=self._registered, request=self._heartbeat_request, log=_log, on_reply=on_reply)

    # ---- plans -----------------------------------------------------------------------------
    def _use_scheduler(self, index: int) -> None:
        self._scheduler_index = index % len(self._scheduler_addresses)
        address = self._scheduler_addresses[self._scheduler_index]
        if address not in self._alloc_channels:
            self._alloc_channels[address] = open_channel(address, token=self._token, aio=True)
        self._alloc_channel = self._alloc_channels[address]
        self._alloc = allocation_pb2_grpc.AllocationServiceStub(self._alloc_channel)

    async def _watch_loop(self) -> None:
        # Plans are acked only once the node exists in the metadata store: the scheduler records
        # an Ack as the node's heartbeat, which fails for a node not registered yet.
        await self._registered.wait()
        several = len(self._scheduler_addresses) > 1
        await node_protocol.follow_plans(
            self.spec.name, allocation_pb2.PLAN_COMPONENT_WORKER_AGENT, stub=lambda: self._alloc,
            known_version=lambda: self.applied_version, offer=self.offer_plan,
            on_error=lambda what, detail: _log.info(what, extra={"detail": detail}),
            next_scheduler=(lambda: self._use_scheduler(self._scheduler_index + 1)) if several else None)

    def offer_plan(self, plan: plan_pb2.NodePlan) -> None:
        """Keep ``plan`` as the next to apply if it is newer than what is applied or pending.
        A plan from an older leadership epoch than the newest seen comes from a deposed
        scheduler: it is refused (logged, and Acked ok=False naming the reason)."""
        reason = node_protocol.epoch_refusal(plan, self.plan_epoch)
        if reason:
            _log.warning("plan from an older epoch refused", extra={"version": plan.version, "reason": reason})
            self.refused_plans.append((plan.version, plan.epoch))
            if self._alloc is not None:
                self._spawn_ack(allocation_pb2.AckPlanRequest(
                    node=self.spec.name, component=allocation_pb2.PLAN_COMPONENT_WORKER_AGENT,
                    version=plan.version, ok=False, message=reason))
            return
        self.plan_epoch = plan.epoch
        newest = max(self.applied_version, self._pending.version if self._pending is not None else 0)
        if plan.version <= newest:
            return
        if self._pending is None:
            self._pending_since = time.monotonic()
        self._pending = plan
        self._plan_ready.set()

    def _spawn_ack(self, request: allocation_pb2.AckPlanRequest) -> None:
        async def ack() -> None:
            try:
                await self._alloc.Ack(request, timeout=10)  # type: ignore[union-attr]
            except grpc.aio.AioRpcError as exc:
                _log.warning("ack failed", extra={"version": request.version, "code": exc.code().name})

        task = asyncio.ensure_future(ack())
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _apply_loop(self) -> None:
        while True:
            await self._plan_ready.wait()
            self._plan_ready.clear()
            plan, self._pending = self._pending, None
            arrived = self._pending_since
            if plan is None or plan.version <= self.applied_version:
                continue
            ok, message, released = True, "", []
            try:
                async with self._apply_lock:
                    released = await self.apply(plan)
            except Exception as exc:  # noqa: BLE001 - reported to the scheduler in the Ack
                _log.exception("applying plan failed", extra={"version": plan.version})
                ok, message = False, f"{type(exc).__name__}: {exc}"
            self.applied_version = plan.version
            self.applied_versions.append(plan.version)
            self._report_now.set()
            try:
                await self._alloc.Ack(  # type: ignore[union-attr]
                    allocation_pb2.AckPlanRequest(
                        node=self.spec.name,
                        component=allocation_pb2.PLAN_COMPONENT_WORKER_AGENT,
                        version=plan.version,
                        ok=ok,
                        message=message,
                        released_jobs=sorted(set(released)),
                    ),
                    timeout=10,
                )
            except grpc.aio.AioRpcError as exc:
                _log.warning("ack failed", extra={"version": plan.version, "code": exc.code().name})
            task_metrics.plan_applied(self.spec.name, plan.version, time.monotonic() - arrived)

    async def apply(self, plan: plan_pb2.NodePlan) -> list[str]:
        """Make the local tasks match ``plan``; return jobs whose GPUs here were released."""
        desired = {task_key(a.job_id, a.rank, a.generation): a for a in plan.tasks}
        surviving_jobs = self._fast_resize(plan)
        to_stop = []
        for t in self._live():
            want = desired.get(t.key)
            if want is None or sorted(want.gpu_indices) != sorted(t.gpus):
                t.leave = t.leave or (t.stop_deadline == 0.0 and t.job_id in surviving_jobs)
                to_stop.append(t)
        released = [t.job_id for t in to_stop]
        if to_stop:
            _log.info("stopping tasks", extra={"version": plan.version, "tasks": [t.key for t in to_stop],
                                               "leaving": [t.key for t in to_stop if t.leave]})
            await asyncio.gather(*(self._stop_task(t, self.settings.checkpoint_deadline_s) for t in to_stop))
            for t in to_stop:  # moved to other GPUs within one generation (not expected): relaunch it
                if t.key in desired:
                    self.finished.discard(t.key)
                    del self.tasks[t.key]
        running = {t.key for t in self._live()}
        for key, a in desired.items():
            if key in running or key in self.finished:
                continue
            await self._launch(a)
        return released

    def _fast_resize(self, plan: plan_pb2.NodePlan) -> set[str]:
        """Re-key survivors of fast resizes to their new assignments; return the jobs that have one.

        A survivor is a live task not asked to stop, of an older generation than a fast_resize
        assignment of its job, on exactly that assignment's GPUs. Ranks are matched by GPUs,
        not by number: a survivor may be renumbered (the world shrank below it)."""
        surviving: set[str] = set()
        live = [t for t in self._live() if t.stop_deadline == 0.0]
        for a in plan.tasks:
            if not a.fast_resize:
                continue
            t = next((t for t in live if t.job_id == a.job_id and t.generation < a.generation
                      and sorted(t.gpus) == sorted(a.gpu_indices)), None)
            if t is None:
                continue
            live.remove(t)
            old = (t.rank, t.generation, t.assignment.world_size)
            del self.tasks[t.key]
            t.aliases.add((t.rank, t.generation))
            t.assignment = a
            t.phase = allocation_pb2.TASK_PHASE_STARTING  # RUNNING again once its SDK uses the new identity
            t.reform_since = time.monotonic()
            self.tasks[t.key] = t
            surviving.add(a.job_id)
            with open(t.log_path, "ab") as log:  # not a launch line: the e2e checks count those
                log.write(f"--- silod: fast resize to generation {a.generation} rank {a.rank} of {a.world_size} "
                          f"(was generation {old[1]} rank {old[0]} of {old[2]})\n".encode())
            _log.info("fast resize: task survives", extra={"task": t.key, "was": task_key(t.job_id, old[0], old[1]),
                                                           "pid": t.proc.pid if t.proc else 0})
        if surviving:
            self._report_now.set()
        return surviving

    async def _stop_task(self, task: Task, deadline_s: float) -> None:
        if task.exited.is_set():
            return
        if task.stop_deadline == 0.0:
            task.stop_asked_at = time.monotonic()
            task.stop_deadline = task.stop_asked_at + deadline_s
            task.phase = allocation_pb2.TASK_PHASE_CHECKPOINTING
            self._report_now.set()
            self._signal(task, signal.SIGTERM)
        remaining = max(0.0, task.stop_deadline - time.monotonic())
        try:
            await asyncio.wait_for(task.exited.wait(), remaining)
        except asyncio.TimeoutError:
            _log.warning("task missed its checkpoint deadline; killing", extra={"task": task.key})
            task.killed_at_deadline = True
            self._signal(task, signal.SIGKILL)
            await task.exited.wait()

    @staticmethod
    def _signal(task: Task, sig: signal.Signals) -> None:
        if task.proc is None or task.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(task.proc.pid, sig)

    # ---- launching -------------------------------------------------------------------------
    def base_env(self) -> dict[str, str]:
        """The agent's environment without its own settings (SILOD_LISTEN, SILOD_GPUS, ...), which
        must not leak into jobs. With auth on, that includes the cluster token: ranks get a
        credential of their own job instead (:meth:`env_for`). Without auth, a SILOD_AUTH_TOKEN of
        the environment is passed on as it always was."""
        own = {f"SILOD_{name.upper()}" for name in type(self.settings).model_fields} | {"SILOD_CONFIG"}
        if not auth_enabled(self.settings):
            own.discard("SILOD_AUTH_TOKEN")
        return {k: v for k, v in os.environ.items() if k not in own}

    async def job_token(self, job_id: str, launching: Task | None = None) -> str:
        """The job credential this node's ranks of ``job_id`` hold as SILOD_AUTH_TOKEN ("" with auth
        off): minted by the metadata service for this node (MintJobCredential), kept while the job
        has other tasks here. Raises JobCredentialError when none can be had."""
        if not auth_enabled(self.settings):
            return ""
        held = {t.job_id for t in self.tasks.values() if t is not launching}
        for stale in [j for j in self._job_tokens if j not in held]:
            del self._job_tokens[stale]
        if job_id in self._job_tokens:
            return self._job_tokens[job_id]
        from silod.v1 import access_pb2

        request = access_pb2.MintJobCredentialRequest(job_id=job_id, node=self.spec.name)
        for attempt in range(1, 4):
            try:
                issued = await self._metadata.MintJobCredential(request, timeout=5)
                break
            except grpc.aio.AioRpcError as exc:
                if attempt == 3 or exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise JobCredentialError(f"no job credential: {exc.code().name}: {exc.details()}") from None
                await asyncio.sleep(0.5 * attempt)
        self._job_tokens[job_id] = issued.token
        return issued.token

    def env_for(self, a: plan_pb2.TaskAssignment, job_token: str = "") -> dict[str, str]:
        spec = a.spec
        env = {
            **self.base_env(),
            "PYTHONUNBUFFERED": "1",
            "SILOD_JOB_ID": a.job_id,
            "SILOD_RANK": str(a.rank),
            "SILOD_WORLD_SIZE": str(max(a.world_size, 1)),
            "SILOD_GENERATION": str(a.generation),
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in a.gpu_indices),
            "SILOD_CACHE_ADDR": self.settings.cache_address,
            "SILOD_AGENT_ADDR": self.agent_address,
            # Lets the SDK in processes that do not die with the agent (a task's own children)
            # notice it is gone: see silod.job.ClusterContext.agent_lost.
            "SILOD_AGENT_PID": str(os.getpid()),
            "SILOD_AGENT_START_TIME": self._start_time(os.getpid()),
            "SILOD_METADATA_ADDR": self.settings.metadata_address,
            "SILOD_CHECKPOINT_DIR": str(self.checkpoint_root / a.job_id),
            # torchrun's variables: an unmodified init_process_group("env://") script runs as is.
            "RANK": str(a.rank),
            "WORLD_SIZE": str(max(a.world_size, 1)),
            "LOCAL_RANK": str(a.local_rank),
            "LOCAL_WORLD_SIZE": str(max(a.local_world_size, 1)),
            "GROUP_RANK": str(a.group_rank),
            "MASTER_ADDR": self.master_addr(a),
            "MASTER_PORT": str(a.master_port),
            "SILOD_BATCH_SIZE": str(a.batch_size or spec.batch_size),
            # The batch size gradient statistics are expressed at (the estimator's B0).
            "SILOD_BASE_BATCH_SIZE": str(spec.batch_size),
            "SILOD_STEP_COMPUTE_S": repr(spec.emulated_step_compute_s),
            # Wall-clock launch time: the SDK says how long the rank took to be ready to train.
            "SILOD_LAUNCH_TIME": f"{time.time():.3f}",
        }
        if spec.dataset:  # what the job reads through silod.data (the emulated job reads it each step)
            env["SILOD_DATASET"] = spec.dataset
        if spec.kind == common_pb2.JOB_KIND_INFERENCE:
            env["SILOD_JOB_KIND"] = "inference"
            env["SILOD_INFERENCE_DURATION_S"] = repr(spec.inference_duration_s)
        budget = spec.WhichOneof("budget")
        if budget == "sample_budget":
            env["SILOD_SAMPLE_BUDGET"] = str(spec.sample_budget)
        elif budget == "epochs":
            env["SILOD_EPOCHS"] = str(spec.epochs)
        env.update(spec.env)
        if a.local_world_size > 1 and "OMP_NUM_THREADS" not in env:
            # torchrun's default: ranks that share a node would otherwise each start a thread per
            # core and oversubscribe it. The job's or the operator's setting wins.
            env["OMP_NUM_THREADS"] = "1"
        if job_token:  # after spec.env: a rank holds its own job's credential and no other
            env["SILOD_AUTH_TOKEN"] = job_token
        return env

    def master_addr(self, a: plan_pb2.TaskAssignment) -> str:
        """Rank 0's host as the plan names it; a plan without one (an older scheduler) has all
        ranks here, so this node's advertised host is right."""
        if a.master_addr:
            return a.master_addr
        host, sep, _ = self.agent_address.rpartition(":")
        return host.strip("[]") if sep else self.agent_address

    async def _launch(self, a: plan_pb2.TaskAssignment) -> None:
        key = task_key(a.job_id, a.rank, a.generation)
        self.gpu_table.acquire(key, list(a.gpu_indices))  # raises GpuConflict: never double-book
        log_dir = self.work_dir / "jobs" / a.job_id
        log_dir.mkdir(parents=True, exist_ok=True)
        (self.checkpoint_root / a.job_id).mkdir(parents=True, exist_ok=True)
        task = Task(assignment=a, log_path=log_dir / f"rank-{a.rank}.log", batch_size=a.batch_size, launch_key=key)
        self.tasks[key] = task
        command = list(a.spec.command) or [sys.executable, "-m", "silod.jobs.emulated"]
        warm = False
        try:
            env = self.env_for(a, await self.job_token(a.job_id, launching=task))
            with open(task.log_path, "ab") as log:
                log.write(f"--- silod: generation {a.generation} rank {a.rank} gpus {list(a.gpu_indices)}\n".encode())
                log.flush()
                if self.warm is not None and a.spec.resize_in_place:
                    task.proc = await self.warm.take(command, env, str(log_dir), task.log_path)
                    warm = task.proc is not None
                if task.proc is None:
                    task.proc = await self._spawn(*command, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                                                  stderr=asyncio.subprocess.STDOUT, env=env, cwd=str(log_dir))
        except (OSError, JobCredentialError) as exc:
            with open(task.log_path, "ab") as log:
                log.write(f"--- silod: cannot launch {command!r}: {exc}\n".encode())
            task_metrics.launch_failed(self.spec.name)
            self._mark_exited(task, task_metrics.LAUNCH_FAILED_EXIT_CODE)
            return
        self._run_file(task).write_text(
            json.dumps({"task": key, "pid": task.proc.pid, "start_time": self._start_time(task.proc.pid)})
        )
        _log.info("task launched", extra={"task": key, "pid": task.proc.pid, "gpus": list(a.gpu_indices),
                                          "warm": warm})
        task_metrics.launched(self.spec.name, warm=warm)
        self._report_now.set()
        self._reapers.add(asyncio.ensure_future(self._reap(task)))

    async def _spawn(self, *argv: str, **kwargs: Any) -> asyncio.subprocess.Process:
        """Start ``argv`` as the leader of a new process group that dies with the agent."""
        return await asyncio.create_subprocess_exec(
            sys.executable, "-S", "-c", _DIE_WITH_AGENT, str(os.getpid()), *argv, start_new_session=True, **kwargs)

    async def _reap(self, task: Task) -> None:
        assert task.proc is not None
        try:
            code = await task.proc.wait()
            self._mark_exited(task, code if code >= 0 else 128 - code)
        finally:
            self._reapers.discard(asyncio.current_task())  # type: ignore[arg-type]

    def _mark_exited(self, task: Task, code: int) -> None:
        task.exit_code = code
        task.phase = allocation_pb2.TASK_PHASE_EXITED
        self._run_file(task).unlink(missing_ok=True)
        self.gpu_table.release(task.launch_key)
        self.finished.add(task.key)
        task.exited.set()
        _log.info("task exited", extra={"task": task.key, "exit_code": code})
        asked = task.stop_asked_at > 0 and not task.stopped_by_shutdown
        cause = task_metrics.exit_cause(code, asked_to_stop=asked, leaving=task.leave,
                                        killed_at_deadline=task.killed_at_deadline,
                                        agent_shutdown=task.stopped_by_shutdown)
        checkpoint_s = time.monotonic() - task.stop_asked_at if asked and not task.leave else None
        task_metrics.exited(self.spec.name, cause, checkpoint_s)
        self._report_now.set()

    # ---- reports ---------------------------------------------------------------------------
    async def _report_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._report_now.wait(), self.settings.report_s)
            self._report_now.clear()
            try:
                await self._report_once()
            except grpc.aio.AioRpcError as exc:
                _log.info("report failed", extra={"code": exc.code().name, "detail": exc.details()})
                await asyncio.sleep(min(self.settings.report_s, 1.0))

    async def _report_once(self, timeout: float = 10) -> None:
        if self._alloc is None:
            return
        # A task the agent stopped because it is shutting down exits 0 after its checkpoint, which
        # the scheduler would read as "finished": it is left out, so the scheduler's last view of
        # it is RUNNING/CHECKPOINTING and the node's lost heartbeats decide what happens to the job.
        reports = [t.report() for t in self.tasks.values() if not t.stopped_by_shutdown]
        acknowledged = await node_protocol.report_tasks(self._alloc, self.spec.name, self.applied_version, reports,
                                                        timeout=timeout)
        for key in acknowledged:
            t = self.tasks.get(key)
            if t is not None and t.exited.is_set():
                del self.tasks[key]

    # ---- SDK-facing ------------------------------------------------------------------------
    def find(self, job_id: str, rank: int, generation: int) -> Task:
        from services.runtime import errors

        if not job_id:
            raise errors.InvalidArgument("must not be empty", field="job_id")
        same_job = [t for t in self.tasks.values() if t.job_id == job_id]
        if not same_job:
            raise errors.NotFound(f"no task of job {job_id!r} on node {self.spec.name}", field="job_id")
        for t in same_job:  # a survivor of a fast resize also answers to its old identities
            if (t.rank, t.generation) == (rank, generation) or (rank, generation) in t.aliases:
                return t
        same_rank = [t for t in same_job if t.rank == rank]
        if not same_rank:
            raise errors.NotFound(f"job {job_id!r} has no rank {rank} on node {self.spec.name}", field="rank")
        current = max(t.generation for t in same_rank)
        raise errors.FailedPrecondition(
            f"generation {generation} is stale; rank {rank} of {job_id!r} runs generation {current}", field="generation"
        )

    def record_progress(self, request: worker_agent_pb2.ReportProgressRequest) -> None:
        task = self.find(request.job_id, request.rank, request.generation)
        task.progress.CopyFrom(request.progress)
        if request.step_time_s > 0:
            task.step_time_s = request.step_time_s
        if request.batch_size > 0:
            task.batch_size = request.batch_size
        if request.grad_sqr > 0 and request.grad_var >= 0:
            task.grad_sqr, task.grad_var = request.grad_sqr, request.grad_var
        self._heard_from(task, request.rank, request.generation)

    def _heard_from(self, task: Task, rank: int, generation: int) -> None:
        """A call under the task's current identity: it runs (a survivor: it has re-formed)."""
        if task.phase == allocation_pb2.TASK_PHASE_STARTING and (rank, generation) == (task.rank, task.generation):
            if task.reform_since:
                task_metrics.reformed(self.spec.name, time.monotonic() - task.reform_since)
                task.reform_since = 0.0
            task.phase = allocation_pb2.TASK_PHASE_RUNNING
            self._report_now.set()

    def directive(self, request: worker_agent_pb2.GetDirectiveRequest) -> worker_agent_pb2.Directive:
        task = self.find(request.job_id, request.rank, request.generation)
        if task.stop_deadline:
            return worker_agent_pb2.Directive(
                action=worker_agent_pb2.DIRECTIVE_ACTION_EXIT if task.leave
                else worker_agent_pb2.DIRECTIVE_ACTION_CHECKPOINT_AND_EXIT,
                deadline_s=max(0.0, task.stop_deadline - time.monotonic()),
            )
        if (request.rank, request.generation) != (task.rank, task.generation):  # an old identity: re-form
            a = task.assignment
            return worker_agent_pb2.Directive(
                action=worker_agent_pb2.DIRECTIVE_ACTION_REFORM, new_world_size=a.world_size, new_rank=a.rank,
                new_generation=a.generation, master_addr=self.master_addr(a),
                master_port=a.master_port, new_batch_size=a.batch_size or a.spec.batch_size,
                new_local_rank=a.local_rank, new_local_world_size=max(a.local_world_size, 1),
                new_group_rank=a.group_rank,
            )
        self._heard_from(task, request.rank, request.generation)
        return worker_agent_pb2.Directive(action=worker_agent_pb2.DIRECTIVE_ACTION_CONTINUE)

    def node_status(self) -> worker_agent_pb2.NodeStatus:
        return worker_agent_pb2.NodeStatus(
            spec=self.spec,
            applied_plan_version=self.applied_version,
            tasks=[t.status() for t in self.tasks.values()],
            free_gpus=self.gpu_table.free(),
            gpu_telemetry=self.gpu_monitor.telemetry if self.gpu_monitor is not None else [],
            gpu_faults=self.gpu_monitor.faults if self.gpu_monitor is not None else [],
        )
