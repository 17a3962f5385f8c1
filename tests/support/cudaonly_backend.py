"""A collective backend that, like NCCL, serves CUDA tensors only: NCCL's rules on a CPU machine.

Importing this module registers ``cudaonly`` with torch.distributed. Underneath it is gloo, but
registered for the ``cuda`` device alone, so a process group made of it alone refuses every
CPU tensor with the error NCCL gives ("No backend type associated with device type cpu").
The suite runs every DDP job with it as the accelerator's backend (tests/conftest.py sets
SILOD_DIST_BACKEND and SILOD_DIST_BACKEND_MODULE): a collective silod issues on a device that
the group's accelerator backend does not serve fails here as it would on a GPU.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

NAME = "cudaonly"


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if NAME not in dist.Backend.backend_capability:
    dist.Backend.register_backend(NAME, _create, devices=["cuda"])
