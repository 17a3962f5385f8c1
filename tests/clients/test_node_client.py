"""A client in another language, built from protos/ alone, drives silod end to end.

clients/node/silod-client.mjs loads the .proto files at run time with @grpc/proto-loader and
calls the scheduler's JobService with @grpc/grpc-js: it submits a job, watches it to completion
and lists datasets, against a cluster of real processes (metadata, scheduler, one worker agent).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from silod.v1 import common_pb2
from tests.clients.node_tools import node_client_ready
from tests.e2e.harness import wait_until

TIMEOUT_S = 120


def _node(client: Path, scheduler: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["node", str(client / "silod-client.mjs"), "--scheduler", scheduler, *args],
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_node_client_submits_watches_and_lists_datasets(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client = node_client_ready()
    cluster = make_cluster("sqlite", nodes=1, gpus_per_node=2)
    store = tmp_path / "digits"
    store.mkdir()
    for i in range(3):
        (store / f"sample-{i}.bin").write_bytes(bytes([i]) * 100)
    registered = subprocess.run(
        [str(Path(sys.executable).parent / "silod"), "dataset", "register", "digits", store.as_uri(),
         "--metadata", cluster.metadata.address], capture_output=True, text=True, timeout=60)
    assert registered.returncode == 0, registered.stderr

    # 40 steps of 0.1 s: still running when the watch below starts.
    submitted = _node(client, cluster.scheduler_address, "submit", "from-node", "--gpus", "2", "--samples", "1280",
                      "--batch-size", "32", "--step-compute-s", "0.1", "--request-id", "node-1")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.startswith("job-")
    again = _node(client, cluster.scheduler_address, "submit", "from-node", "--gpus", "2", "--samples", "1280",
                  "--batch-size", "32", "--step-compute-s", "0.1", "--request-id", "node-1")
    assert again.stdout.strip() == job_id, "the idempotency key works from Node too"

    watched = _node(client, cluster.scheduler_address, "watch", job_id)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    lines = watched.stdout.strip().splitlines()
    assert lines[-1].startswith(f"{job_id} JOB_STATE_SUCCEEDED samples_done=1280")
    assert any("JOB_STATE_RUNNING" in line for line in lines)
    job = wait_until(lambda: cluster.job(job_id), 10, "the job")
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED and job.spec.min_gpus == 2

    listed = _node(client, cluster.scheduler_address, "datasets")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split()[:2] == ["digits", store.as_uri()]
    assert "objects=3 bytes=300" in listed.stdout

    # A refusal reaches the Node user with its code and the field it names.
    bad = _node(client, cluster.scheduler_address, "watch", "job-does-not-exist")
    assert bad.returncode == 1
    assert "NOT_FOUND" in bad.stderr and "job_id" in bad.stderr
