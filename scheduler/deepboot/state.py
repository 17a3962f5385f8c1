"""Inference replicas as the scheduler sees them: plain values, no clock.

A replica is one inference process of one application on one GPU of the inference pool.
Its life (:class:`scheduler.deepboot.replicas.Replica`, run by the simulator and the live scheduler):

- ``RUNNING`` — serving a task; the GPU is busy.
- ``PROTECT`` — finished, kept warm for a protect time so the next task of its application
  starts without a cold start; the GPU is *not* lendable (DeepBoot keeps protected replicas
  for reuse).
- ``SLEEP`` — still warm, but its GPU is lendable: ATS-T may hand it to training (the replica
  then ends), ATS-I may reuse it for its application, or end it to cold-start another one.
- ``END`` — gone; it holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ReplicaState(str, Enum):
    RUNNING = "running"
    PROTECT = "protect"
    SLEEP = "sleep"
    END = "end"

    @property
    def holds_gpu(self) -> bool:
        """RUNNING and PROTECT keep their GPU from training; SLEEP lends it, END has none."""
        return self in (ReplicaState.RUNNING, ReplicaState.PROTECT)

    @property
    def warm(self) -> bool:
        """A task of the replica's application can reuse it without a cold start."""
        return self in (ReplicaState.PROTECT, ReplicaState.SLEEP)


@dataclass(frozen=True)
class ReplicaView:
    """One live replica at one instant."""

    replica_id: str
    application: str            # inference application, ``infer-<model>-<k>``
    node: str                   # inference-pool node
    gpu: int                    # GPU index on that node
    state: ReplicaState
    since_s: float = 0.0        # when it entered ``state`` (the oldest sleeper is ended first)


def busy_gpus(replicas) -> dict[str, tuple[int, ...]]:
    """``ClusterSnapshot.inference_busy`` for ``replicas``: node -> sorted GPUs held by RUNNING/PROTECT ones."""
    busy: dict[str, set[int]] = {}
    for replica in replicas:
        if replica.state.holds_gpu:
            busy.setdefault(replica.node, set()).add(replica.gpu)
    return {node: tuple(sorted(gpus)) for node, gpus in sorted(busy.items())}
