"""A task: one rank of a job on this node, from its launch until the scheduler has heard it exit."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from silod.v1 import allocation_pb2, common_pb2, plan_pb2, worker_agent_pb2
from worker_agent.runtimes.base import RankProcess

STATE_NAMES = {
    allocation_pb2.TASK_PHASE_STARTING: "starting",
    allocation_pb2.TASK_PHASE_RUNNING: "running",
    allocation_pb2.TASK_PHASE_CHECKPOINTING: "checkpointing",
    allocation_pb2.TASK_PHASE_EXITED: "exited",
}


def task_key(job_id: str, rank: int, generation: int) -> str:
    return f"{job_id}/{rank}/{generation}"


@dataclass
class Task:
    assignment: plan_pb2.TaskAssignment
    log_path: Path
    process: RankProcess | None = None
    phase: int = allocation_pb2.TASK_PHASE_STARTING
    exit_code: int = 0
    exit_reason: str = ""  # what the runtime knows beyond the exit code ("out of memory: ...")
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
    launch_key: str = ""  # key it was launched as: its GPU table holder name and run record
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
            exit_reason=self.exit_reason,
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
            pid=self.process.pid if self.process is not None and not self.exited.is_set() else 0,
            gpu_indices=self.gpus,
            generation=self.generation,
            state=STATE_NAMES.get(self.phase, "starting"),
            exit_code=self.exit_code,
        )
