"""Emulated training job: what the worker agent runs when a JobSpec has no command.

It "trains" without a GPU: each step sleeps ``SILOD_STEP_COMPUTE_S`` seconds (the spec's
emulated_step_compute_s; default 0.01) and counts ``SILOD_BATCH_SIZE`` samples (global per
step). The budget is ``SILOD_SAMPLE_BUDGET`` samples, or ``SILOD_EPOCHS`` x
``SILOD_EPOCH_SAMPLES`` (default 1000 samples per epoch), or 10000 samples by default. It
resumes from the job's checkpoint, reports progress through silod.job, checkpoints and exits 0
when asked (directive or SIGTERM; without a checkpoint if its agent is gone), also checkpoints every ``SILOD_CHECKPOINT_EVERY_S`` seconds
(default 30), and exits 0 when the budget is done. Its first output line is its environment
(``silod-env: {...}``), so the launch can be checked from the log.

Fast resize (AFE): resized around, it keeps its in-memory progress (no checkpoint reload), takes
the new batch size, pauses ``SILOD_RESIZE_PAUSE_S`` seconds (default 0.2; the re-forming of a
real process group) and logs ``emulated: fast resize ...``. When the world grows, rank 0 saves
a checkpoint then, which the joining ranks load (a real job broadcasts its state to them).
Removed by a fast resize, it exits 0 without a checkpoint.

With ``SILOD_DATASET`` (the spec's dataset) each step first reads this rank's share of the
global batch (every world_size-th sample, from a per-epoch shuffle seeded by the epoch, so the
ranks read disjoint samples) through silod.data's SilodDataset -- the node's cache server,
else the store -- then sleeps the compute time: IO and cache limit its throughput as they
would a real job's. Like a DataLoader's workers it reads one step ahead in the background
(never past its budget), so its remote reads do not pause between steps. An epoch is then
one pass over the dataset (unless ``SILOD_EPOCH_SAMPLES`` says otherwise), and the job reports the recent fraction of its reads
served from cache on this node (the cache server's Stats for the job, over about a second).
Without a dataset nothing is read.

With ``SILOD_JOB_KIND=inference`` it is an inference task instead: it holds its GPU for
``SILOD_INFERENCE_DURATION_S`` seconds (default 1) of emulated work, reporting the fraction
done, and exits 0; asked to stop early, it exits 0 at once (inference keeps no state).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import silod.job

_ENV_PREFIXES = ("SILOD_", "CUDA_VISIBLE_DEVICES", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK")


def _budget(epoch_samples: int) -> int:
    if os.environ.get("SILOD_SAMPLE_BUDGET"):
        return int(os.environ["SILOD_SAMPLE_BUDGET"])
    if os.environ.get("SILOD_EPOCHS"):
        return int(os.environ["SILOD_EPOCHS"]) * epoch_samples
    return 10000


class _DataReader:
    """Reads each step's samples of this rank through silod.data and measures the job's hit ratio."""

    STATS_INTERVAL_S = 1.0

    def __init__(self, name: str, job_id: str, budget: int = 0) -> None:
        from silod.data import SilodDataset  # imports torch: only jobs that read data pay for it

        self.dataset = SilodDataset(name)
        self.job_id = job_id
        self._orders: dict[int, list[int]] = {}
        self._stats: Any = None
        self._seen = (0, 0)  # the job's (hits, misses) on this node at the last look
        self._last_look = 0.0
        self.hit_ratio: float | None = None
        self.budget = budget  # global samples the job reads in all (0 = no end): nothing is read past it
        self._ahead: tuple[tuple[int, int, int, int], Future[None]] | None = None  # the next step, being read
        if self.dataset.cache_addr:
            from silod.rpc.channels import open_channel
            from silod.v1 import cache_pb2_grpc

            channel = open_channel(self.dataset.cache_addr, token=self.dataset.token, default_timeout_s=5)
            self._stats = cache_pb2_grpc.CacheServiceStub(channel)

    def __len__(self) -> int:
        return len(self.dataset)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.dataset)))
            random.Random(epoch).shuffle(order)  # every rank draws the same order
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def _positions(self, first_sample: int, batch: int, rank: int, world_size: int) -> list[int]:
        n = len(self.dataset)
        return [self._order(g // n)[g % n] for g in range(first_sample + rank, first_sample + batch, world_size)]

    def _read(self, positions: list[int]) -> None:
        for i in range(0, len(positions), 4096):  # at most 4096 keys per lease
            self.dataset.read_batch(positions[i:i + 4096])  # the bytes are not used: compute is emulated

    def read_step(self, first_sample: int, batch: int, rank: int, world_size: int) -> int:
        """Read this rank's share of the global batch of samples first_sample..+batch; return its size.

        The next step's samples are read in the background meanwhile (one step ahead, never past
        the budget), as a DataLoader's workers read ahead of the training loop: without it the
        remote link idled at every step boundary and an IO-bound job got ~85 % of its IO grant."""
        key = (first_sample, batch, rank, world_size)
        positions = self._positions(*key)
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != key:
            self._read(positions)  # not read ahead (first step, resized): now, in this thread
            ahead = None
        following = first_sample + batch
        size = batch if not self.budget else min(batch, self.budget - following)
        if size > 0:
            nxt = (following, size, rank, world_size)
            self._ahead = (nxt, _in_thread(self._read, self._positions(*nxt)))
        if ahead is not None:
            ahead[1].result()
        return len(positions)

    def recent_hit_ratio(self) -> float | None:
        """Fraction of the job's reads on this node served from cache since the last look (>= 1 s ago)."""
        now = time.monotonic()
        if self._stats is None or now - self._last_look < self.STATS_INTERVAL_S:
            return self.hit_ratio
        self._last_look = now
        import grpc

        from silod.v1 import cache_pb2

        try:
            stats = self._stats.Stats(cache_pb2.StatsRequest(job_id=self.job_id), timeout=2)
        except grpc.RpcError:
            return self.hit_ratio  # the cache server is down: reads fall back to the store
        job = next((j for j in stats.jobs if j.job_id == self.job_id), None)
        if job is not None:
            hits, misses = job.hits - self._seen[0], job.misses - self._seen[1]
            self._seen = (job.hits, job.misses)
            if hits + misses > 0:
                self.hit_ratio = hits / (hits + misses)
        return self.hit_ratio


def _in_thread(fn: Callable[..., None], *args: Any) -> Future[None]:
    """Run ``fn`` in a daemon thread (a read ahead never holds up the process's exit)."""
    future: Future[None] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the step
            future.set_exception(exc)

    threading.Thread(target=run, name="emulated-read-ahead", daemon=True).start()
    return future


def _inference(ctx: silod.job.JobContext) -> int:
    duration = float(os.environ.get("SILOD_INFERENCE_DURATION_S") or 0) or 1.0
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < duration:
        if ctx.should_checkpoint():
            print(f"emulated inference: stopped after {elapsed:.2f}s of {duration:g}s", flush=True)
            ctx.done()
            return 0
        time.sleep(min(0.05, duration - elapsed))
        ctx.report(steps=1, fraction_done=min(1.0, (time.monotonic() - start) / duration))
    ctx.report(fraction_done=1.0)
    print(f"emulated inference: done after {duration:g}s", flush=True)
    ctx.done()
    return 0


def _resized(ctx: silod.job.JobContext, world: silod.job.World, state: dict[str, int], batch: int) -> int:
    """Carry on in the new world from the in-memory state; return the batch size to use."""
    pause = float(os.environ.get("SILOD_RESIZE_PAUSE_S", "0.2"))
    t0 = time.monotonic()
    time.sleep(pause)
    if world.world_size > world.previous_world_size:
        ctx.save_checkpoint(state)  # rank 0 only: what the joiners load
    print(f"emulated: fast resize to rank {world.rank} of {world.world_size} generation {world.generation} "
          f"at samples={state['samples']} (was rank {world.previous_rank} of {world.previous_world_size}); "
          f"paused {time.monotonic() - t0:.2f}s, no checkpoint reload", flush=True)
    return world.batch_size or batch


def main() -> int:
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES) and k != "SILOD_AUTH_TOKEN"}
    print("silod-env: " + json.dumps(env), flush=True)
    ctx = silod.job.init()
    if os.environ.get("SILOD_JOB_KIND") == "inference":
        return _inference(ctx)
    step_s = float(os.environ.get("SILOD_STEP_COMPUTE_S") or 0) or 0.01
    batch = int(os.environ.get("SILOD_BATCH_SIZE") or 0) or 32
    reader = _DataReader(os.environ["SILOD_DATASET"], ctx.job_id) if os.environ.get("SILOD_DATASET") else None
    epoch_samples = int(os.environ.get("SILOD_EPOCH_SAMPLES") or (len(reader) if reader else 1000))
    checkpoint_every = float(os.environ.get("SILOD_CHECKPOINT_EVERY_S", "30"))
    budget = _budget(epoch_samples)
    if reader is not None:
        reader.budget = budget
    state = ctx.load_checkpoint() or {"samples": 0, "steps": 0}
    print(f"emulated: resumed at samples={state['samples']} steps={state['steps']} budget={budget}", flush=True)
    ctx.set_progress(samples=state["samples"], steps=state["steps"], epoch=state["samples"] // epoch_samples)
    ctx.report(step_time_s=step_s, batch_size=batch, fraction_done=state["samples"] / budget)
    last_checkpoint = time.monotonic()
    while state["samples"] < budget:
        if ctx.should_checkpoint():
            if getattr(ctx, "agent_lost", False):
                print(f"emulated: agent gone at samples={state['samples']}; exiting without a checkpoint", flush=True)
                return 0
            if ctx.leaving:
                print(f"emulated: left the job at samples={state['samples']}; exiting without a checkpoint", flush=True)
                ctx.done()
                return 0
            ctx.save_checkpoint(state)
            print(f"emulated: checkpointed at samples={state['samples']}; exiting", flush=True)
            ctx.done()
            return 0
        world = ctx.world_changed()
        if world is not None:
            batch = _resized(ctx, world, state, batch)
        t0 = time.monotonic()
        n = min(batch, budget - state["samples"])
        if reader is not None:
            reader.read_step(state["samples"], n, ctx.rank, ctx.world_size)
        time.sleep(step_s)
        epoch = state["samples"] // epoch_samples
        state["samples"] += n
        state["steps"] += 1
        ctx.report(
            samples=n,
            steps=1,
            epoch=state["samples"] // epoch_samples,
            step_time_s=time.monotonic() - t0,
            fraction_done=state["samples"] / budget,
            cache_hit_ratio=reader.recent_hit_ratio() if reader is not None else None,
        )
        if reader is not None and state["samples"] // epoch_samples > epoch:
            print(f"emulated: epoch {epoch} read; recent cache hit ratio {reader.recent_hit_ratio()}", flush=True)
        if time.monotonic() - last_checkpoint >= checkpoint_every:
            ctx.save_checkpoint(state)
            last_checkpoint = time.monotonic()
    ctx.save_checkpoint(state)
    print(f"emulated: done samples={state['samples']} steps={state['steps']}", flush=True)
    ctx.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
