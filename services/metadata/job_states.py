"""The job lifecycle of common.proto's JobState comment, as data:

  PENDING -> SCHEDULED -> RUNNING <-> RESIZING
  SCHEDULED|RUNNING|RESIZING -> PENDING           (preempted back to the queue)
  RUNNING|RESIZING -> SUCCEEDED
  any non-terminal -> FAILED | CANCELLED
"""

from __future__ import annotations

from silod.v1 import common_pb2

PENDING = common_pb2.JOB_STATE_PENDING
SCHEDULED = common_pb2.JOB_STATE_SCHEDULED
RUNNING = common_pb2.JOB_STATE_RUNNING
RESIZING = common_pb2.JOB_STATE_RESIZING
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED
FAILED = common_pb2.JOB_STATE_FAILED
CANCELLED = common_pb2.JOB_STATE_CANCELLED

TERMINAL_STATES = frozenset({SUCCEEDED, FAILED, CANCELLED})

LEGAL_MOVES: dict[int, frozenset[int]] = {
    PENDING: frozenset({SCHEDULED, FAILED, CANCELLED}),
    SCHEDULED: frozenset({RUNNING, PENDING, FAILED, CANCELLED}),
    RUNNING: frozenset({RESIZING, PENDING, SUCCEEDED, FAILED, CANCELLED}),
    RESIZING: frozenset({RUNNING, PENDING, SUCCEEDED, FAILED, CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


def is_legal_move(current: int, new: int) -> bool:
    return new in LEGAL_MOVES.get(current, frozenset())


def state_name(state: int) -> str:
    return common_pb2.JobState.Name(state) if state in common_pb2.JobState.values() else str(state)
