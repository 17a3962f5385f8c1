"""Why a rank exited, as the agent's metrics label it."""

from __future__ import annotations

import pytest

from worker_agent.task_metrics import exit_cause


@pytest.mark.parametrize(("code", "asked", "leaving", "killed", "shutdown", "cause"), [
    (0, False, False, False, False, "succeeded"),
    (75, False, False, False, False, "restart_requested"),
    (127, False, False, False, False, "launch_failed"),
    (137, False, False, False, False, "signalled"),
    (1, False, False, False, False, "failed"),
    (0, True, False, False, False, "checkpointed"),
    (1, True, False, False, False, "failed_to_checkpoint"),
    (0, True, True, False, False, "left"),
    (137, True, False, True, False, "killed_at_deadline"),
    (0, False, False, False, True, "agent_shutdown"),
])
def test_exit_causes(code: int, asked: bool, leaving: bool, killed: bool, shutdown: bool, cause: str) -> None:
    assert exit_cause(code, asked_to_stop=asked, leaving=leaving, killed_at_deadline=killed,
                      agent_shutdown=shutdown) == cause
