"""silod's collectives keep NCCL's rules, checked on a machine without a GPU.

NCCL reduces CUDA tensors only. A GPU job's group must therefore serve the CPU as well for the
few flags silod exchanges at every step boundary; before this was so, every GPU job that used
``ctx.distributed`` died at its first all-reduce ("No backend type associated with device type
cpu"). The ``cudaonly`` backend (tests/support/cudaonly_backend.py) refuses CPU tensors the same
way, and here it stands in for NCCL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from silod.job import devices
from silod.job.context import CHECKPOINT_FILE

ROOT = Path(__file__).resolve().parents[2]

JOB = r'''
import sys
import torch
import tests.support.cudaonly_backend  # registers "cudaonly": serves CUDA tensors only, as NCCL
import silod.job
from silod.job.distributed import Event

ctx = silod.job.init(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
trainer = ctx.distributed(model, optimizer, backend="cudaonly")
for _ in range(5):
    assert trainer.step_boundary() is Event.CONTINUE
    optimizer.zero_grad()
    trainer.model(torch.randn(4, 8)).pow(2).sum().backward()
    optimizer.step()
    trainer.step_done(4)
assert trainer.save()
ctx.done()
trainer.close()
print(f"trained {trainer.steps} steps in group {trainer.backend}", flush=True)
'''


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env=environ, cwd=ROOT)


def test_a_job_whose_accelerator_backend_refuses_cpu_tensors_trains_checkpoints_and_ends(tmp_path: Path) -> None:
    done = _run(JOB, str(tmp_path / "checkpoints"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 5 steps in group cpu:gloo,cuda:cudaonly" in done.stdout
    state = torch.load(tmp_path / "checkpoints" / CHECKPOINT_FILE, weights_only=False)
    assert state["steps"] == 5 and state["samples"] == 20


def test_the_stand_in_refuses_cpu_tensors_as_nccl_does() -> None:
    """The guard is real: a group of the stand-in alone fails on the kind of flag silod sends."""
    code = r'''
import torch, torch.distributed as dist
import tests.support.cudaonly_backend
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("cudaonly", store=store, rank=0, world_size=1)
try:
    dist.all_reduce(torch.tensor([1.0]))
except RuntimeError as exc:
    print("refused:", exc)
'''
    done = _run(code)
    assert "refused: No backend type associated with device type cpu" in done.stdout, done.stdout + done.stderr


def test_every_ddp_job_of_the_suite_names_the_stand_in() -> None:
    """tests/conftest.py: the agents pass these on to every rank the suite launches."""
    assert os.environ["SILOD_DIST_BACKEND"] == "cudaonly"
    assert os.environ["SILOD_DIST_BACKEND_MODULE"] == "tests.support.cudaonly_backend"
    assert devices.accelerator_backend(torch.device("cpu")) == "cudaonly"


@pytest.mark.parametrize(("backend", "group"), [
    ("gloo", "gloo"),
    ("nccl", "cpu:gloo,cuda:nccl"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    ("cuda:nccl", "cpu:gloo,cuda:nccl"),
])
def test_every_group_serves_the_cpu(backend: str, group: str) -> None:
    assert devices.group_backend(backend) == group


def test_an_unknown_backend_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="backend: 'nosuch' is not a registered"):
        devices.group_backend("nosuch")


def test_defaults_by_device_and_the_environment() -> None:
    assert devices.accelerator_backend(torch.device("cuda", 0), environ={}) == "nccl"
    assert devices.accelerator_backend(torch.device("cpu"), environ={}) == "gloo"
    assert devices.accelerator_backend(torch.device("cpu"), environ={"SILOD_DIST_BACKEND": "Gloo"}) == "gloo"
    assert devices.accelerator_backend(torch.device("cpu"), "nccl", environ={"SILOD_DIST_BACKEND": "gloo"}) == "nccl"
    assert devices.rank_device({"LOCAL_RANK": "3"}) == torch.device("cpu")  # no CUDA on this machine
