"""silod.job.broadcast: a state dict sent from rank 0 arrives on the other ranks byte for byte,
tensors of every dtype included, over a real gloo process group of three processes."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import pickle, sys
from datetime import timedelta
import torch, torch.distributed as dist
from silod.job.broadcast import broadcast_state

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=3)


def state():
    torch.manual_seed(7)
    model = torch.nn.Linear(5, 3)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 5)).sum().backward()
    adam.step()
    return {
        "optimizer": adam.state_dict(),  # 0-dim float "step" tensors next to 2-d ones
        "sampler": {"epoch": 2, "consumed": 96, "order": [3, 1, 2]},
        "odd": (torch.tensor([True, False]), torch.arange(6, dtype=torch.int16).view(2, 3),
                torch.tensor([1.5, -2.25], dtype=torch.bfloat16), torch.zeros(0, 4), torch.tensor(3.0, dtype=torch.float64)),
        "steps": 11,
    }


got = broadcast_state(state() if rank == 0 else None, src=0)
with open(out, "wb") as f:  # rank 0: what it sent
    pickle.dump(got, f)
if rank != 0:
    # Loads into a fresh optimizer as a checkpoint would.
    model = torch.nn.Linear(5, 3)
    torch.optim.Adam(model.parameters(), lr=0.01).load_state_dict(got["optimizer"])
# Nobody tears the group down while a peer may still be inside the broadcast: rank 0, the sender
# and the store's host, finished first and once aborted at exit ("terminate called without an
# active exception", SIGABRT) in a CI run without this barrier.
dist.barrier()
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flatten(value, path=""):  # type: ignore[no-untyped-def]
    import torch

    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(v, f"{path}/{k}")
    elif isinstance(value, (list, tuple)):
        yield path, type(value).__name__, len(value)
        for i, v in enumerate(value):
            yield from _flatten(v, f"{path}/{i}")
    elif isinstance(value, torch.Tensor):
        yield path, str(value.dtype), tuple(value.shape), value.reshape(-1).view(torch.uint8).tolist() \
            if value.numel() else []
    else:
        yield path, repr(value)


def test_every_rank_receives_rank_0s_state_byte_for_byte(tmp_path: Path) -> None:
    import pickle

    script = tmp_path / "bcast.py"
    script.write_text(SCRIPT)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(tmp_path / f"got-{r}.pkl")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(3)]
    outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    sent = list(_flatten(pickle.loads((tmp_path / "got-0.pkl").read_bytes())))
    assert any("bfloat16" in str(item) for item in sent) and any("torch.bool" in str(item) for item in sent)
    for rank in (1, 2):
        got = pickle.loads((tmp_path / f"got-{rank}.pkl").read_bytes())
        assert list(_flatten(got)) == sent
        assert isinstance(got["odd"], tuple) and got["steps"] == 11
