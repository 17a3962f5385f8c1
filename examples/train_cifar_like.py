"""A tiny real PyTorch training script using the silod job SDK (CPU only).

It trains a small MLP on synthetic CIFAR-shaped data (3x32x32 inputs, 10 classes) and
cooperates with silod: it resumes from the job's checkpoint, reports progress, and on a
checkpoint directive (or SIGTERM) saves model + optimizer state and exits 0. Resized around
(fast resize) it keeps training from its in-memory model: the ``on_resize`` callback is where a
distributed job re-forms its process group.

``--emulated-gpu-s SECONDS`` adds a sleep per step to stand in for GPU compute time: this is
emulated GPU time, there is no GPU involved.

Standalone (off-cluster twin, checkpoints in ./checkpoints):

    python examples/train_cifar_like.py --steps 50

Under a worker agent, put it in a JobSpec's command; the agent sets SILOD_* variables.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import silod.job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="total optimizer steps (across restarts)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--emulated-gpu-s", type=float, default=0.0, help="sleep per step standing in for GPU time")
    parser.add_argument("--checkpoint-dir", default=None, help="off-cluster only; default ./checkpoints")
    args = parser.parse_args(argv)

    ctx = silod.job.init(args.checkpoint_dir)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Synthetic data: a fixed random linear "teacher" labels random images, so loss can go down.
    teacher = torch.randn(3 * 32 * 32, 10, generator=torch.Generator().manual_seed(7))
    step = 0
    state = ctx.load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        print(f"resumed from checkpoint at step {step}", flush=True)
    ctx.set_progress(samples=step * args.batch_size, steps=step)

    def checkpoint() -> bool:
        return ctx.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step})

    def resized(world: silod.job.World) -> None:
        # A DDP job would destroy its process group here and init a new one at
        # world.master_addr:world.master_port with world.rank / world.world_size; this one is a
        # single process per rank, so it only says so. The model and optimizer stay as they are.
        print(f"re-formed at step {step}: rank {world.rank} of {world.world_size} (was {world.previous_world_size}), "
              f"generation {world.generation}", flush=True)

    ctx.on_resize(resized)
    loss_fn = nn.CrossEntropyLoss()
    while step < args.steps:
        if ctx.should_checkpoint():
            if checkpoint():
                print(f"checkpointed at step {step}; exiting", flush=True)
            else:  # another rank writes, the agent is gone (the job restarts from its last checkpoint),
                # or a fast resize removed this rank (the survivors carry the state on)
                print(f"stopping at step {step}; exiting", flush=True)
            ctx.done()
            return 0
        t0 = time.monotonic()
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
        y = (x.flatten(1) @ teacher).argmax(1)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.emulated_gpu_s:
            time.sleep(args.emulated_gpu_s)
        step += 1
        ctx.report(
            samples=args.batch_size,
            steps=1,
            step_time_s=time.monotonic() - t0,
            fraction_done=step / args.steps,
            batch_size=args.batch_size,
        )
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    checkpoint()
    print(f"done at step {step}", flush=True)
    ctx.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
