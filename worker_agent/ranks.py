"""The node's task table: launching ranks through the runtime, stopping them, reaping them.

* GPUs: :class:`GpuTable` refuses to give a device to a task while another local task holds it.
  A task holds its GPUs from launch until its process has exited.
* Stopping a task: its directive becomes CHECKPOINT_AND_EXIT (GetDirective reports the seconds
  left), SIGTERM goes to the rank at once (the SDK's handler turns it into
  ``should_checkpoint()``), and SIGKILL follows when the deadline passes.
* A task that exited stays in the table until the scheduler acknowledges its exit; its key is
  kept in ``finished`` so that the same generation is never launched again.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.runtime.structured_logging import get_logger
from silod.v1 import allocation_pb2, plan_pb2
from worker_agent import launch_env, task_metrics
from worker_agent.cache_paths import CachePaths
from worker_agent.credentials import JobCredentialError, JobCredentials
from worker_agent.gpus import GpuTable
from worker_agent.runtimes.base import LaunchError, RankLaunch, Runtime
from worker_agent.tasks import Task, task_key

_log = get_logger("silod.worker_agent")


class Ranks:
    def __init__(self, node: str, settings: Any, agent_address: str, runtime: Runtime, gpu_table: GpuTable,
                 credentials: JobCredentials, work_dir: Path, checkpoint_root: Path,
                 changed: Callable[[], None], cache_paths: CachePaths) -> None:
        self.node = node
        self.settings = settings
        self.agent_address = agent_address
        self.runtime = runtime
        self.gpu_table = gpu_table
        self.credentials = credentials
        self.work_dir = work_dir
        self.checkpoint_root = checkpoint_root
        self.changed = changed  # something a report would show changed: report now
        self.cache_paths = cache_paths
        self.tasks: dict[str, Task] = {}  # live tasks and exited ones not yet acknowledged
        self.finished: set[str] = set()  # keys of tasks that exited; never relaunched for the same generation
        self._reapers: set[asyncio.Task[None]] = set()  # one per process; never cancelled before it exits

    def live(self) -> list[Task]:
        return [t for t in self.tasks.values() if not t.exited.is_set()]

    # ---- launching -------------------------------------------------------------------------
    async def launch(self, a: plan_pb2.TaskAssignment) -> None:
        key = task_key(a.job_id, a.rank, a.generation)
        self.gpu_table.acquire(key, list(a.gpu_indices))  # raises GpuConflict: never double-book
        log_dir = self.work_dir / "jobs" / a.job_id
        log_dir.mkdir(parents=True, exist_ok=True)
        checkpoint_dir = self.checkpoint_root / a.job_id
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        task = Task(assignment=a, log_path=log_dir / f"rank-{a.rank}.log", batch_size=a.batch_size, launch_key=key)
        self.tasks[key] = task
        command = list(a.spec.command) or [self.runtime.python or sys.executable, "-m", "silod.jobs.emulated"]
        with open(task.log_path, "ab") as log:
            log.write(f"--- silod: generation {a.generation} rank {a.rank} gpus {list(a.gpu_indices)}\n".encode())
        try:
            token = await self.credentials.token(a.job_id, (t.job_id for t in self.tasks.values() if t is not task))
            base = None if self.runtime.inherits_agent_env else launch_env.minimal_base(
                getattr(self.settings, "rank_env_passthrough", ""), host_keys=not self.runtime.image_env)
            env = launch_env.rank_env(self.settings, self.agent_address, a, checkpoint_dir, token, base,
                                      agent_visible=self.runtime.sees_agent_process)
            task.process = await self.runtime.start(RankLaunch(
                key=key, job_id=a.job_id, command=command, env=env, work_dir=log_dir, log_path=task.log_path,
                checkpoint_dir=checkpoint_dir, gpus=list(a.gpu_indices), resize_in_place=a.spec.resize_in_place,
                image=a.spec.image, cpus=a.spec.cpus_per_rank, memory_bytes=a.spec.memory_bytes_per_rank,
                read_paths=await self.cache_paths.get() if self.runtime.own_root else []))
        except (LaunchError, JobCredentialError) as exc:
            why = str(exc) if isinstance(exc, LaunchError) else f"cannot launch {command!r}: {exc}"
            with open(task.log_path, "ab") as log:
                log.write(f"--- silod: {why}\n".encode())
            task_metrics.launch_failed(self.node)
            self.mark_exited(task, task_metrics.LAUNCH_FAILED_EXIT_CODE, why)
            return
        # Its process runs: RUNNING whether or not its command ever calls the agent through the SDK.
        task.phase = allocation_pb2.TASK_PHASE_RUNNING
        _log.info("task launched", extra={"task": key, "pid": task.process.pid, "gpus": list(a.gpu_indices),
                                          "warm": task.process.warm})
        task_metrics.launched(self.node, warm=task.process.warm)
        self.changed()
        self._reapers.add(asyncio.ensure_future(self._reap(task)))

    async def _reap(self, task: Task) -> None:
        assert task.process is not None
        try:
            ended = await task.process.wait()
            self.mark_exited(task, ended.code, ended.reason)
        finally:
            self._reapers.discard(asyncio.current_task())  # type: ignore[arg-type]

    def mark_exited(self, task: Task, code: int, reason: str = "") -> None:
        task.exit_code = code
        task.exit_reason = reason
        task.phase = allocation_pb2.TASK_PHASE_EXITED
        self.runtime.forget(task.launch_key)
        self.gpu_table.release(task.launch_key)
        self.finished.add(task.key)
        task.exited.set()
        _log.info("task exited", extra={"task": task.key, "exit_code": code, "reason": reason})
        asked = task.stop_asked_at > 0 and not task.stopped_by_shutdown
        cause = task_metrics.exit_cause(code, asked_to_stop=asked, leaving=task.leave,
                                        killed_at_deadline=task.killed_at_deadline,
                                        agent_shutdown=task.stopped_by_shutdown)
        checkpoint_s = time.monotonic() - task.stop_asked_at if asked and not task.leave else None
        task_metrics.exited(self.node, cause, checkpoint_s)
        self.changed()

    # ---- stopping --------------------------------------------------------------------------
    async def stop(self, task: Task, deadline_s: float) -> None:
        if task.exited.is_set():
            return
        if task.stop_deadline == 0.0:
            task.stop_asked_at = time.monotonic()
            task.stop_deadline = task.stop_asked_at + deadline_s
            task.phase = allocation_pb2.TASK_PHASE_CHECKPOINTING
            self.changed()
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
        if task.process is not None and not task.exited.is_set():
            task.process.signal(sig)

    async def stop_all(self, grace_s: float) -> None:
        """The agent is shutting down: stop every live task (it is not reported EXITED: exit 0
        after a checkpoint would read as the job's completion)."""
        live = self.live()
        for t in live:
            t.stopped_by_shutdown = True
        await asyncio.gather(*(self.stop(t, grace_s) for t in live))

    # ---- reports ---------------------------------------------------------------------------
    def reports(self) -> list[allocation_pb2.TaskReport]:
        # A task the agent stopped because it is shutting down exits 0 after its checkpoint, which
        # the scheduler would read as "finished": it is left out, so the scheduler's last view of
        # it is RUNNING/CHECKPOINTING and the node's lost heartbeats decide what happens to the job.
        return [t.report() for t in self.tasks.values() if not t.stopped_by_shutdown]

    def acknowledged(self, keys: list[str]) -> None:
        """The scheduler has these exits: forget the tasks."""
        for key in keys:
            t = self.tasks.get(key)
            if t is not None and t.exited.is_set():
                del self.tasks[key]
