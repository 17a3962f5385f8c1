"""One real silod cluster for the robustness tests: every service as its own process, started
by the product's launcher as `silod up` starts them (metadata on SQLite, estimator, scheduler,
one node's cache server and worker agent), holding a registered dataset, a submitted job, a
fitted model, a lease and a log, so that requests naming them reach past validation.

The worker agent runs without a scheduler address: it serves WorkerAgentService but launches
no task, so jobs the fuzzer happens to submit never run programs on this machine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from silod.manifest import list_objects
from silod.rpc.channels import wait_for_ready
from silod.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    estimator_pb2,
    estimator_pb2_grpc,
    metadata_pb2,
    metadata_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.support.procs import ServiceProcess, start_service

NODE = "node-0"
DATASET = "fuzz-digits"
APPLICATION = "cifar10"


@dataclass
class Cluster:
    procs: dict[str, ServiceProcess]
    work_dir: Path
    job_id: str = ""
    lease_id: str = ""
    keys: list[str] = field(default_factory=list)

    def address(self, name: str) -> str:
        return self.procs[name].address

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{proc.log()[-3000:]}" for name, proc in self.procs.items())


def _dataset_dir(root: Path) -> Path:
    data = root / "dataset"
    for i in range(6):
        path = data / f"class-{i % 2}" / f"sample-{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(hashlib.sha256(str(i).encode()).digest() * (i + 1))
    return data


def _seed(cluster: Cluster, data: Path) -> None:
    """A dataset, a job, a fitted model of it, a lease and a task log: things to name."""
    with grpc.insecure_channel(cluster.address("metadata")) as channel:
        md = metadata_pb2_grpc.MetadataServiceStub(channel)
        uri = data.as_uri()
        objects = list(list_objects(uri))
        cluster.keys = [o.key for o in objects]
        md.RegisterDataset(iter([metadata_pb2.RegisterDatasetRequest(
            spec=common_pb2.DatasetSpec(name=DATASET, uri=uri), objects=objects)]), timeout=30)
    with grpc.insecure_channel(cluster.address("scheduler")) as channel:
        spec = common_pb2.JobSpec(name="fuzz target", application=APPLICATION, dataset=DATASET, min_gpus=1, max_gpus=2,
                                  batch_size=64, epochs=1)
        job = scheduler_pb2_grpc.JobServiceStub(channel).SubmitJob(
            scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id="fuzz-target"), timeout=30)
        cluster.job_id = job.id
    with grpc.insecure_channel(cluster.address("estimator")) as channel:
        estimator_pb2_grpc.EstimatorServiceStub(channel).Observe(estimator_pb2.ObserveRequest(
            job_id=cluster.job_id, application=APPLICATION,
            observations=[estimator_pb2.StepObservation(gpus=1, nodes=1, batch_size=64, step_time_s=0.1)]), timeout=60)
    with grpc.insecure_channel(cluster.address("cache-server")) as channel:
        lease = cache_pb2_grpc.CacheServiceStub(channel).Lease(cache_pb2.LeaseRequest(
            job_id=cluster.job_id, dataset=DATASET, keys=cluster.keys[:2], lease_s=600), timeout=30)
        cluster.lease_id = lease.lease_id
    log = cluster.work_dir / "jobs" / cluster.job_id / "rank-0.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"step {i} loss {1 / (i + 1):.3f}\n" for i in range(200)))


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("robustness")
    logs = root / "logs"
    work_dir = root / "agent"
    procs: dict[str, ServiceProcess] = {}
    quiet = ("--log-level", "warning")

    def start(name: str, command: str, *flags: str) -> ServiceProcess:
        proc = procs[name] = start_service(command, *flags, *quiet, workdir=logs, timeout_s=60)
        return proc

    try:
        md = start("metadata", "metadata", "--db", f"sqlite:///{root / 'metadata.db'}").address
        with ThreadPoolExecutor(2) as side:  # independent starts side by side, as `silod up` does
            est = side.submit(start, "estimator", "estimator", "--metadata-address", md).result().address
            sch = start("scheduler", "scheduler", "--metadata-address", md, "--estimator-address", est).address
            cache = side.submit(
                start, "cache-server", "cache-server", "--metadata-address", md, "--node", NODE,
                "--scheduler-address", sch, "--disk-cache-dir", str(root / "cache-disk"),
                "--disk-cache-bytes", str(64 << 20), "--memory-cache-bytes", "0")
            cache_address = cache.result().address
        start("worker-agent", "worker-agent", "--node-name", NODE, "--gpus", "4", "--work-dir", str(work_dir),
              "--metadata-address", md, "--cache-address", cache_address)
        for proc in procs.values():
            wait_for_ready(proc.address, 30)
        cluster = Cluster(procs, work_dir)
        _seed(cluster, _dataset_dir(root))
        yield cluster
    finally:
        for name in ("worker-agent", "cache-server", "scheduler", "estimator", "metadata"):
            if name in procs:
                try:
                    procs[name].terminate(timeout=20)
                finally:
                    procs[name].close()
