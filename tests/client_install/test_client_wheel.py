"""`pip install silod` (no extras) is enough for a training job: the wheel installed alone into a
fresh virtual environment runs a job script that uses silod.job and silod.data against a cluster
started from the full install, reading its dataset through the node's cache server.

The client environment gets torch the way a job image does (the job's own dependency, from this
machine's CPU build) and nothing of the server's: no sqlalchemy, alembic, scipy, psycopg2,
prometheus_client or pydantic. About half a minute, most of it pip."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from silod.v1 import cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.cache_server.harness import make_dataset, register
from tests.client_install.boundary import ROOT
from tests.e2e.harness import TERMINAL, wait_until
from tests.support.procs import free_port, start_service

SERVER_ONLY = ("sqlalchemy", "alembic", "scipy", "psycopg2-binary", "prometheus-client", "pydantic", "matplotlib")
FILES = 64

JOB_SCRIPT = r'''
"""A job owner's script: silod.job for progress, silod.data to read the dataset through the cache."""
import hashlib, os, sys
import torch.utils.data
import silod.job
from silod.data import EpochShuffleSampler, SilodDataset

ctx = silod.job.init()
dataset = SilodDataset(os.environ["SILOD_DATASET"])
loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=EpochShuffleSampler(dataset, seed=1),
                                     collate_fn=list)
digest, count = 0, 0
for batch in loader:
    for sample in batch:
        digest ^= int.from_bytes(hashlib.sha256(sample).digest()[:8], "big")  # order-free: the sampler shuffles
    count += len(batch)
    ctx.report(samples=len(batch), steps=1, batch_size=8, step_time_s=0.01)
print(f"client-job: {count} samples digest {digest:016x} python {sys.prefix}", flush=True)
ctx.done()
'''


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment with the silod wheel (no extras) and the job's torch."""
    root = tmp_path_factory.mktemp("client-install")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "wheels"), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    wheel = next((root / "wheels").glob("silod-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    for requirement in (str(wheel), "torch==2.13.0"):  # torch: what a job image brings itself
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", requirement], capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    yield python


def _installed(python: Path) -> set[str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    return {p["name"].lower().replace("_", "-") for p in json.loads(out)}


def test_the_client_install_has_none_of_the_servers_dependencies(client_python: Path) -> None:
    installed = _installed(client_python)
    assert "silod" in installed and "grpcio" in installed
    assert installed.isdisjoint(SERVER_ONLY), installed & set(SERVER_ONLY)
    # A server command from the client install says what to install instead of failing obscurely.
    silod = client_python.parent / "silod"
    done = subprocess.run([str(silod), "metadata"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "pip install 'silod[server]'" in done.stderr and "Traceback" not in done.stderr
    assert subprocess.run([str(silod), "submit", "--help"], capture_output=True, timeout=60).returncode == 0


def test_a_job_from_the_client_install_reads_through_the_cache(client_python: Path, tmp_path: Path) -> None:
    files = make_dataset(tmp_path / "store", FILES, 3000, seed=3)
    expected = 0
    for data in files.values():
        expected ^= int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
    script = tmp_path / "train.py"
    script.write_text(JOB_SCRIPT)
    procs = []

    def start(*args: str, **kw):  # type: ignore[no-untyped-def]
        proc = start_service(*args, workdir=tmp_path / "logs", timeout_s=60, **kw)
        procs.append(proc)
        return proc

    try:
        md = start("metadata", "--db", f"sqlite:///{tmp_path / 'md.db'}", "--log-level", "warning")
        scheduler = f"127.0.0.1:{free_port()}"
        start("scheduler", "--metadata-address", md.address, "--policy", "fifo", "--interval-s", "0.5",
              "--log-level", "warning", port=int(scheduler.rsplit(":", 1)[1]))
        cache = start("cache-server", "--metadata-address", md.address, "--node", "n0",
                      "--disk-cache-dir", str(tmp_path / "disk"), "--memory-cache-bytes", "0", "--no-fsync",
                      "--log-level", "warning")
        agent = start("worker-agent", "--metadata-address", md.address, "--scheduler-address", scheduler,
                      "--node-name", "n0", "--gpus", "1", "--work-dir", str(tmp_path / "work"),
                      "--heartbeat-s", "0.5", "--report-s", "0.5", "--cache-address", cache.address,
                      "--log-level", "warning")
        register(md.address, "client-data", f"file://{tmp_path / 'store'}")
        with grpc.insecure_channel(scheduler) as channel:
            jobs = scheduler_pb2_grpc.JobServiceStub(channel)
            job = jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(
                name="client-install", min_gpus=1, max_gpus=1, batch_size=8, sample_budget=FILES,
                dataset="client-data", command=[str(client_python), str(script)])), timeout=30)
            done = wait_until(lambda: (j := jobs.GetJob(metadata_pb2.GetJobRequest(job_id=job.id), timeout=10))
                              .state in TERMINAL and j, 120, "the client job to finish")
        log = (tmp_path / "work" / "jobs" / job.id / "rank-0.log").read_text()
        assert done.state == common_pb2.JOB_STATE_SUCCEEDED, log
        assert f"client-job: {FILES} samples digest {expected:016x} python {client_python.parent.parent}" in log
        assert done.progress.samples_done == FILES
        with grpc.insecure_channel(cache.address) as channel:
            stats = cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.StatsRequest(job_id=job.id), timeout=5)
        # Every sample came through the cache server (some already prefetched on the sampler's hints).
        assert stats.jobs and stats.jobs[0].hits + stats.jobs[0].misses == FILES
        assert stats.jobs[0].remote_bytes == FILES * 3000
        assert agent.address
    finally:
        for proc in reversed(procs):
            proc.close()
