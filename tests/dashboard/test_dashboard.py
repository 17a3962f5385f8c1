"""`silod dashboard` as a real process: what it reads and who may read it. The page in Chromium is
checked on a live `silod up` cluster in tests/cli_cluster/test_up_and_jobs.py (which starts one
anyway), with the helpers in tests/dashboard/browser.py."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2
from tests.dashboard.browser import TOKEN
from tests.support.procs import ServiceProcess, start_service


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture(scope="module")
def metadata_with_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A metadata service holding a training node, an inference node, two jobs and a plan that lends a GPU
    (one for the module: the tests only read it)."""
    tmp_path = tmp_path_factory.mktemp("dash-metadata")
    with start_service("metadata", "--db", f"sqlite:///{tmp_path / 'm.db'}", "--log-level", "warning",
                       workdir=tmp_path) as md:
        with grpc.insecure_channel(md.address) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            stub.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
                name="train-0", gpus=2, pool=common_pb2.NODE_POOL_TRAINING, gpu_model="emulated", gpu_type="a100",
                agent_address="127.0.0.1:1", cache_address="127.0.0.1:1")))  # nobody listens there
            stub.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
                name="infer-0", gpus=2, pool=common_pb2.NODE_POOL_INFERENCE, gpu_model="emulated",
                agent_address="127.0.0.1:2")))
            # train-0's agent measures its GPUs (NVML); infer-0's reports a fatal fault of its idle GPU 0.
            stub.Heartbeat(metadata_pb2.HeartbeatRequest(node="train-0", gpu_telemetry=[
                common_pb2.GpuTelemetry(index=i, utilization_ratio=0.25 * (i + 1), memory_used_bytes=2 * 10**9,
                                        memory_total_bytes=40 * 10**9, temperature_celsius=50.0 + i,
                                        ecc_uncorrectable_errors=0) for i in range(2)]))
            stub.Heartbeat(metadata_pb2.HeartbeatRequest(node="infer-0", gpu_faults=[
                common_pb2.GpuFault(index=0, reason="Xid 79")]))
            jobs = [stub.CreateJob(metadata_pb2.CreateJobRequest(spec=common_pb2.JobSpec(
                name=name, application="cifar10", min_gpus=1, max_gpus=3, batch_size=16, sample_budget=1000)))
                for name in ("<b>bold</b>", "queued")]
            plan = plan_pb2.AllocationPlan(version=1, policy="fifo", cache_mode="silod", reason="arrival")
            entry = plan.jobs.add(job_id=jobs[0].id, batch_size=16, generation=1)
            entry.placements.add(node="train-0", gpu_indices=[0, 1])
            entry.placements.add(node="infer-0", gpu_indices=[1])
            plan.jobs.add(job_id=jobs[1].id, batch_size=16)
            plan.loans.add(node="infer-0", gpu_index=1, job_id=jobs[0].id)
            plan.created_at.GetCurrentTime()
            stub.CommitPlan(metadata_pb2.CommitPlanRequest(plan=plan))
        yield md


@pytest.fixture(scope="module")
def dashboard(metadata_with_cluster: ServiceProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp_path = tmp_path_factory.mktemp("dashboard")
    with start_service("dashboard", "--metadata-address", metadata_with_cluster.address, "--auth-token", TOKEN,
                       "--cache-timeout-s", "0.5", "--log-level", "warning", workdir=tmp_path) as dash:
        yield f"http://{dash.address}"


def test_overview_labels_training_lent_and_idle_gpus_and_unreachable_caches(dashboard: str) -> None:
    status, _, body = _get(f"{dashboard}/api/overview", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, body
    data = json.loads(body)
    assert data["latest_plan_version"] == 1
    assert data["gpu_totals"] == {"idle": 0, "training": 2, "lent": 1, "inference": 0, "faulted": 1}
    nodes = {n["name"]: n for n in data["nodes"]}
    assert [g["use"] for g in nodes["train-0"]["gpus"]] == ["training", "training"]
    assert [g["use"] for g in nodes["infer-0"]["gpus"]] == ["faulted", "lent"]
    assert nodes["infer-0"]["gpus"][0]["fault"] == "Xid 79" and nodes["infer-0"]["gpus"][0]["fault_since"] > 0
    # NVML figures per GPU and per node where the agent measures them; none for emulated GPUs.
    first = nodes["train-0"]["gpus"][0]
    assert (first["utilization_ratio"], first["memory_total_bytes"], first["temperature_celsius"]) == (0.25, 40 * 10**9, 50.0)
    assert first["ecc_uncorrectable_errors"] == 0 and "lost" not in first
    assert (nodes["train-0"]["gpu_utilization_ratio"], nodes["train-0"]["gpu_memory_used_bytes"],
            nodes["train-0"]["gpu_memory_total_bytes"]) == (0.375, 4 * 10**9, 80 * 10**9)
    assert nodes["infer-0"]["gpu_utilization_ratio"] is None and "utilization_ratio" not in nodes["infer-0"]["gpus"][1]
    assert nodes["infer-0"]["pool"] == "inference"
    assert (nodes["train-0"]["gpu_type"], nodes["infer-0"]["gpu_type"]) == ("a100", "")
    assert nodes["train-0"]["cache"]["reachable"] is False and "127.0.0.1:1" in nodes["train-0"]["cache"]["error"]
    assert nodes["infer-0"]["cache"] == {"reachable": False, "error": "no cache server on this node"}
    jobs = {j["name"]: j for j in data["jobs"]}
    assert jobs["<b>bold</b>"]["gpus"] == 3 and jobs["queued"]["gpus"] == 0
    assert [p["loans"] for p in data["plans"]] == [1]


def test_token_is_required_except_for_health(dashboard: str) -> None:
    for path in ("/", "/api/overview", "/metrics", "/static/app.js"):
        status, _, body = _get(f"{dashboard}{path}")
        assert status == 401 and b"token" in body, path
        assert _get(f"{dashboard}{path}", {"Authorization": "Bearer wrong"})[0] == 401
    assert _get(f"{dashboard}/healthz")[0] == 200
    status, headers, _ = _get(f"{dashboard}/?token={TOKEN}")
    assert status == 200 and "silod_token=" in headers.get("Set-Cookie", "")
    # The cookie the page got lets the browser's API polls through.
    status, _, _ = _get(f"{dashboard}/api/overview", {"Cookie": f"silod_token={TOKEN}"})
    assert status == 200
    status, _, metrics = _get(f"{dashboard}/metrics", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and b'silod_dashboard_requests_total{route="/api/overview",status="200"}' in metrics


def test_metadata_down_is_a_503_naming_it(tmp_path: Path) -> None:
    with start_service("dashboard", "--metadata-address", "127.0.0.1:9", "--log-level", "error",
                       workdir=tmp_path) as dash:
        status, _, body = _get(f"http://{dash.address}/api/overview")
    assert status == 503 and "127.0.0.1:9" in json.loads(body)["error"]


def test_missing_metadata_address_is_a_configuration_error() -> None:
    done = subprocess.run([sys.executable, "-m", "silod.cli", "dashboard"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "metadata_address" in done.stderr and "Traceback" not in done.stderr
