"""GPU telemetry and fatal faults end to end: `silod metadata`, `silod scheduler` and two
`silod worker-agent` processes whose NVML is the fake pynvml (tests/worker_agent/fake_nvml.py,
loaded through the agents' nvml_module test hook; the only mock). Checked through public
surfaces: the agents' /metrics, the metadata service, `silod nodes` and the jobs' logs.

One scenario, in order: figures sampled and exported; sent with the heartbeat and shown by
`silod nodes`; a critical Xid under a running job takes the GPU out of use and the job resumes
from its checkpoint on the other node; an ECC fault takes another GPU; a job that needs the
faulted node waits; `silod nodes clear-gpu-fault` (bad input refused, naming the field) brings
the GPUs back without a restart, and the waiting job runs on them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from silod.v1 import (common_pb2, metadata_pb2, metadata_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_agent_pb2,
                      worker_agent_pb2_grpc)
from tests.support.procs import REPO_ROOT, ServiceProcess, free_port, start_service
from tests.worker_agent.conftest import wait_until
from tests.worker_agent.fake_nvml import STATE_ENV, gpu, write_state

HOOK = "tests.worker_agent.fake_nvml:nvml"


class Node:
    """One agent and the state its fake NVML answers from."""

    def __init__(self, root: Path, name: str, md: str, scheduler: str) -> None:
        self.name = name
        self.state_file = root / f"nvml-{name}.json"
        # GPU 1 has no temperature sensor and no ECC: those series must simply be absent.
        self.state: dict[str, Any] = {"gpus": [gpu(util=37, temp=41), gpu(util=80, unsupported=["temperature", "ecc"])],
                                      "events": []}
        self.write()
        self.work_dir = root / f"agent-{name}"
        self.metrics_port = free_port()
        self.proc: ServiceProcess = start_service(
            "worker-agent", "--metadata-address", md, "--scheduler-address", scheduler, "--node-name", name,
            "--nvml-module", HOOK, "--gpus", "8",  # NVML's count (2) wins over the configured one
            "--work-dir", str(self.work_dir), "--checkpoint-root", str(root / "checkpoints"),
            "--heartbeat-s", "0.3", "--report-s", "0.3", "--checkpoint-deadline-s", "10", "--stop-grace-s", "5",
            "--metrics-port", str(self.metrics_port), "--log-level", "warning",
            env={STATE_ENV: str(self.state_file), "PYTHONPATH": str(REPO_ROOT)}, workdir=root / f"agent-{name}-proc")

    def write(self) -> None:
        write_state(self.state_file, self.state)

    def xid(self, index: int, xid: int) -> None:
        self.state["events"].append({"id": len(self.state["events"]) + 1, "gpu": index, "xid": xid})
        self.write()

    def metrics(self) -> dict[tuple[str, str], float]:
        """(metric, gpu) -> value of this node's silod_gpu_* series."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("silod_gpu_") and sample.labels.get("node") == self.name:
                    found[(sample.name, sample.labels["gpu"])] = sample.value
        return found


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with start_service("metadata", "--db", f"sqlite:///{tmp_path / 'm.db'}", "--log-level", "warning",
                       workdir=tmp_path / "md") as md, \
         start_service("scheduler", "--metadata-address", md.address, "--interval-s", "1", "--restart-cost-s", "1",
                       "--log-level", "warning", workdir=tmp_path / "sch") as sch:
        nodes = [Node(tmp_path, name, md.address, sch.address) for name in ("n1", "n2")]
        try:
            with grpc.insecure_channel(md.address) as c1, grpc.insecure_channel(sch.address) as c2:
                yield {"md": metadata_pb2_grpc.MetadataServiceStub(c1), "jobs": scheduler_pb2_grpc.JobServiceStub(c2),
                       "md_address": md.address, "nodes": {n.name: n for n in nodes}, "root": tmp_path}
        finally:
            for n in nodes:
                n.proc.close()


def _silod(cluster: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "silod.cli", *args, "--metadata", cluster["md_address"]],
                          capture_output=True, text=True, timeout=60)


def _node(cluster: dict[str, Any], name: str) -> common_pb2.Node:
    return cluster["md"].GetNode(metadata_pb2.GetNodeRequest(node=name), timeout=10)


def _faults(cluster: dict[str, Any], name: str) -> dict[int, str]:
    return {f.index: f.reason for f in _node(cluster, name).gpu_faults}


def _job(cluster: dict[str, Any], job_id: str) -> common_pb2.Job:
    return cluster["md"].GetJob(metadata_pb2.GetJobRequest(job_id=job_id), timeout=10)


def _placement(cluster: dict[str, Any], job_id: str) -> list[tuple[str, list[int]]]:
    try:
        plan = cluster["md"].GetLatestPlan(metadata_pb2.GetLatestPlanRequest(), timeout=10)
    except grpc.RpcError:
        return []
    return [(p.node, sorted(p.gpu_indices)) for e in plan.jobs if e.job_id == job_id for p in e.placements]


def _submit(cluster: dict[str, Any], name: str) -> str:
    spec = common_pb2.JobSpec(name=name, application="cifar10", min_gpus=2, max_gpus=2, batch_size=16,
                              sample_budget=50_000_000, emulated_step_compute_s=0.02,
                              env={"SILOD_CHECKPOINT_EVERY_S": "0.5"})
    return cluster["jobs"].SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30).id


def _log(cluster: dict[str, Any], node: str, job_id: str) -> str:
    path = cluster["nodes"][node].work_dir / "jobs" / job_id / "rank-0.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_gpu_figures_faults_requeue_and_clear(cluster: dict[str, Any]) -> None:
    n1, n2 = cluster["nodes"]["n1"], cluster["nodes"]["n2"]

    # -- figures: from NVML, per GPU, exported and sent with the heartbeat ------------------------
    node = wait_until(lambda: (n := _node(cluster, "n1")).gpu_telemetry and n, what="n1's GPU figures")
    assert (node.spec.gpus, node.spec.gpu_model, node.spec.gpu_type) == (2, "NVIDIA A100-SXM4-40GB", "a100")
    first, second = node.gpu_telemetry
    assert (first.utilization_ratio, first.temperature_celsius, first.ecc_uncorrectable_errors) == (0.37, 41.0, 0)
    assert (first.memory_used_bytes, first.memory_total_bytes) == (3 * 2**30, 40 * 2**30)
    assert second.utilization_ratio == 0.8 and not second.HasField("temperature_celsius") \
        and not second.HasField("ecc_uncorrectable_errors")
    metrics = wait_until(lambda: (m := n1.metrics()) and ("silod_gpu_utilization_ratio", "1") in m and m,
                         what="n1's GPU metrics")
    assert metrics[("silod_gpu_utilization_ratio", "0")] == 0.37
    assert metrics[("silod_gpu_memory_used_bytes", "0")] == 3 * 2**30
    assert metrics[("silod_gpu_memory_total_bytes", "1")] == 40 * 2**30
    assert metrics[("silod_gpu_temperature_celsius", "0")] == 41
    assert metrics[("silod_gpu_ecc_uncorrectable_errors", "0")] == 0
    assert ("silod_gpu_temperature_celsius", "1") not in metrics and ("silod_gpu_ecc_uncorrectable_errors", "1") not in metrics
    assert metrics[("silod_gpu_healthy", "0")] == metrics[("silod_gpu_healthy", "1")] == 1
    # The figures move with the GPUs.
    n1.state["gpus"][0]["util"] = 90
    n1.write()
    wait_until(lambda: n1.metrics()[("silod_gpu_utilization_ratio", "0")] == 0.9, what="a new sample exported")
    wait_until(lambda: _node(cluster, "n1").gpu_telemetry[0].utilization_ratio == 0.9, what="a new sample sent")

    table = _silod(cluster, "nodes")
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split()[-3:] == ["UTIL", "GPU-MEM", "FAULTED"]
    assert re.search(r"^n1 .* 85% +6\.0 GiB/80\.0 GiB -$", table.stdout, re.M), table.stdout
    rows = {r["name"]: r for r in map(json.loads, _silod(cluster, "nodes", "--json").stdout.splitlines())}
    assert rows["n2"]["gpu_utilization_ratio"] == pytest.approx(0.585) and rows["n2"]["gpu_faults"] == []
    assert rows["n1"]["gpu_telemetry"][1]["utilization_ratio"] == 0.8

    # -- an Xid under a running job: the GPU leaves, the job resumes from its checkpoint ---------
    job = _submit(cluster, "victim")
    wait_until(lambda: _job(cluster, job).state == common_pb2.JOB_STATE_RUNNING, timeout=60, what="the job running")
    (where, gpus), = _placement(cluster, job)
    assert gpus == [0, 1]
    other = "n2" if where == "n1" else "n1"
    wait_until(lambda: "checkpointed" in _log(cluster, where, job) or
               (cluster["root"] / "checkpoints" / job / "checkpoints.jsonl").exists(), timeout=60,
               what="a first checkpoint")
    victim = cluster["nodes"][where]
    victim.xid(1, 13)   # an application's illegal memory access: not the GPU's fault
    victim.xid(1, 79)   # fallen off the bus
    wait_until(lambda: _faults(cluster, where) == {1: "Xid 79"}, timeout=30, what="the Xid recorded")
    wait_until(lambda: _placement(cluster, job) == [(other, [0, 1])], timeout=60, what="the job moved off the fault")
    resumed = wait_until(lambda: re.search(r"emulated: resumed at samples=(\d+)", _log(cluster, other, job)),
                         timeout=60, what="the job resumed on the other node")
    assert int(resumed.group(1)) > 0, "resumed from the checkpoint, not from the start"
    assert "checkpointed at samples=" in _log(cluster, where, job)  # the stop on the faulted node saved it
    assert victim.metrics()[("silod_gpu_healthy", "1")] == 0 and victim.metrics()[("silod_gpu_healthy", "0")] == 1
    assert victim.metrics()[("silod_gpu_xid_faults_total", "1")] == 1  # Xid 13 not counted
    with grpc.insecure_channel(victim.proc.address) as channel:  # the agent's own view, as of its last heartbeat
        status = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel).GetNodeStatus(
            worker_agent_pb2.GetNodeStatusRequest(), timeout=10)
    assert {f.index: f.reason for f in status.gpu_faults} == {1: "Xid 79"} and len(status.gpu_telemetry) == 2

    # -- new uncorrectable ECC errors take GPU 0 of that node too ---------------------------------
    victim.state["gpus"][0]["ecc"] = 3
    victim.write()
    wait_until(lambda: _faults(cluster, where) == {0: "3 uncorrectable ECC errors", 1: "Xid 79"}, timeout=30,
               what="the ECC fault recorded")
    table = _silod(cluster, "nodes").stdout
    assert re.search(rf"^{where} .* 0,1$", table, re.M), table
    assert f"  {where}:1  Xid 79  (since" in table and f"  {where}:0  3 uncorrectable ECC errors" in table
    assert "silod nodes clear-gpu-fault NODE GPU_INDEX" in table

    # A second job needs two GPUs: the healthy node's are taken, the faulted node has none: it waits.
    waiting = _submit(cluster, "waiting")
    wait_until(lambda: _job(cluster, waiting).state == common_pb2.JOB_STATE_PENDING, what="the second job queued")

    # -- the operator's command: bad input named, then the GPUs come back -----------------------
    for args, code, field in ((("nosuch", "0"), "NOT_FOUND", "node"), ((where, "7"), "INVALID_ARGUMENT", "gpu_index")):
        bad = _silod(cluster, "nodes", "clear-gpu-fault", *args)
        assert bad.returncode == 1 and bad.stderr.startswith(f"silod: {code}") and f"{field}:" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr
    bad = _silod(cluster, "nodes", "clear-gpu-fault", where, "-1")
    assert bad.returncode == 2 and "GPU_INDEX" in bad.stderr and "Traceback" not in bad.stderr
    done = _silod(cluster, "nodes", "clear-gpu-fault", where, "1")
    assert done.returncode == 0 and f"GPU 1 of {where} is back in use" in done.stdout, done.stderr
    again = _silod(cluster, "nodes", "clear-gpu-fault", where, "1")
    assert again.returncode == 1 and again.stderr.startswith("silod: FAILED_PRECONDITION") and "gpu_index:" in again.stderr
    assert _job(cluster, waiting).state == common_pb2.JOB_STATE_PENDING  # one usable GPU there: not enough
    assert _silod(cluster, "nodes", "clear-gpu-fault", where, "0").returncode == 0
    wait_until(lambda: _placement(cluster, waiting) == [(where, [0, 1])], timeout=60,
               what="the waiting job placed on the cleared GPUs")
    wait_until(lambda: _job(cluster, waiting).state == common_pb2.JOB_STATE_RUNNING, timeout=60, what="it runs")
    # The accepted ECC count (3, still reported) does not fault the GPU again; the gauges agree.
    assert not _faults(cluster, where)
    wait_until(lambda: victim.metrics()[("silod_gpu_healthy", "0")] == victim.metrics()[("silod_gpu_healthy", "1")] == 1,
               what="the agent's gauges back to healthy")
    assert victim.metrics()[("silod_gpu_ecc_uncorrectable_errors", "0")] == 3
    for job_id in (job, waiting):
        cluster["jobs"].CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id), timeout=10)
