"""What a policy object's last call worked out, kept for the next call: the base of fifo's queue
(:mod:`scheduler.policies.fifo_queue`) and sjf's and tiresias' ranked jobs
(:mod:`scheduler.policies.ranked_queue`).

A memo keeps the policy a pure function of the snapshot: it is used only where it gives the
plan of a whole pass, it is kept only for the nodes it was built on (by identity), and a copy of
the policy (pickled to a simulation worker, deep-copied) starts without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from scheduler.placement import FreeGpus, gpu_allocation
from scheduler.policy import Allocation, ClusterSnapshot

S = TypeVar("S")


class PolicyMemo(Generic[S]):
    """The memo of one policy object (one round at a time: a lock guards it anyway). ``S``: what
    is kept, with a ``nodes`` attribute naming the snapshot's node tuple it was built for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: S | None = None
        self._last_nodes: tuple | None = None  # node tuple of the last call, kept only by identity
        self.last_call = "whole"  # "queue" or "whole": how the last call was answered (tests, benchmarks)
        self.why_whole = "no queue yet"  # why the last whole pass was needed
        self.last_looked = 0  # jobs the last call from the memo looked at (tests, benchmarks)

    def __getstate__(self) -> dict:
        return {}  # a copy (a policy sent to a worker process) starts afresh: it is only a memo

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    def forget(self) -> None:
        """Drop what is kept: the next calls are whole passes (benchmarks time those)."""
        with self._lock:
            self._state = None
            self._last_nodes = None

    def _kept_for(self, snapshot: ClusterSnapshot) -> S | None:
        """What is kept, if it was built on ``snapshot``'s nodes (call with the lock held)."""
        state = self._state
        if state is None or state.nodes is not snapshot.nodes:  # type: ignore[attr-defined]
            self.why_whole = "no queue for these nodes"
            return None
        return state

    def _keep_after_whole_pass(self, snapshot: ClusterSnapshot, build: Callable[[], S | None]) -> None:
        """After a whole pass over ``snapshot``: keep what ``build`` makes of it, but only for a
        cluster seen twice in a row (a policy run on a tenant's slice of the nodes,
        scheduler.quotas, sees a new node tuple every call)."""
        self.last_call = "whole"
        self._state = build() if self._last_nodes is snapshot.nodes else None
        self._last_nodes = snapshot.nodes

    def _whole_because(self, why: str) -> None:
        self.why_whole = why
        return None


def memo_of(policy: object) -> PolicyMemo | None:
    """The memo a policy object keeps (fifo's queue, sjf's and tiresias' ranked jobs), or None."""
    return next((kept for kept in getattr(policy, "__dict__", {}).values() if isinstance(kept, PolicyMemo)), None)


def keep_running(held: Allocation, free: FreeGpus, gpu_type: str) -> Allocation | None:
    """A running job's GPUs taken from ``free`` and its allocation as a whole pass's placement
    states it (the current one itself where they are equal); None, having taken what it could
    before, where one of its GPUs is not free or not of ``gpu_type`` (the memo is then dropped)."""
    for node, indices in held.placement:
        if free.type_of(node) != gpu_type or free.take(node, indices) is None:
            return None
    placement = tuple(sorted((node, tuple(sorted(indices))) for node, indices in held.placement))
    return gpu_allocation(held, placement, 0, gpu_type)
