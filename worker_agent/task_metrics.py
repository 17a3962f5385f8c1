"""What the agent's ranks and plans did, as Prometheus figures (worker_agent.metrics).

The agent calls these at the points where things happen; the exit cause is a pure function of
what the agent knows about the exit, so it is tested without processes.
"""

from __future__ import annotations

from collections.abc import Callable

from worker_agent import metrics

RESTART_EXIT_CODE = 75  # silod.job: a rank that gave up re-forming in place asks for a restart
LAUNCH_FAILED_EXIT_CODE = 127  # the agent's code for a command that could not be started


def exit_cause(code: int, *, asked_to_stop: bool, leaving: bool, killed_at_deadline: bool,
               agent_shutdown: bool = False) -> str:
    """One word for why a rank exited; the label values of silod_agent_rank_exits_total."""
    if agent_shutdown:
        return "agent_shutdown"  # the agent stopped it on its way down (checkpointed if it could)
    if killed_at_deadline:
        return "killed_at_deadline"  # missed its checkpoint deadline: SIGKILL
    if asked_to_stop:
        if leaving:
            return "left"  # removed by an in-place shrink
        return "checkpointed" if code == 0 else "failed_to_checkpoint"
    if code == 0:
        return "succeeded"
    if code == RESTART_EXIT_CODE:
        return "restart_requested"
    if code == LAUNCH_FAILED_EXIT_CODE:
        return "launch_failed"
    if code > 128:
        return "signalled"  # killed from outside (OOM killer, an operator)
    return "failed"


def launched(node: str, *, warm: bool) -> None:
    metrics.LAUNCHES.labels(node, "warm" if warm else "cold").inc()


def launch_failed(node: str) -> None:
    metrics.LAUNCHES.labels(node, "failed").inc()


def exited(node: str, cause: str, checkpoint_s: float | None) -> None:
    metrics.EXITS.labels(node, cause).inc()
    if checkpoint_s is not None:
        metrics.CHECKPOINT.labels(node).observe(checkpoint_s)


def plan_applied(node: str, version: int, seconds: float) -> None:
    metrics.PLAN_VERSION.labels(node).set(version)
    metrics.PLAN_APPLY.labels(node).observe(seconds)


def track_ranks(node: str, count: Callable[[], int]) -> None:
    """silod_agent_ranks_running reads ``count()`` at each scrape."""
    metrics.RANKS_RUNNING.labels(node).set_function(count)


def reformed(node: str, seconds: float) -> None:
    metrics.REFORM.labels(node).observe(seconds)
