"""`pip install silod` (no extras) is enough for a training job: the wheel installed alone into a
fresh virtual environment runs a job script that uses silod.job and silod.data against a cluster
started from the full install, reading its dataset through the node's cache server.

The client environment gets torch the way a job image does (the job's own dependency, from this
machine's CPU build) and nothing of the server's: no sqlalchemy, alembic, scipy, psycopg2,
prometheus_client or pydantic. About half a minute, most of it pip. The other Pythons the
package supports are tested without torch in test_sdk_pythons."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from silod.v1 import cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.client_install.installs import Cluster, client_env, installed_distributions, pip_install
from tests.e2e.harness import TERMINAL, wait_until

SERVER_ONLY = ("sqlalchemy", "alembic", "scipy", "psycopg2-binary", "prometheus-client", "pydantic", "matplotlib")
FILES = 64

JOB_SCRIPT = r'''
"""A job owner's script: silod.job for progress, silod.data to read the dataset through the cache."""
import hashlib, os, sys
import torch.utils.data
import silod, silod.job
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
print(f"client-job: {count} samples digest {digest:016x} python {sys.prefix} silod {silod.__file__}", flush=True)
ctx.done()
'''


@pytest.fixture(scope="module")
def client_python(silod_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment with the silod wheel (no extras) and the job's torch."""
    root = tmp_path_factory.mktemp("client-install")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    for requirement in (str(silod_wheel), "torch==2.13.0"):  # torch: what a job image brings itself
        pip_install(python, requirement)
    yield python


def test_the_client_install_has_none_of_the_servers_dependencies(client_python: Path) -> None:
    installed = installed_distributions(client_python)
    assert "silod" in installed and "grpcio" in installed
    assert installed.isdisjoint(SERVER_ONLY), installed & set(SERVER_ONLY)
    # A server command from the client install says what to install instead of failing obscurely.
    silod = client_python.parent / "silod"
    done = subprocess.run([str(silod), "metadata"], capture_output=True, text=True, timeout=60, env=client_env())
    assert done.returncode == 2 and "pip install 'silod[server]'" in done.stderr and "Traceback" not in done.stderr
    assert subprocess.run([str(silod), "submit", "--help"], capture_output=True, timeout=60,
                          env=client_env()).returncode == 0


def test_a_job_from_the_client_install_reads_through_the_cache(client_python: Path, sdk_cluster: Cluster,
                                                                tmp_path: Path) -> None:
    expected = sdk_cluster.dataset("client-data", FILES, 3000, seed=3)
    script = tmp_path / "train.py"
    script.write_text(JOB_SCRIPT)
    with grpc.insecure_channel(sdk_cluster.scheduler) as channel:
        jobs = scheduler_pb2_grpc.JobServiceStub(channel)
        job = jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(
            name="client-install", min_gpus=1, max_gpus=1, batch_size=8, sample_budget=FILES,
            dataset="client-data", command=[str(client_python), str(script)])), timeout=30)
        done = wait_until(lambda: (j := jobs.GetJob(metadata_pb2.GetJobRequest(job_id=job.id), timeout=10))
                          .state in TERMINAL and j, 120, "the client job to finish")
    log = sdk_cluster.rank_log(job.id)
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED, log
    venv = client_python.parent.parent
    assert f"client-job: {FILES} samples digest {expected:016x} python {venv} silod {venv}/lib/" in log, log
    assert done.progress.samples_done == FILES
    with grpc.insecure_channel(sdk_cluster.cache) as channel:
        stats = cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.StatsRequest(job_id=job.id), timeout=5)
    # Every sample came through the cache server (some already prefetched on the sampler's hints).
    assert stats.jobs and stats.jobs[0].hits + stats.jobs[0].misses == FILES
    assert stats.jobs[0].remote_bytes == FILES * 3000
