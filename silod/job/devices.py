"""Where a rank trains, and which collective backend serves which of its devices.

silod's own collectives (step-boundary flags, the re-form agreement, the end-of-job handshake,
the gradient-noise norms) are a few numbers each step: they are CPU tensors, always. A group
built for a GPU job therefore serves the CPU too: ``cpu:gloo,cuda:nccl``. NCCL alone reduces
only CUDA tensors ("No backend type associated with device type cpu"), and moving each flag to
the GPU and back would cost a device synchronisation per step for nothing. Gradients and the
state handed to newcomers live on the rank's GPU and go over NCCL.

A job may name another backend for its accelerator (``backend=`` of ``ctx.distributed`` or
``SILOD_DIST_BACKEND``); one that does not serve the CPU is given gloo for it in the same way.
``SILOD_DIST_BACKEND_MODULE`` names a module to import first, for backends that register
themselves when imported (as Intel's oneCCL bindings do).
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

CONTROL_DEVICE = torch.device("cpu")  # where silod's control tensors live, whatever the backend
BACKEND_ENV = "SILOD_DIST_BACKEND"
BACKEND_MODULE_ENV = "SILOD_DIST_BACKEND_MODULE"


def rank_device(environ: dict[str, str] | None = None) -> torch.device:
    """The device this rank trains on: the GPU its ``LOCAL_RANK`` names when it sees several
    (the first when it sees one, as when the agent gives each rank its own through
    ``CUDA_VISIBLE_DEVICES``), else the CPU.

    Chosen once per process: a rank that survives a resize keeps its GPU (the agent does not
    move a running process's devices), even if its ``LOCAL_RANK`` changes."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    env = os.environ if environ is None else environ
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    local_rank = int(env.get("LOCAL_RANK") or 0)
    if not 0 <= local_rank < count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} names no GPU: this rank sees {count} "
                           f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    return torch.device("cuda", local_rank)


def accelerator_backend(device: torch.device, requested: str | None = None,
                        environ: dict[str, str] | None = None) -> str:
    """The backend named for the job's tensors: ``requested``, else ``SILOD_DIST_BACKEND``,
    else NCCL on a GPU and gloo on the CPU."""
    env = os.environ if environ is None else environ
    module = env.get(BACKEND_MODULE_ENV)
    if module:
        importlib.import_module(module)  # registers its backend as a side effect
    chosen = requested or env.get(BACKEND_ENV) or ("nccl" if device.type == "cuda" else "gloo")
    return chosen.strip().lower()


def group_backend(backend: str) -> str:
    """The ``init_process_group`` backend string for ``backend``, serving the CPU in any case.

    "gloo" -> "gloo"; "nccl" -> "cpu:gloo,cuda:nccl"; a "device:backend" list without a CPU
    entry gets "cpu:gloo" in front; one with a CPU entry is used as it is."""
    if ":" in backend:
        pairs = [p.strip() for p in backend.split(",") if p.strip()]
        if any(p.split(":", 1)[0] == "cpu" for p in pairs):
            return ",".join(pairs)
        return ",".join(["cpu:gloo", *pairs])
    devices = dist.Backend.backend_capability.get(backend)
    if devices is None:
        raise ValueError(f"backend: {backend!r} is not a registered torch.distributed backend "
                         f"(known: {', '.join(sorted(dist.Backend.backend_capability))}; "
                         f"set {BACKEND_MODULE_ENV} to import the module that registers it)")
    if "cpu" in devices:
        return backend
    return ",".join(["cpu:gloo", *(f"{device}:{backend}" for device in devices)])


def served_devices(group: object | None = None) -> set[str]:
    """Device types the (default) process group has a backend for."""
    pg = group or dist.distributed_c10d._get_default_group()
    return {d.type for d in getattr(pg, "_device_types", ())}


def state_device(device: torch.device) -> torch.device:
    """Where the state handed to newcomers travels: the rank's GPU when the group serves it
    (NCCL moves the optimizer's tensors far faster than gloo), else the CPU."""
    if device.type != "cpu" and device.type in served_devices():
        return device
    return CONTROL_DEVICE
