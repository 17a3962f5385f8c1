"""What the agent answers the SDK inside its ranks (WorkerAgentService): progress reports and
directives (continue, re-form in place, checkpoint and exit, exit).

A survivor of a fast resize also answers to its old identities until its SDK has re-formed
(:mod:`worker_agent.plans`): a call under an old identity gets the REFORM directive.
"""

from __future__ import annotations

import time

from services.runtime import errors
from silod.v1 import allocation_pb2, worker_agent_pb2
from worker_agent import launch_env, task_metrics
from worker_agent.ranks import Ranks
from worker_agent.tasks import Task


class RankCalls:
    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def find(self, job_id: str, rank: int, generation: int) -> Task:
        node = self.ranks.node
        if not job_id:
            raise errors.InvalidArgument("must not be empty", field="job_id")
        same_job = [t for t in self.ranks.tasks.values() if t.job_id == job_id]
        if not same_job:
            raise errors.NotFound(f"no task of job {job_id!r} on node {node}", field="job_id")
        for t in same_job:  # a survivor of a fast resize also answers to its old identities
            if (t.rank, t.generation) == (rank, generation) or (rank, generation) in t.aliases:
                return t
        same_rank = [t for t in same_job if t.rank == rank]
        if not same_rank:
            raise errors.NotFound(f"job {job_id!r} has no rank {rank} on node {node}", field="rank")
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
                task_metrics.reformed(self.ranks.node, time.monotonic() - task.reform_since)
                task.reform_since = 0.0
            task.phase = allocation_pb2.TASK_PHASE_RUNNING
            self.ranks.changed()

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
                new_generation=a.generation, master_addr=launch_env.master_addr(a, self.ranks.agent_address),
                master_port=a.master_port, new_batch_size=a.batch_size or a.spec.batch_size,
                new_local_rank=a.local_rank, new_local_world_size=max(a.local_world_size, 1),
                new_group_rank=a.group_rank,
            )
        self._heard_from(task, request.rank, request.generation)
        return worker_agent_pb2.Directive(action=worker_agent_pb2.DIRECTIVE_ACTION_CONTINUE)
