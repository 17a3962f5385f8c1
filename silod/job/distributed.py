"""Data-parallel training that silod can grow and shrink in place: ``ctx.distributed(...)``.

    ctx = silod.job.init()
    sampler = ElasticSampler(dataset, batch_size=ctx.batch_size, rank=ctx.rank, world_size=ctx.world_size)
    trainer = ctx.distributed(model, optimizer, sampler)   # torch.distributed + DDP, state synced
    while ...:
        for indices in DataLoader(dataset, batch_sampler=sampler, ...):
            event = trainer.step_boundary()       # every rank, before each step
            if event is not Event.CONTINUE: break  # RESIZED: iterate again; STOP: checkpoint/exit
            ... forward, backward (trainer.model is the DDP module), optimizer.step()
            trainer.step_done()                   # advances the sampler by the step's global size

How a resize happens in place. The worker agent tells a surviving rank its new world with a
REFORM directive (silod.job polls for it); ranks that leave get EXIT; newcomers are launched
with the new world. The ranks must switch at the same step, or one would wait in an all-reduce
for a rank that already left: so at every step boundary the ranks all-reduce one flag (any
rank saw a directive?). When it is set, every rank fetches its own directive (the agents of the
other nodes may apply the plan a moment later; bounded by ``reform_timeout_s``), leaving ranks
stop, and survivors destroy the process group and initialise the new one at the new rendezvous,
where the newcomers wait. Rank 0 of the new group (always a survivor) then broadcasts the
optimizer and sampler state and the progress counters; wrapping the model in a new DDP
broadcasts its parameters and buffers. No surviving process restarts.

A checkpoint-and-exit directive (the job is moved, preempted, or its agent stops) also goes
through the flag, so all ranks stop at the same step and rank 0 saves the state.

Backend: NCCL when CUDA is available (the same code), gloo on CPU.
"""

from __future__ import annotations

import enum
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from silod.job.context import JobContext, World

REFORM_TIMEOUT_S = 120.0
# How often a rank asks its agent for a directive: one loopback RPC, small next to a step, and
# the resize waits for the first rank that learns of it.
DIRECTIVE_POLL_S = 0.2


class Event(enum.Enum):
    CONTINUE = "continue"  # train the step
    RESIZED = "resized"  # the world changed: restart the data iterator (the sampler is already resized)
    STOP = "stop"  # leave: save a checkpoint unless ctx.leaving (trainer.save() does both right), then exit


class ReformFailed(RuntimeError):
    """The new process group did not form within the deadline."""


class DistributedTraining:
    def __init__(
        self,
        ctx: JobContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: Any = None,
        *,
        backend: str | None = None,
        reform_timeout_s: float = REFORM_TIMEOUT_S,
        reproducible: bool = True,
    ) -> None:
        self.ctx = ctx
        self.module = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.reform_timeout_s = reform_timeout_s
        # DDP lays gradients out in buckets in parameter order for a group's first step, then
        # re-buckets them in the order they became ready; the all-reduce adds floats in that
        # layout. A resumed (or re-formed) group would run its first step in the other layout
        # and drift from an uninterrupted run in the last bits. Without re-bucketing (which is
        # what find_unused_parameters=True implies, for one extra graph walk per step) the
        # layout never changes: a resumed run is bit-identical on CPU.
        self.reproducible = reproducible
        self.steps = 0  # optimizer steps of the whole job
        self.samples = 0  # samples the whole job trained on
        self.reforms: list[float] = []  # seconds each in-place re-form took
        self._restore()
        self._init_group(ctx.rank, ctx.world_size, ctx.master_addr_port())
        self._agree_on_state(newcomer=True)

    # -- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "steps": self.steps,
            "samples": self.samples,
        }

    def _restore(self) -> None:
        """Resume from the job's checkpoint, if any (every rank reads it; rank 0's copy wins below)."""
        state = self.ctx.load_checkpoint()
        if not state or "model" not in state:
            return
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.sampler is not None and state.get("sampler"):
            self.sampler.load_state_dict(state["sampler"])
        self.steps, self.samples = int(state["steps"]), int(state["samples"])
        self.ctx.set_progress(samples=self.samples, steps=self.steps,
                              epoch=getattr(self.sampler, "epoch", None))
        print(f"silod.job: resumed from the checkpoint at step {self.steps}, {self.samples} samples",
              file=sys.stderr, flush=True)

    def save(self) -> bool:
        """Checkpoint (rank 0 only; nothing when this rank is leaving or its agent is gone)."""
        return self.ctx.save_checkpoint(self.state_dict())

    def _sync_state(self) -> None:
        """Rank 0's optimizer, sampler and counters to every rank (DDP did the parameters)."""
        if self.ctx.world_size > 1:
            box: list[Any] = [None]
            if self.ctx.rank == 0:
                box[0] = {k: v for k, v in self.state_dict().items() if k != "model"}
            dist.broadcast_object_list(box, src=0)
            state = box[0]
        if self.ctx.world_size > 1 and self.ctx.rank != 0:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.sampler is not None and state["sampler"] is not None:
                self.sampler.load_state_dict(state["sampler"])
            self.steps, self.samples = state["steps"], state["samples"]
        if self.sampler is not None:
            self.sampler.resize(self.ctx.rank, self.ctx.world_size, self.ctx.batch_size or None)
        self.ctx.set_progress(samples=self.samples, steps=self.steps, epoch=getattr(self.sampler, "epoch", None))

    # -- the process group
    def _init_group(self, rank: int, world_size: int, rendezvous: tuple[str, int]) -> None:
        host, port = rendezvous
        dist.init_process_group(self.backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=self.reform_timeout_s))

    def _agree_on_state(self, newcomer: bool) -> None:
        """Wrap the model in DDP and give every rank rank 0's state, when some rank lacks it: a
        rank that just started (it holds the checkpoint's state at best). When only ranks that
        stayed form the group (a shrink) they already hold the same state: nothing is sent."""
        flag = torch.tensor([1 if newcomer else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        sync = bool(flag.item())
        self.model = self._wrap(sync)
        if sync:
            self._sync_state()
        elif self.sampler is not None:
            self.sampler.resize(self.ctx.rank, self.ctx.world_size, self.ctx.batch_size or None)

    def _wrap(self, sync: bool = True) -> DistributedDataParallel:
        """DDP over the current group; ``sync``: broadcast rank 0's parameters and buffers."""
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            self.module.to(device)
            return DistributedDataParallel(self.module, device_ids=[device.index], init_sync=sync,
                                           find_unused_parameters=self.reproducible)
        return DistributedDataParallel(self.module, init_sync=sync, find_unused_parameters=self.reproducible)

    # -- the training loop's calls
    def step_boundary(self) -> Event:
        """Before each step, on every rank: CONTINUE, or the world changed (RESIZED), or STOP."""
        self.ctx.poll_directive(min_interval_s=DIRECTIVE_POLL_S)
        stop = self.ctx.should_checkpoint()
        world = self.ctx.world_changed()
        flag = torch.tensor([1 if (stop or world is not None) else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return Event.CONTINUE
        deadline = time.monotonic() + self.reform_timeout_s
        while not stop and world is None:  # another rank saw its directive first: fetch ours now
            if time.monotonic() > deadline:
                raise ReformFailed(f"no directive for this rank within {self.reform_timeout_s:g}s of its peers'")
            time.sleep(0.05)
            self.ctx.poll_directive()
            stop = self.ctx.should_checkpoint()
            world = self.ctx.world_changed()
        if stop:
            return Event.STOP
        assert world is not None
        self.reform(world)
        return Event.RESIZED

    def step_done(self, samples: int | None = None) -> int:
        """Count a finished optimizer step of ``samples`` global samples (default: the sampler's
        step size); advances the sampler; returns the samples counted."""
        if samples is None:
            samples = self.sampler.step_size() if self.sampler is not None else self.ctx.batch_size
        if self.sampler is not None:
            self.sampler.advance(samples)
        self.steps += 1
        self.samples += samples
        return samples

    def reform(self, world: World) -> None:
        """Leave the old process group and form the new one at ``world``'s rendezvous, in place."""
        started = time.monotonic()
        dist.destroy_process_group()
        try:
            self._init_group(world.rank, world.world_size, (world.master_addr, world.master_port))
        except Exception as exc:  # noqa: BLE001 - reported with what it means for the job
            raise ReformFailed(f"the new process group (rank {world.rank} of {world.world_size} at "
                               f"{world.master_addr}:{world.master_port}) did not form: {exc}") from exc
        self._agree_on_state(newcomer=False)
        took = time.monotonic() - started
        self.reforms.append(took)
        print(f"silod.job: process group re-formed in place in {took:.2f}s: rank {world.rank} of {world.world_size} "
              f"(was {world.previous_rank} of {world.previous_world_size}), batch {self.ctx.batch_size}",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
