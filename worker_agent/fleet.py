"""A node fleet: hundreds or thousands of emulated nodes in one process, each speaking the
worker agent's protocol to the real scheduler and metadata service.

    python -m worker_agent.fleet --nodes 1000 --gpus 8 --metadata-address A --scheduler-address B

Each node registers (``UpsertNode``), heartbeats, keeps its own ``AllocationService.Watch``
stream, applies every NodePlan it is sent, Acks it (naming the jobs whose GPUs it released) and
reports its tasks (``ReportTasks``), with the functions the real agent calls
(worker_agent/node_protocol.py) and the agent's own task records (``tasks.Task``). Only the
ranks are emulated: a task is RUNNING from the moment its plan is applied, reports progress
(rank 0: samples, steps, throughput) and, with ``--task-seconds S``, exits 0 after S seconds
so that its job succeeds; a task the plan takes away checkpoints and exits at once. Nodes
advertise no cache server (the scheduler then grants no cache there).

All nodes share one metadata channel and one channel to each scheduler per
``--streams-per-channel`` nodes (each node watches every scheduler, as the agent does): one HTTP/2 connection carries many streams, where a channel per node would cost a
connection, its threads and buffers each.

The process writes ``--ready-file`` (the node count) once every node is registered, and
``--stats-file`` (JSON: per plan version, the newest 300, the wall-clock times at which nodes,
by name, received it and acked it; the scheduler sends a node the plans that change its part
only; a node that gets two plans while applying one applies and acks only
the newer, as the agent does) every second and at exit. SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.runtime.structured_logging import TextFormatter
from silod.rpc.channels import open_channel
from silod.v1 import allocation_pb2, allocation_pb2_grpc, common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2
from worker_agent import node_protocol
from worker_agent.tasks import Task, task_key

_log = logging.getLogger("silod.fleet")
_WORKER = allocation_pb2.PLAN_COMPONENT_WORKER_AGENT
SAMPLES_PER_S_PER_GPU = 100.0  # emulated throughput of one rank
KEPT_PLANS = 300  # plan versions whose receive and ack times the stats keep


@dataclass
class FleetSettings:
    nodes: int
    gpus: int = 8
    metadata_address: str = ""
    scheduler_address: str = ""  # several: a,b (the watch moves to the next one after a break)
    prefix: str = "fleet-"
    gpu_type: str = ""
    heartbeat_s: float = 5.0
    report_s: float = 2.0
    watch_heartbeat_s: float = 0.0  # the agent's settings of the same names (services/runtime/node_settings.py)
    watch_timeout_s: float = 0.0
    task_seconds: float = 0.0  # 0: ranks run until the plan takes them away
    # Each job's ranks run task_seconds x (1 +- task_spread), the factor drawn from the job id (all
    # its ranks alike): jobs placed in one round do not all end in one later round.
    task_spread: float = 0.0
    streams_per_channel: int = 1000
    register_batch: int = 100  # nodes registering at a time while the fleet starts
    token: str = ""


@dataclass
class PlanTimes:
    """When nodes received and acked one plan version (time.time())."""
    received: dict[str, float] = field(default_factory=dict)  # node -> when its stream delivered it
    acked: dict[str, float] = field(default_factory=dict)  # node -> when its Ack was answered


class FleetNode:
    def __init__(self, fleet: Fleet, index: int) -> None:
        self.fleet = fleet
        s = fleet.settings
        self.index = index
        self.name = f"{s.prefix}{index}"
        self.spec = common_pb2.NodeSpec(name=self.name, gpus=s.gpus, pool=common_pb2.NODE_POOL_TRAINING,
                                        gpu_model="emulated", gpu_type=s.gpu_type, agent_address="127.0.0.1:1")
        self.alloc = fleet.alloc_stub(index)
        self.schedulers = node_protocol.Schedulers(fleet.schedulers, self._use_scheduler)
        self.tasks: dict[str, Task] = {}  # live tasks and exited ones not yet acknowledged
        self.launched: dict[str, float] = {}  # task key -> monotonic launch time
        self.finished: set[str] = set()  # never relaunched for the same generation
        self.applied_version = 0
        self.plan_epoch = 0
        self.registered = asyncio.Event()
        self._wake = asyncio.Event()
        self._report_now = asyncio.Event()
        self._pending: plan_pb2.NodePlan | None = None
        self._plan_ready = asyncio.Event()

    async def run(self) -> None:
        hb = asyncio.ensure_future(node_protocol.register_and_heartbeat(
            self.fleet.metadata, self.spec, interval_s=self.fleet.settings.heartbeat_s, wake=self._wake,
            registered=self.registered, request=self._heartbeat, log=_log))
        try:
            await self.registered.wait()
            s = self.fleet.settings
            await asyncio.gather(
                node_protocol.follow_plans(
                    self.name, _WORKER, stubs=[self.fleet.alloc_stub(self.index, i) for i in range(len(self.fleet.schedulers))],
                    known_version=lambda: self.applied_version,
                    offer=self.offer, on_error=lambda what, detail: _log.info(what, extra={"detail": detail}),
                    schedulers=self.schedulers,
                    timing=node_protocol.WatchTiming(s.watch_heartbeat_s, s.watch_timeout_s, s.heartbeat_s)),
                self._apply_loop(), self._report_loop())
        except node_protocol.WatchRefused as exc:
            self.fleet.refused = (f"--heartbeat-s ({self.fleet.settings.heartbeat_s:g}): refused by the scheduler at "
                                  f"{exc.address}: {exc}")
        finally:
            hb.cancel()

    async def _heartbeat(self) -> metadata_pb2.HeartbeatRequest:
        return metadata_pb2.HeartbeatRequest(node=self.name, applied_plan_version=self.applied_version)

    def _use_scheduler(self, scheduler: int) -> None:
        self.alloc = self.fleet.alloc_stub(self.index, scheduler)

    def offer(self, plan: plan_pb2.NodePlan) -> None:
        self.fleet.times(plan.version).received[self.name] = time.time()
        reason = node_protocol.epoch_refusal(plan, self.plan_epoch)
        if reason:
            asyncio.ensure_future(self._ack(plan.version, False, reason, []))
            return
        self.plan_epoch = plan.epoch
        newest = max(self.applied_version, self._pending.version if self._pending is not None else 0)
        if plan.version > newest:
            self._pending = plan
            self._plan_ready.set()

    async def _apply_loop(self) -> None:
        while True:
            await self._plan_ready.wait()
            self._plan_ready.clear()
            plan, self._pending = self._pending, None
            if plan is None or plan.version <= self.applied_version:
                continue
            released = self.apply(plan)
            self.applied_version = plan.version
            self._report_now.set()
            await self._ack(plan.version, True, "", released)

    async def _ack(self, version: int, ok: bool, message: str, released: list[str]) -> None:
        try:
            await self.alloc.Ack(allocation_pb2.AckPlanRequest(
                node=self.name, component=_WORKER, version=version, ok=ok, message=message,
                released_jobs=sorted(set(released))), timeout=30)
        except Exception as exc:  # noqa: BLE001 - logged; the next plan or heartbeat catches up
            _log.warning("ack failed", extra={"node": self.name, "version": version, "error": str(exc)})
            return
        if ok:
            self.fleet.times(version).acked[self.name] = time.time()

    def apply(self, plan: plan_pb2.NodePlan) -> list[str]:
        """The agent's diff, emulated: tasks no longer desired (or on other GPUs) checkpoint and
        exit at once; new ones start RUNNING. Returns the jobs whose GPUs were released."""
        desired = {task_key(a.job_id, a.rank, a.generation): a for a in plan.tasks}
        released = []
        for key, task in list(self.tasks.items()):
            want = desired.get(key)
            if not task.exited.is_set() and (want is None or sorted(want.gpu_indices) != sorted(task.gpus)):
                self._exit(task, 0)
                released.append(task.job_id)
        for key, a in desired.items():
            if key in self.finished or (key in self.tasks and not self.tasks[key].exited.is_set()):
                continue
            self.tasks[key] = Task(assignment=a, log_path=Path(os.devnull), phase=allocation_pb2.TASK_PHASE_RUNNING,
                                   launch_key=key, step_time_s=0.1)
            self.launched[key] = time.monotonic()
        return released

    def _exit(self, task: Task, code: int) -> None:
        task.phase, task.exit_code = allocation_pb2.TASK_PHASE_EXITED, code
        task.exited.set()
        self.finished.add(task.key)
        self.launched.pop(task.key, None)

    def _progress(self) -> None:
        now = time.monotonic()
        limit = self.fleet.settings.task_seconds
        for key, started in list(self.launched.items()):
            task = self.tasks[key]
            ran = now - started
            if task.rank == 0:
                rate = SAMPLES_PER_S_PER_GPU * max(1, task.assignment.world_size)
                task.progress = common_pb2.JobProgress(samples_done=int(rate * ran), steps_done=int(ran / 0.1),
                                                       throughput_samples_per_s=rate)
            if limit > 0 and ran >= limit * _spread(task.job_id, self.fleet.settings.task_spread):
                self._exit(task, 0)

    async def _report_loop(self) -> None:
        # Every report_s, also with no task: as the agent's, an empty report is what proves free
        # the GPUs of tasks that exited (and were forgotten) before a plan took their jobs away,
        # and what a newly elected scheduler learns a node's state from.
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._report_now.wait(), self.fleet.settings.report_s)
            self._report_now.clear()
            self._progress()
            try:
                acknowledged = await node_protocol.report_tasks(
                    self.alloc, self.name, self.applied_version, [t.report() for t in self.tasks.values()], timeout=30)
            except Exception as exc:  # noqa: BLE001 - repeated at the next report
                _log.info("report failed", extra={"node": self.name, "error": str(exc)})
                continue
            for key in acknowledged:
                if key in self.tasks and self.tasks[key].exited.is_set():
                    del self.tasks[key]


def _spread(job_id: str, spread: float) -> float:
    """1 +- ``spread``, the same for every rank of ``job_id`` (on any node, in any run)."""
    if spread <= 0:
        return 1.0
    return 1.0 + spread * (2.0 * (zlib.crc32(job_id.encode()) / 2**32) - 1.0)


class Fleet:
    def __init__(self, settings: FleetSettings) -> None:
        self.settings = settings
        self.schedulers = [a.strip() for a in settings.scheduler_address.split(",") if a.strip()]
        self._meta_channel = open_channel(settings.metadata_address, token=settings.token, aio=True,
                                          default_timeout_s=30)
        self.metadata = metadata_pb2_grpc.MetadataServiceStub(self._meta_channel)
        self._channels: dict[tuple[int, int], Any] = {}
        self.plan_times: dict[int, PlanTimes] = {}
        self.nodes: list[FleetNode] = []
        self.refused = ""  # a setting the scheduler refused: the fleet stops and exits 2 naming it

    def alloc_stub(self, index: int, scheduler: int = 0) -> allocation_pb2_grpc.AllocationServiceStub:
        """The AllocationService stub of node ``index``: nodes share a channel per
        ``streams_per_channel`` (one connection, many streams)."""
        key = (scheduler % len(self.schedulers), index // max(1, self.settings.streams_per_channel))
        if key not in self._channels:
            # A connection of its own per group (grpc would otherwise share one per address).
            self._channels[key] = open_channel(self.schedulers[key[0]], token=self.settings.token, aio=True,
                                               default_timeout_s=30, own_connection=True)
        return allocation_pb2_grpc.AllocationServiceStub(self._channels[key])

    def times(self, version: int) -> PlanTimes:
        if version not in self.plan_times and len(self.plan_times) >= KEPT_PLANS:
            del self.plan_times[min(self.plan_times)]  # a long-running fleet keeps the newest only
        return self.plan_times.setdefault(version, PlanTimes())

    async def start(self) -> list[asyncio.Task[None]]:
        """Start every node, ``register_batch`` at a time; returns once all are registered."""
        runs = []
        for first in range(0, self.settings.nodes, self.settings.register_batch):
            batch = [FleetNode(self, i) for i in range(first, min(first + self.settings.register_batch,
                                                                  self.settings.nodes))]
            self.nodes.extend(batch)
            runs.extend(asyncio.ensure_future(n.run()) for n in batch)
            await asyncio.gather(*(n.registered.wait() for n in batch))
        return runs

    def stats(self) -> dict[str, Any]:
        return {"nodes": len(self.nodes), "registered": sum(n.registered.is_set() for n in self.nodes),
                "applied": {n.name: n.applied_version for n in self.nodes},
                "running_tasks": sum(1 for n in self.nodes for t in n.tasks.values() if not t.exited.is_set()),
                "plans": {str(v): {"received": t.received, "acked": t.acked} for v, t in self.plan_times.items()}}

    async def close(self) -> None:
        await self._meta_channel.close()
        for channel in self._channels.values():
            await channel.close()


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


async def serve(settings: FleetSettings, ready_file: str = "", stats_file: str = "") -> str:
    """Run the fleet until SIGTERM or SIGINT; "" or the setting the scheduler refused."""
    fleet = Fleet(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(fleet.start())
    await asyncio.wait([starting, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    runs = starting.result() if starting.done() else []
    if ready_file and not stop.is_set():
        _write(ready_file, f"{len(fleet.nodes)}\n")
    while not stop.is_set() and not fleet.refused:
        if stats_file:
            _write(stats_file, json.dumps(fleet.stats()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    starting.cancel()
    for run in runs:
        run.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    if stats_file:
        _write(stats_file, json.dumps(fleet.stats()))
    await fleet.close()
    return fleet.refused


class FleetProcess:
    """A fleet started with :func:`start_fleet`: ``stats()`` reads its stats file."""

    def __init__(self, proc: subprocess.Popen[bytes], stats_file: Path, log_path: Path) -> None:
        self.proc, self.stats_file, self.log_path = proc, stats_file, log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self) -> dict[str, Any]:
        return json.loads(self.stats_file.read_text()) if self.stats_file.exists() else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def running(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_fleet(settings: FleetSettings, workdir: Path, timeout_s: float = 300) -> FleetProcess:
    """Run the fleet as a process of its own; returns once every node is registered."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready, stats, log_path = workdir / "fleet.ready", workdir / "fleet-stats.json", workdir / "fleet.log"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "worker_agent.fleet", "--ready-file", str(ready), "--stats-file", str(stats),
            *_flags(settings)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "SILOD_AUTH_TOKEN": settings.token} if settings.token else None)
    fleet = FleetProcess(proc, stats, log_path)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            fleet.terminate()
            raise RuntimeError(f"the node fleet did not start (exit {proc.returncode}); log:\n{fleet.log()[-3000:]}")
        time.sleep(0.1)
    return fleet


def _flags(s: FleetSettings) -> list[str]:
    return ["--nodes", str(s.nodes), "--gpus", str(s.gpus), "--metadata-address", s.metadata_address,
            "--scheduler-address", s.scheduler_address, "--prefix", s.prefix, "--gpu-type", s.gpu_type,
            "--heartbeat-s", f"{s.heartbeat_s:g}", "--report-s", f"{s.report_s:g}",
            "--task-seconds", f"{s.task_seconds:g}", "--task-spread", f"{s.task_spread:g}", "--streams-per-channel", str(s.streams_per_channel),
            "--watch-heartbeat-s", f"{s.watch_heartbeat_s:g}", "--watch-timeout-s", f"{s.watch_timeout_s:g}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker_agent.fleet", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, required=True, help="emulated nodes (>= 1)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--metadata-address", required=True)
    p.add_argument("--scheduler-address", required=True, help="HOST:PORT[,HOST:PORT...]")
    p.add_argument("--prefix", default="fleet-", help="node names are PREFIX0, PREFIX1, ... (default fleet-)")
    p.add_argument("--gpu-type", default="")
    p.add_argument("--heartbeat-s", type=float, default=5.0, help="seconds between a node's heartbeats (default 5)")
    p.add_argument("--report-s", type=float, default=2.0, help="seconds between a node's task reports (default 2)")
    p.add_argument("--task-seconds", type=float, default=0.0,
                   help="a rank exits 0 this long after it starts, so its job succeeds (default 0: never)")
    p.add_argument("--task-spread", type=float, default=0.0,
                   help="each job's ranks run --task-seconds x (1 +- this), by job id (0 <= it < 1; default 0)")
    p.add_argument("--streams-per-channel", type=int, default=1000, help="nodes sharing one scheduler connection")
    p.add_argument("--watch-heartbeat-s", type=float, default=0.0,
                   help="heartbeats asked of the leader on each plan watch (default 0: none; the agent's "
                        "watch_heartbeat_s)")
    p.add_argument("--watch-timeout-s", type=float, default=0.0,
                   help="a plan watch whose heartbeats stop for this long is opened again (default 0: never; at "
                        "least 3x --watch-heartbeat-s; the agent's watch_timeout_s)")
    p.add_argument("--ready-file", default="", help="written once every node is registered")
    p.add_argument("--stats-file", default="", help="JSON stats, rewritten every second and at exit")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    problems = [f"--{name.replace('_', '-')}: must be > 0" for name in ("nodes", "gpus", "heartbeat_s", "report_s",
                                                                         "streams_per_channel")
                if getattr(args, name) <= 0]
    if args.task_seconds < 0:
        problems.append("--task-seconds: must be >= 0")
    if not 0 <= args.task_spread < 1:
        problems.append("--task-spread: must be >= 0 and < 1")
    if args.watch_heartbeat_s < 0 or args.watch_timeout_s < 0:
        problems.append("--watch-heartbeat-s, --watch-timeout-s: must be >= 0")
    elif args.watch_timeout_s > 0 and not args.watch_timeout_s >= 3 * args.watch_heartbeat_s > 0:
        problems.append(f"--watch-timeout-s ({args.watch_timeout_s:g}) must be at least 3x --watch-heartbeat-s "
                        f"({args.watch_heartbeat_s:g}), which must be set")
    if problems:
        p.error("; ".join(problems))
    # The silod text format: it prints each line's fields (the error of a failed ack), which a
    # plain format drops.
    handler = logging.StreamHandler()
    handler.setFormatter(TextFormatter())
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    settings = FleetSettings(
        nodes=args.nodes, gpus=args.gpus, metadata_address=args.metadata_address,
        scheduler_address=args.scheduler_address, prefix=args.prefix, gpu_type=args.gpu_type,
        heartbeat_s=args.heartbeat_s, report_s=args.report_s, task_seconds=args.task_seconds,
        task_spread=args.task_spread, streams_per_channel=args.streams_per_channel, token=os.environ.get("SILOD_AUTH_TOKEN", ""),
        watch_heartbeat_s=args.watch_heartbeat_s, watch_timeout_s=args.watch_timeout_s)
    refused = asyncio.run(serve(settings, args.ready_file, args.stats_file))
    if refused:
        print(f"{p.prog}: configuration error: {refused}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
