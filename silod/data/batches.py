"""Batches ready for the rank's device: a DataLoader that pins host memory when a GPU is there.

    device = silod.job.devices.rank_device()
    for inputs, labels in silod.data.loader(dataset, batch_sampler=sampler, device=device):
        inputs, labels = silod.data.to_device((inputs, labels), device)   # asynchronous copies

A copy from pinned (page-locked) host memory to a GPU runs asynchronously with
``non_blocking=True``; from ordinary memory it waits. Pinning costs a copy on the CPU side, so
it is on only when the batches go to a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from silod.job.devices import rank_device


def loader(dataset: Dataset[Any], *, device: torch.device | str | None = None, **options: Any) -> DataLoader[Any]:
    """``torch.utils.data.DataLoader(dataset, **options)`` with ``pin_memory`` on when ``device``
    (default: this rank's, see silod.job.devices.rank_device) is a GPU; an explicit
    ``pin_memory=`` in ``options`` wins."""
    target = torch.device(device) if device is not None else rank_device()
    options.setdefault("pin_memory", target.type == "cuda")
    return DataLoader(dataset, **options)


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor in it (in tuples, lists and dicts) moved to ``device`` with
    ``non_blocking=True``; anything else is returned as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple keeps its type
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
