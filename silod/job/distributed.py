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
for a rank that already left: so at every step boundary the ranks all-reduce a few flags (any
rank stopping or leaving? any rank told of a new world? are the newcomers there?).

A grow does not stop training while the newcomers start (a Python process, ``import torch``,
the model, the dataset: seconds): the survivors hold the new world and go on training in the
old group. Rank 0 opens the new rendezvous store at once; each newcomer checks in there when it
is ready, and at the first step boundary after the last one did, every rank switches. A shrink
(or any change with a leaving rank) switches at the next step boundary.

At the switch every rank fetches its own directive (the agents of the other nodes may apply the
plan a moment later; bounded by ``reform_timeout_s``), leaving ranks stop, and survivors destroy
the process group and initialise the new one at the new rendezvous, where the newcomers wait.
Rank 0 of the new group (always a survivor) then broadcasts the optimizer and sampler state and
the progress counters; wrapping the model in a new DDP broadcasts its parameters and buffers. No
surviving process restarts.

A checkpoint-and-exit directive (the job is moved, preempted, or its agent stops) also goes
through the flag, so all ranks stop at the same step and rank 0 saves the state.

Devices and backends (silod.job.devices): a rank trains on the GPU it was given when CUDA is
there (``trainer.device``; the one its ``LOCAL_RANK`` names if it sees several), else on the CPU.
The process group serves both: gradients and the state handed to newcomers go over NCCL on the
GPU, silod's per-step flags stay CPU tensors over gloo (``cpu:gloo,cuda:nccl``).
"""

from __future__ import annotations

import enum
import inspect
import ipaddress
import os
import socket
import struct
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from silod.job import devices
from silod.job.broadcast import broadcast_state
from silod.job.world import ElasticContext, World

REFORM_TIMEOUT_S = 120.0  # default; SILOD_REFORM_TIMEOUT_S (the job's env) or reform_timeout_s= overrides it
# Exit status of a rank that gives up re-forming in place: the scheduler restarts every rank of
# the job from the checkpoint instead (EX_TEMPFAIL; 137, a rank killed by SIGKILL, does the same).
RESTART_EXIT_CODE = 75
# Counter in a rendezvous store: the ranks that reached it (a held resize waits for its newcomers).
ARRIVED_KEY = "silod/arrived"
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
STORE_CONNECT_TRY_S = 3.0  # one try to reach rank 0's rendezvous store (see _rendezvous_store)
# How often a rank asks its agent for a directive: one loopback RPC, small next to a step, and
# the resize waits for the first rank that learns of it.
DIRECTIVE_POLL_S = 0.2


# DDP's init_sync (torch 2.7+) lets a group of survivors, which hold the same parameters, skip
# the broadcast of rank 0's; older releases broadcast them at every wrap.
_DDP_HAS_INIT_SYNC = "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters


class Event(enum.Enum):
    CONTINUE = "continue"  # train the step
    RESIZED = "resized"  # the world changed: restart the data iterator (the sampler is already resized)
    STOP = "stop"  # leave: save a checkpoint unless ctx.leaving (trainer.save() does both right), then exit


class ReformFailed(RuntimeError):
    """The new process group did not form within the deadline."""


class GradientNoise:
    """Pollux's gradient statistics, measured around the all-reduce DDP does anyway.

    Each rank's gradient (before the all-reduce) is the mean over its ``b = B / W`` samples, the
    averaged one over the step's ``B``. With ``|g_b|^2`` the ranks' mean squared norm and
    ``|g_B|^2`` the averaged gradient's, the unbiased estimates of McCandlish et al. (2018), as
    AdaptDL uses them, are

        |G|^2  = (B |g_B|^2 - b |g_b|^2) / (B - b)
        tr(S)  = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

    both smoothed over steps (an exponential moving average). Reported at the job's initial
    batch size ``B0``: grad_sqr = |G|^2, grad_var = tr(S) / B0. With one rank nothing is
    measured (b = B); nor in a step the ranks split unevenly (an epoch's last).

    The local norm comes from a hook on each parameter's gradient (it runs before DDP reduces
    it), the averaged one from the parameters' ``.grad`` after the step. Not from a DDP
    communication hook: a Python hook gives the gloo workers' bucket tensors Python owners,
    which they then release under the GIL, and a process group destroyed at that moment (a
    re-form, the end of the job) deadlocks in PyTorch (pytorch/pytorch#56297).

    The norms are summed where the gradients are (a GPU's kernels queue behind the backward
    pass) and read once a step, at the step boundary. With one rank there is nothing to measure,
    and the hooks return at once (``active`` is set at each re-form).
    """

    SMOOTHING = 0.2  # weight of a new step's estimate

    def __init__(self, base_batch: int) -> None:
        self.base_batch = max(1, base_batch)
        self.active = False  # measuring: the group has more than one rank
        self._local: torch.Tensor | float = 0.0  # this rank's squared gradient norm in the current step
        self.mean_sq = 0.0  # the averaged gradient's
        self.sqr = 0.0  # smoothed |G|^2; 0 until measured
        self.trace = 0.0  # smoothed tr(S)

    def track(self, module: torch.nn.Module) -> None:
        for param in module.parameters():
            if param.requires_grad:
                param.register_hook(self._local_gradient)

    def _local_gradient(self, grad: torch.Tensor) -> None:
        if self.active:
            self._local = self._local + _squared_norm(grad)

    @property
    def local_sq(self) -> float:
        """This rank's squared gradient norm of the step just done (a GPU waits for it here)."""
        return float(self._local)

    def averaged(self, module: torch.nn.Module) -> None:
        """After the step's all-reduce: the averaged gradient is in every parameter's ``.grad``."""
        grads = [p.grad for p in module.parameters() if p.grad is not None] if self.active else []
        self.mean_sq = float(torch.stack([_squared_norm(g) for g in grads]).sum()) if grads else 0.0

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
        self._local = 0.0
        self.mean_sq = 0.0

    @property
    def grad_sqr(self) -> float:
        return max(self.sqr, 0.0)

    @property
    def grad_var(self) -> float:
        return max(self.trace, 0.0) / self.base_batch


def _squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of squares in double precision, on the tensor's device, without a synchronisation."""
    return torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64).square()


def interface_towards(host: str, port: int) -> str | None:
    """The name of the network interface this machine reaches ``host`` through, unless that is
    loopback (every rank on one machine: the default binding is right) or it cannot be told."""
    try:
        import fcntl  # Linux and other Unixes; elsewhere the default binding stays
    except ImportError:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP: picks the route and source address, sends nothing
            address = probe.getsockname()[0]
            if ipaddress.ip_address(address).is_loopback:
                return None
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                try:
                    assigned = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)[20:24])
                except OSError:  # no IPv4 address on this interface
                    continue
                if assigned == address:
                    return name
    except OSError:
        return None
    return None


class DistributedTraining:
    def __init__(
        self,
        ctx: ElasticContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: Any = None,
        *,
        backend: str | None = None,
        reform_timeout_s: float | None = None,
        reproducible: bool | None = None,
    ) -> None:
        self.ctx = ctx
        self.module = model
        self.optimizer = optimizer
        self.sampler = sampler
        # The rank's device, chosen once: a survivor of a resize keeps its GPU.
        self.device = devices.rank_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Before the checkpoint is loaded: the optimizer puts its state where the parameters are.
            model.to(self.device)
        # ``backend`` names the backend for the job's tensors (NCCL on a GPU); the group also
        # serves the CPU, where silod's control tensors are (silod.job.devices).
        self.backend = devices.group_backend(devices.accelerator_backend(self.device, backend))
        self.reform_timeout_s = reform_timeout_s or float(os.environ.get("SILOD_REFORM_TIMEOUT_S") or REFORM_TIMEOUT_S)
        # DDP lays gradients out in buckets in parameter order for a group's first step, then
        # re-buckets them in the order they became ready; the all-reduce adds floats in that
        # layout. A resumed (or re-formed) group would run its first step in the other layout
        # and drift from an uninterrupted run in the last bits. Without re-bucketing (which is
        # what find_unused_parameters=True implies, for one extra graph walk per step) the
        # layout never changes: a resumed run is bit-identical on CPU. On a GPU, where kernels
        # are not deterministic unless the job asks torch for it, the default is off.
        self.reproducible = (self.device.type == "cpu") if reproducible is None else reproducible
        if self.reproducible:
            # Every parameter is used, and PyTorch says so at the first step of each group: the
            # graph walk that find_unused_parameters asks for is kept for the fixed bucket layout.
            warnings.filterwarnings("ignore", message=".*find_unused_parameters=True was specified.*")
        self.steps = 0  # optimizer steps of the whole job
        self.samples = 0  # samples the whole job trained on
        self.reforms: list[float] = []  # seconds each in-place re-form took
        # The process group this rank trains in; ctx.rank/world_size move with it (a held resize
        # changes neither until the switch).
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self._arrivals: tuple[tuple[str, int], Any] | None = None  # rank 0: (rendezvous, store) of a held world
        self._held_since = 0.0
        # The current process group, held here so that it outlives its DDP wrapper (see _release).
        self._group: Any = None
        ctx.hold_resizes = True
        base = int(os.environ.get("SILOD_BASE_BATCH_SIZE") or 0) or ctx.batch_size or getattr(sampler, "batch_size", 1)
        self.noise = GradientNoise(base)
        self.noise.track(model)
        self._last_step: tuple[int, int] | None = None  # (world size, global samples) of the step just done
        self._restore()
        if ctx.rank != 0 and ctx.training_finished():
            self._exit_finished()
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
            mine = {k: v for k, v in self.state_dict().items() if k != "model"} if self.ctx.rank == 0 else None
            state = broadcast_state(mine, src=0, device=devices.state_device(self.device))
        if self.ctx.world_size > 1 and self.ctx.rank != 0:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.sampler is not None and state["sampler"] is not None:
                self.sampler.load_state_dict(state["sampler"])
            self.steps, self.samples = state["steps"], state["samples"]
        if self.sampler is not None:
            self.sampler.resize(self.ctx.rank, self.ctx.world_size, self.ctx.batch_size or None)
        self.ctx.set_progress(samples=self.samples, steps=self.steps, epoch=getattr(self.sampler, "epoch", None))

    # -- the process group
    def _rendezvous_store(self, rank: int, world_size: int, rendezvous: tuple[str, int]) -> Any:
        """The TCP store of a rendezvous: rank 0 serves it, the others connect (waiting for it)."""
        if rank == 0 and self._arrivals is not None and self._arrivals[0] == rendezvous:
            return self._arrivals[1]  # opened while the resize was held
        host, port = rendezvous
        if rank == 0:
            return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=self.reform_timeout_s))
        # Rank 0 may be slow to open it, or gone for good: a grow that came as the training ended
        # launched ranks that nobody will meet. Between short tries they look for rank 0's mark.
        deadline = time.monotonic() + self.reform_timeout_s
        while True:
            try:
                return dist.TCPStore(host, port, world_size, is_master=False,
                                     timeout=timedelta(seconds=STORE_CONNECT_TRY_S))
            except RuntimeError:  # DistNetworkError: nobody there yet
                if self.ctx.training_finished():
                    self._exit_finished()
                if time.monotonic() > deadline:
                    raise

    def _exit_finished(self) -> None:
        print("silod.job: the job's training already ended (rank 0 marked it finished): this rank has nothing "
              "to join and exits", file=sys.stderr, flush=True)
        self.ctx.done()
        raise SystemExit(0)

    def _init_group(self, rank: int, world_size: int, rendezvous: tuple[str, int]) -> None:
        interface = interface_towards(*rendezvous)
        if interface:
            # Gloo (and NCCL's bootstrap) bind to the address the machine's host name resolves to,
            # and fall back to loopback where it does not resolve (or resolves to 127.0.1.1, as on
            # Debian): ranks on other hosts could then never connect. The interface that reaches
            # the rendezvous host is one they can reach us on. A value the job set wins.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        store = self._rendezvous_store(rank, world_size, rendezvous)
        store.add(ARRIVED_KEY, 1)  # checks in: a held resize waits for its newcomers' check-ins
        launched = float(os.environ.get("SILOD_LAUNCH_TIME") or 0)
        if launched and self._group is None:  # a rank's first group: how long its start-up took
            warm = " (in a warm process)" if os.environ.get("SILOD_WARM_START") == "1" else ""
            print(f"silod.job: rank {rank} of {world_size} ready {time.time() - launched:.2f}s after its launch{warm}, "
                  f"training on {self.device} (backend {self.backend})", file=sys.stderr, flush=True)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=self.reform_timeout_s))
        self._group = dist.group.WORLD
        self._arrivals = None  # the group holds its store now
        self.rank, self.world_size = rank, world_size
        self.noise.active = world_size > 1

    def _newcomers_ready(self, held: World | None) -> bool:
        """Rank 0, while a resize is held: have the ranks the new world adds checked in yet?"""
        if held is None or self.rank != 0:
            return False
        expected = held.world_size - self.world_size  # every current rank stays: the others would be leaving
        if expected <= 0:
            return True
        rendezvous = (held.master_addr, held.master_port)
        if self._arrivals is None or self._arrivals[0] != rendezvous:  # a newer resize replaces a held one
            self._arrivals = (rendezvous, self._rendezvous_store(0, held.world_size, rendezvous))
            self._held_since = time.monotonic()
        if self._arrivals[1].add(ARRIVED_KEY, 0) >= expected:
            return True
        # Newcomers that never check in: switch anyway, so the re-form times out and the job falls
        # back to checkpoint-restart instead of training on at the old size for ever.
        return time.monotonic() - self._held_since > self.reform_timeout_s

    def _agree_on_state(self, newcomer: bool) -> None:
        """Wrap the model in DDP and give every rank rank 0's state, when some rank lacks it: a
        rank that just started (it holds the checkpoint's state at best). When only ranks that
        stayed form the group (a shrink) they already hold the same state: nothing is sent."""
        flag = torch.tensor([1 if newcomer else 0], device=devices.CONTROL_DEVICE)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        sync = bool(flag.item())
        self.model = self._wrap(sync)
        if sync:
            self._sync_state()
        elif self.sampler is not None:
            self.sampler.resize(self.ctx.rank, self.ctx.world_size, self.ctx.batch_size or None)

    def _wrap(self, sync: bool = True) -> DistributedDataParallel:
        """DDP over the current group; ``sync``: broadcast rank 0's parameters and buffers."""
        options: dict[str, Any] = {"find_unused_parameters": self.reproducible}
        if _DDP_HAS_INIT_SYNC:  # torch < 2.7 always broadcasts: the same state, sent once more
            options["init_sync"] = sync
        if self.device.type == "cuda":
            self.module.to(self.device)
            options["device_ids"] = [self.device.index]
        return DistributedDataParallel(self.module, **options)

    # -- the training loop's calls
    def step_boundary(self) -> Event:
        """Before each step, on every rank: CONTINUE, or the world changed (RESIZED), or STOP."""
        return self._boundary(settle=False)

    def _boundary(self, settle: bool) -> Event:
        """``settle``: switch to a held world now, without waiting for its newcomers to check in."""
        self.ctx.poll_directive(min_interval_s=DIRECTIVE_POLL_S)
        stop = self.ctx.should_checkpoint()
        world = self.ctx.held_world()
        # One all-reduce: whether any rank stops or leaves, whether any was told of a new world,
        # whether rank 0 has all its newcomers, and the ranks' gradient norms of the step just
        # done (for the noise statistics).
        shared = torch.tensor([float(stop), float(world is not None), float(settle or self._newcomers_ready(world)),
                               self.noise.local_sq], dtype=torch.float64, device=devices.CONTROL_DEVICE)
        dist.all_reduce(shared)
        if self._last_step is not None:
            self.noise.update(float(shared[3]), *self._last_step)
            self._last_step = None
        if not (shared[0].item() or (shared[1].item() and shared[2].item())):
            return Event.CONTINUE
        if not stop:  # the stop or the world another rank saw is likely ours too: ask now
            self.ctx.poll_directive()
            stop = self.ctx.should_checkpoint()
            world = self.ctx.held_world()
        deadline = time.monotonic() + self.reform_timeout_s
        while not stop and world is None:  # another rank saw its directive first: fetch ours now
            if time.monotonic() > deadline:
                raise ReformFailed(f"no directive for this rank within {self.reform_timeout_s:g}s of its peers'")
            time.sleep(0.05)
            self.ctx.poll_directive()
            stop = self.ctx.should_checkpoint()
            world = self.ctx.held_world()
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
        step size); advances the sampler; returns the samples counted. Call it before clearing
        the gradients: it reads the averaged gradient's norm from them."""
        self.noise.averaged(self.module)
        if samples is None:
            samples = self.sampler.step_size() if self.sampler is not None else self.ctx.batch_size
        if self.sampler is not None:
            self.sampler.advance(samples)
        self.steps += 1
        self.samples += samples
        self._last_step = (self.world_size, samples)
        if self.noise.grad_sqr > 0:
            self.ctx.report(grad_sqr=self.noise.grad_sqr, grad_var=self.noise.grad_var)
        return samples

    def reform(self, world: World) -> None:
        """Leave the old process group and form the new one at ``world``'s rendezvous, in place."""
        started = time.monotonic()
        previous = self._group  # outlives the old DDP wrapper, which _agree_on_state replaces (see _release)
        dist.destroy_process_group()
        self.ctx.apply_world(world)
        try:
            self._init_group(world.rank, world.world_size, (world.master_addr, world.master_port))
            self._agree_on_state(newcomer=False)
            del previous
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
        """Leave the process group. A grow still held when the training ends is completed first:
        its newcomers were launched and wait at the rendezvous, and they learn from rank 0's state
        that the job is done (they exit at once, with status 0 like every rank)."""
        if not dist.is_initialized():
            return
        if not self.ctx.leaving and not self.ctx.should_checkpoint():
            try:
                # Every rank ends with such boundaries until one changes nothing: the newcomers'
                # first one is the survivors' second.
                while self._boundary(settle=True) is Event.RESIZED:
                    pass
            except (ReformFailed, RuntimeError) as exc:  # a peer already gone: nothing left to hand over
                print(f"silod.job: the held resize was not completed at the end: {exc}", file=sys.stderr, flush=True)
            self.ctx.mark_training_finished()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._release(self._group)
        self._group = None

    def _release(self, group: Any) -> None:
        """Drop the DDP wrapper of ``group`` (already destroyed), then the group itself.

        The group's destructor waits for gloo's worker threads, and they may need the GIL to let
        go of a finished collective's tensors. Run by the DDP wrapper's reducer (the last holder
        otherwise), it would wait holding the GIL: a deadlock, seen at the end of jobs
        (pytorch/pytorch#56297). Run by the group's own Python object, it gives the GIL up
        (pytorch/pytorch#154976): so the wrapper goes first and the group last."""
        self.model = None
        del group

