"""Send a state dict from one rank to all: the small structure pickled, the tensors as tensors.

``dist.broadcast_object_list`` pickles everything, tensors included: for the optimizer state of
a 10M-parameter model (40 MB of momentum, 80 MB for Adam) that is a pickle, a copy into a byte
tensor, the send, and an unpickle on every receiver -- 0.5-0.65 s at 4 ranks on this 2-core
machine, against 0.13 s to broadcast the same tensors directly. A newcomer waits for it at every
in-place grow (silod.job.distributed), so here only the skeleton (keys, numbers, each tensor's
dtype and shape) is pickled, and the tensors' bytes go in one flat buffer. The bytes arrive
unchanged: a rank that receives the state continues bit-identically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the structure: its bytes' place in the flat buffer."""

    dtype: torch.dtype
    offset: int  # in bytes
    nbytes: int
    shape: tuple[int, ...]
    device: str  # the sender's kind of device; receivers use their own device of that kind


def _strip(value: Any, chunks: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:  # sparse ones are pickled
        raw = value.detach().reshape(-1).contiguous().view(torch.uint8)
        offset = sum(c.numel() for c in chunks)
        chunks.append(raw)
        return _Slot(value.dtype, offset, raw.numel(), tuple(value.shape), value.device.type)
    if isinstance(value, dict):
        return type(value)((k, _strip(v, chunks)) for k, v in value.items())
    if isinstance(value, list):
        return [_strip(v, chunks) for v in value]
    if isinstance(value, tuple):
        return tuple(_strip(v, chunks) for v in value)
    return value


def _fill(value: Any, buffer: torch.Tensor) -> Any:
    if isinstance(value, _Slot):
        raw = buffer[value.offset:value.offset + value.nbytes]
        # Copied first: its own storage (not the buffer's), aligned for its dtype.
        tensor = raw.clone().view(value.dtype).view(value.shape)
        return tensor if value.device == "cpu" else tensor.to(_local_device(value.device))
    if isinstance(value, dict):
        return type(value)((k, _fill(v, buffer)) for k, v in value.items())
    if isinstance(value, list):
        return [_fill(v, buffer) for v in value]
    if isinstance(value, tuple):
        return tuple(_fill(v, buffer) for v in value)
    return value


def _local_device(kind: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def broadcast_state(state: Any, src: int = 0, device: torch.device | None = None) -> Any:
    """``state`` as rank ``src`` holds it, on every rank (the others pass anything, e.g. None).

    ``device``: where the bytes travel (CUDA for NCCL, the CPU for gloo; default: the CPU).
    Dicts, lists and tuples are walked; any other object, and sparse tensors, are pickled as
    they are. Every tensor travels as its bytes, in one buffer: one collective whatever the
    dtypes (gloo has no bool or complex reductions to trip over).
    """
    device = device or torch.device("cpu")
    rank = dist.get_rank()
    chunks: list[torch.Tensor] = []
    skeleton = _strip(state, chunks) if rank == src else None
    box: list[Any] = [(skeleton, sum(c.numel() for c in chunks))]
    dist.broadcast_object_list(box, src=src, device=torch.device("cpu"))  # the skeleton: a CPU object
    skeleton, nbytes = box[0]
    if nbytes == 0:
        return state if rank == src else skeleton
    if rank == src:
        buffer = torch.cat([c.to(device) for c in chunks])
    else:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src)
    if rank == src:
        return state
    return _fill(skeleton, buffer.cpu() if buffer.device.type != "cpu" else buffer)
