"""Distributed data-parallel training on real images, resized in place by silod.

The data: scikit-learn's handwritten digits (1,797 images of 8x8 pixels, 10 classes), written
as PNG files whose label rides in a PNG text chunk, then registered as a silod dataset (a
directory or an S3 bucket). The job reads them through the node's cache server with
``silod.data`` (SilodDataset + ElasticSampler), decodes them with Pillow, and trains a small
MLP with PyTorch DistributedDataParallel through ``ctx.distributed(...)``: when silod grows or
shrinks the job, surviving ranks re-form the process group in place and newcomers receive the
state from rank 0. With a GPU visible the model and every batch live on the rank's GPU
(``trainer.device``) and gradients go over NCCL; without one, on the CPU over gloo.

    python examples/train_ddp_digits.py prepare /data/digits      # write the PNG files
    silod dataset register digits file:///data/digits
    silod submit job.yaml   # command: [python, examples/train_ddp_digits.py], dataset: digits,
                            # min_gpus: 1, max_gpus: 4, resize_in_place: true, epochs: 5

On a machine without a GPU, ``SILOD_EXAMPLE_STEP_SLEEP_S`` adds a sleep per step that stands in
for GPU compute (emulated, as the DLCache paper did), ``SILOD_EXAMPLE_SAMPLE_SLEEP_S`` one per
sample of the rank's share of the step (GPU time that grows with the local batch, as Pollux's
step-time model has it); both 0 by default, ignored on a GPU, and the job says when it emulates. The learning rate follows the
square-root rule: lr = base_lr * sqrt(batch / base_batch), applied at the next step whenever
silod retunes the batch size.

For the tests each rank logs, after every step, the parameters' hash and the positions it
trained on (``step ...`` lines), so identical replicas and exactly-once reads can be checked.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

BASE_LR = 0.1
BASE_BATCH = 32


def prepare(directory: Path) -> int:
    """Write the digits as PNG files (label in a text chunk) under ``directory``."""
    from PIL import Image, PngImagePlugin
    from sklearn.datasets import load_digits

    digits = load_digits()
    directory.mkdir(parents=True, exist_ok=True)
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        info = PngImagePlugin.PngInfo()
        info.add_text("label", str(int(label)))
        image = Image.fromarray((pixels * (255 / 16)).astype("uint8"), mode="L")
        image.save(directory / f"{i:04d}.png", pnginfo=info)
    print(f"wrote {len(digits.images)} images to {directory}")
    return 0


def decode(data: bytes) -> tuple[torch.Tensor, int]:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).float().div(255.0)
    return pixels, int(image.text["label"])


def collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    if not samples:  # this rank's share of the epoch's last, short step
        return torch.zeros(0, 64), torch.zeros(0, dtype=torch.long)
    return torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples])


def params_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def train(args: argparse.Namespace) -> int:
    import silod.data
    import silod.job
    from silod.data import ElasticSampler, SilodDataset
    from silod.job.devices import rank_device
    from silod.job.distributed import Event

    ctx = silod.job.init(args.checkpoint_dir)
    # No DataLoader workers here (the steps are small): the manifest is loaded in this process,
    # which saves a helper process at every start, and so at every rank that joins a resize.
    dataset = SilodDataset(args.dataset or os.environ["SILOD_DATASET"], transform=decode, manifest_in_process=True)
    epochs = int(os.environ.get("SILOD_EPOCHS") or args.epochs)
    sleep_s = float(os.environ.get("SILOD_EXAMPLE_STEP_SLEEP_S") or 0.0)
    sample_sleep_s = float(os.environ.get("SILOD_EXAMPLE_SAMPLE_SLEEP_S") or 0.0)
    checkpoint_every_s = float(os.environ.get("SILOD_CHECKPOINT_EVERY_S") or 30.0)
    torch.manual_seed(0)  # every rank builds the same model; DDP also broadcasts rank 0's
    hidden = int(os.environ.get("SILOD_EXAMPLE_HIDDEN") or 0)  # benchmarks/elastic_resize.py: a ~10M-parameter MLP
    layers = [nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)] if hidden \
        else [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)]
    device = rank_device()  # the rank's GPU when it has one (CUDA_VISIBLE_DEVICES, LOCAL_RANK), else the CPU
    model = nn.Sequential(*layers).to(device)  # before the optimizer is made over its parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    sampler = ElasticSampler(dataset, ctx.batch_size or BASE_BATCH, rank=ctx.rank, world_size=ctx.world_size,
                             seed=args.seed)
    trainer = ctx.distributed(model, optimizer, sampler)
    if device.type == "cuda":
        sleep_s = sample_sleep_s = 0.0  # real compute: nothing to emulate
    elif sleep_s or sample_sleep_s:
        print(f"no GPU: emulating GPU compute with {sleep_s:g}s a step + {sample_sleep_s:g}s a sample", flush=True)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    last_checkpoint = time.monotonic()
    while sampler.epoch < epochs:
        # Pinned host memory when the batches go to a GPU, so that their copies run asynchronously.
        for batch in silod.data.loader(dataset, batch_sampler=sampler, collate_fn=collate, device=device):
            inputs, labels = silod.data.to_device(batch, device)
            event = trainer.step_boundary()
            if event is Event.STOP:
                trainer.save()
                print(f"step-stop rank {ctx.rank} at step {trainer.steps}", flush=True)
                ctx.done()
                trainer.close()
                return 0
            if event is Event.RESIZED:
                break  # this batch was cut for the old world: iterate again from the sampler's position
            for group in optimizer.param_groups:  # the square-root rule, at the step after a retune
                group["lr"] = BASE_LR * math.sqrt(sampler.batch_size / BASE_BATCH)
            start, size = sampler.consumed, sampler.step_size()
            epoch = sampler.epoch
            t0 = time.monotonic()
            optimizer.zero_grad()
            # The sum over this rank's samples / the step's global size, times the world: DDP's
            # average of the ranks' gradients is then the mean over the global batch, however
            # unevenly the step was split.
            loss = loss_fn(trainer.model(inputs), labels) * (ctx.world_size / size)
            loss.backward()
            optimizer.step()
            if sleep_s or sample_sleep_s:
                time.sleep(sleep_s + sample_sleep_s * len(labels))  # emulated GPU compute (no GPU here)
            read = sampler.local_indices(start, sampler.order(epoch))  # what this batch held
            trainer.step_done(size)
            print("step " + json.dumps({
                "t": time.time(), "step": trainer.steps, "epoch": epoch, "start": start, "size": size, "rank": ctx.rank,
                "world": ctx.world_size, "generation": ctx.generation, "batch": sampler.batch_size,
                "loss": loss.item() / ctx.world_size * size / max(len(read), 1) if read else None,
                "hash": params_hash(model), "read": read,
            }), flush=True)
            ctx.report(samples=size, steps=1, epoch=sampler.epoch, step_time_s=time.monotonic() - t0,
                       batch_size=sampler.batch_size, fraction_done=(sampler.epoch + sampler.consumed /
                                                                     sampler.num_samples) / epochs)
            if time.monotonic() - last_checkpoint >= checkpoint_every_s:
                trainer.save()
                last_checkpoint = time.monotonic()
    trainer.save()
    print(f"done rank {ctx.rank} steps {trainer.steps} samples {trainer.samples} hash {params_hash(model)}", flush=True)
    ctx.done()
    trainer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    prep = sub.add_parser("prepare", help="write the digits as PNG files into DIR")
    prep.add_argument("directory", type=Path)
    parser.add_argument("--dataset", default="", help="registered dataset (default: $SILOD_DATASET)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3; $SILOD_EPOCHS wins)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--checkpoint-dir", default=None, help="off-cluster only; default ./checkpoints")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return prepare(args.directory)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
