"""Validation of what nodes send (Ack, ReportTasks), shared by every server that takes it: the
scheduler's AllocationService, its plan feed's relay of batched reports, and the allocation
server's AllocationService. One definition, so a request refused by one is refused by all with
the same field names."""

from __future__ import annotations

from services.metadata.validation.common import check_enum, check_float, check_int
from services.metadata.validation.jobs import check_progress
from services.runtime.errors import Problems
from silod.v1 import allocation_pb2

MAX_TASK_GPUS = 1024


def task_problems(task: allocation_pb2.TaskReport, field: str, problems: Problems) -> None:
    """Every problem of one TaskReport (its job id's shape was checked by the runtime)."""
    check = problems.check
    if not task.job_id:
        problems.add(f"{field}.job_id", "required")
    check(check_int, task.rank, f"{field}.rank", minimum=0, maximum=2**31 - 1)
    check(check_int, task.generation, f"{field}.generation", minimum=0, maximum=2**63 - 1)
    check(check_enum, task.phase, allocation_pb2.TaskPhase.DESCRIPTOR, f"{field}.phase")
    for index, gpu in enumerate(task.gpu_indices):
        check(check_int, gpu, f"{field}.gpu_indices[{index}]", minimum=0, maximum=MAX_TASK_GPUS - 1)
    check(check_progress, task.progress, f"{field}.progress")
    check(check_float, task.step_time_s, f"{field}.step_time_s", minimum=0.0, maximum=1e6)
    check(check_int, task.batch_size, f"{field}.batch_size", minimum=0, maximum=2**31 - 1)
    check(check_float, task.grad_sqr, f"{field}.grad_sqr", minimum=0.0, maximum=1e100)
    check(check_float, task.grad_var, f"{field}.grad_var", minimum=0.0, maximum=1e100)


def check_report_tasks(request: allocation_pb2.ReportTasksRequest) -> None:
    """Raise InvalidArgument naming every bad field of a ReportTasks request."""
    problems = Problems()
    if not request.node:
        problems.add("node", "required")
    for i, task in enumerate(request.tasks):
        task_problems(task, f"tasks[{i}]", problems)
    problems.raise_if_any()


def check_ack(request: allocation_pb2.AckPlanRequest) -> None:
    """Raise InvalidArgument naming every bad field of an Ack request."""
    problems = Problems()
    if not request.node:
        problems.add("node", "required")
    if request.version < 0:
        problems.add("version", "must be >= 0")
    problems.raise_if_any()


def counts_as_node_ack(request: allocation_pb2.AckPlanRequest) -> bool:
    """Whether an ack says the node's worker agent runs the plan's version (what the store
    records as the node's acked version): a cache server's ack, a failed one or version 0 does not."""
    return (request.component in (allocation_pb2.PLAN_COMPONENT_WORKER_AGENT,
                                  allocation_pb2.PLAN_COMPONENT_UNSPECIFIED)
            and request.ok and request.version > 0)
