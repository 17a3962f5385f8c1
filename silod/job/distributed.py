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
import os
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:  # silod.job.context builds this module's trainer: no import back at run time
    from silod.job.context import JobContext, World

REFORM_TIMEOUT_S = 120.0
# Exit status of a rank that gives up re-forming in place: the scheduler restarts every rank of
# the job from the checkpoint instead (EX_TEMPFAIL; 137, a rank killed by SIGKILL, does the same).
RESTART_EXIT_CODE = 75
# How often a rank asks its agent for a directive: one loopback RPC, small next to a step, and
# the resize waits for the first rank that learns of it.
DIRECTIVE_POLL_S = 0.2


class Event(enum.Enum):
    CONTINUE = "continue"  # train the step
    RESIZED = "resized"  # the world changed: restart the data iterator (the sampler is already resized)
    STOP = "stop"  # leave: save a checkpoint unless ctx.leaving (trainer.save() does both right), then exit


class ReformFailed(RuntimeError):
    """The new process group did not form within the deadline."""


class GradientNoise:
    """Pollux's gradient statistics, measured in the all-reduce DDP does anyway.

    Each rank's gradient (before the all-reduce) is the mean over its ``b = B / W`` samples, the
    averaged one over the step's ``B``. With ``|g_b|^2`` the ranks' mean squared norm and
    ``|g_B|^2`` the averaged gradient's, the unbiased estimates of McCandlish et al. (2018), as
    AdaptDL uses them, are

        |G|^2  = (B |g_B|^2 - b |g_b|^2) / (B - b)
        tr(S)  = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

    both smoothed over steps (an exponential moving average). Reported at the job's initial
    batch size ``B0``: grad_sqr = |G|^2, grad_var = tr(S) / B0. With one rank nothing is
    measured (b = B); nor in a step the ranks split unevenly (an epoch's last).
    """

    SMOOTHING = 0.2  # weight of a new step's estimate

    def __init__(self, base_batch: int) -> None:
        self.base_batch = max(1, base_batch)
        self.local_sq = 0.0  # this rank's squared gradient norm in the current step
        self.mean_sq = 0.0  # the averaged gradient's
        self.sqr = 0.0  # smoothed |G|^2; 0 until measured
        self.trace = 0.0  # smoothed tr(S)

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations: none here
        """A DDP communication hook: DDP's own average, with both norms taken on the way."""
        self.local_sq += float(bucket.buffer().double().pow(2).sum())

        def averaged(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = future.value()
            tensor = value[0] if isinstance(value, list) else value
            self.mean_sq += float(tensor.double().pow(2).sum())
            return tensor

        return default_hooks.allreduce_hook(None, bucket).then(averaged)  # type: ignore[arg-type]

    def update(self, ranks_local_sq_sum: float, world_size: int, global_batch: int) -> None:
        """After a step of ``global_batch`` samples split evenly over ``world_size`` ranks."""
        b = global_batch / world_size
        if world_size > 1 and global_batch % world_size == 0 and self.mean_sq > 0:
            local = ranks_local_sq_sum / world_size
            sqr = (global_batch * self.mean_sq - b * local) / (global_batch - b)
            trace = (local - self.mean_sq) / (1.0 / b - 1.0 / global_batch)
            if self.sqr == 0.0:
                self.sqr, self.trace = sqr, trace
            else:
                w = self.SMOOTHING
                self.sqr, self.trace = (1 - w) * self.sqr + w * sqr, (1 - w) * self.trace + w * trace
        self.local_sq = self.mean_sq = 0.0

    @property
    def grad_sqr(self) -> float:
        return max(self.sqr, 0.0)

    @property
    def grad_var(self) -> float:
        return max(self.trace, 0.0) / self.base_batch


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
        base = int(os.environ.get("SILOD_BASE_BATCH_SIZE") or 0) or ctx.batch_size or getattr(sampler, "batch_size", 1)
        self.noise = GradientNoise(base)
        self._last_step: tuple[int, int] | None = None  # (world size, global samples) of the step just done
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
            model = DistributedDataParallel(self.module, device_ids=[device.index], init_sync=sync,
                                            find_unused_parameters=self.reproducible)
        else:
            model = DistributedDataParallel(self.module, init_sync=sync, find_unused_parameters=self.reproducible)
        model.register_comm_hook(None, self.noise.hook)
        return model

    # -- the training loop's calls
    def step_boundary(self) -> Event:
        """Before each step, on every rank: CONTINUE, or the world changed (RESIZED), or STOP."""
        self.ctx.poll_directive(min_interval_s=DIRECTIVE_POLL_S)
        stop = self.ctx.should_checkpoint()
        world = self.ctx.world_changed()
        # One all-reduce: whether any rank saw a directive, and the ranks' gradient norms of the
        # step just done (for the noise statistics).
        shared = torch.tensor([1.0 if (stop or world is not None) else 0.0, self.noise.local_sq], dtype=torch.float64)
        dist.all_reduce(shared)
        if self._last_step is not None:
            self.noise.update(float(shared[1]), *self._last_step)
            self._last_step = None
        if not shared[0].item():
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
        try:
            self.reform(world)
        except ReformFailed as exc:
            # Fall back to checkpoint-restart: the state this rank holds is consistent as of the
            # last step (rank 0 of the new world, always a survivor, saves it), then exit with
            # the status that asks the scheduler to restart the job from the checkpoint.
            saved = self.save()
            print(f"silod.job: {exc}; falling back to checkpoint-restart "
                  f"({'checkpoint saved' if saved else 'rank 0 saves the checkpoint'}), exit {RESTART_EXIT_CODE}",
                  file=sys.stderr, flush=True)
            raise SystemExit(RESTART_EXIT_CODE) from exc
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
        self._last_step = (self.ctx.world_size, samples)
        if self.noise.grad_sqr > 0:
            self.ctx.report(grad_sqr=self.noise.grad_sqr, grad_var=self.noise.grad_var)
        return samples

    def reform(self, world: World) -> None:
        """Leave the old process group and form the new one at ``world``'s rendezvous, in place."""
        started = time.monotonic()
        dist.destroy_process_group()
        try:
            self._init_group(world.rank, world.world_size, (world.master_addr, world.master_port))
            self._agree_on_state(newcomer=False)
        except Exception as exc:  # noqa: BLE001 - reported with what it means for the job
            raise ReformFailed(f"the new process group (rank {world.rank} of {world.world_size} at "
                               f"{world.master_addr}:{world.master_port}) did not form within "
                               f"{self.reform_timeout_s:g}s: {exc}") from exc
        took = time.monotonic() - started
        self.reforms.append(took)
        print(f"silod.job: process group re-formed in place in {took:.2f}s: rank {world.rank} of {world.world_size} "
              f"(was {world.previous_rank} of {world.previous_world_size}), batch {self.ctx.batch_size}",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
