"""What a data-parallel trainer needs of its job: the world it runs in, and the context's calls.

Both halves of the job SDK meet here. ``silod.job.context`` (the cluster context and its
off-cluster twin) implements :class:`ElasticContext`; ``silod.job.distributed`` (the trainer)
uses it. Neither imports the other's module for its types, so the dependency runs one way:
context -> distributed -> world, and context -> world.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class World:
    """The job's world as a surviving rank sees it after a fast resize (AFE)."""

    rank: int  # this process's rank now (survivors normally keep theirs; renumbered if the world shrank below it)
    world_size: int  # ranks in the job now
    generation: int  # generation this process now runs under
    master_addr: str  # rendezvous host of the re-formed group
    master_port: int  # rendezvous TCP port of the re-formed group
    batch_size: int  # samples per step, global, from now on
    previous_rank: int
    previous_world_size: int
    local_rank: int = 0  # position among the job's ranks on this node now
    local_world_size: int = 1  # the job's ranks on this node now
    group_rank: int = 0  # index of this node among the job's nodes now


class ElasticContext(Protocol):
    """The calls of a job context that ``silod.job.distributed.DistributedTraining`` makes."""

    rank: int
    world_size: int
    batch_size: int  # global samples per step; 0 when the job did not say
    leaving: bool  # this rank was removed by a resize: it exits without a checkpoint
    hold_resizes: bool  # hold a REFORM (held_world()) instead of applying it at once
    checkpoint_dir: Path

    def poll_directive(self, min_interval_s: float = 0.0) -> None: ...
    def should_checkpoint(self) -> bool: ...
    def held_world(self) -> World | None: ...
    def apply_world(self, world: World) -> None: ...
    def master_addr_port(self) -> tuple[str, int]: ...
    def load_checkpoint(self) -> dict[str, Any] | None: ...
    def save_checkpoint(self, state: dict[str, Any]) -> bool: ...
    def set_progress(self, *, samples: int | None = None, steps: int | None = None,
                     epoch: int | None = None) -> None: ...
    def report(self, **fields: Any) -> None: ...
    def training_finished(self) -> bool: ...
    def mark_training_finished(self) -> None: ...
    def done(self) -> None: ...
