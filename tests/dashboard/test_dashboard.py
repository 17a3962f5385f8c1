"""`silod dashboard` as a real process: what it reads and who may read it. The page in Chromium is
checked on a live `silod up` cluster in tests/cli_cluster/test_up_and_jobs.py (which starts one
anyway), with the helpers in tests/dashboard/browser.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2
from tests.dashboard.browser import TOKEN
from services.dashboard.history import History
from tests.support.procs import ServiceProcess, start_service

AUTH = {"Authorization": f"Bearer {TOKEN}"}


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
            # A second plan shrinks the first job to 2 GPUs (generation 2): a resize on its timeline.
            plan.version = 2
            plan.reason = "resize"
            del entry.placements[1]
            entry.generation = 2
            del plan.loans[:]
            plan.created_at.GetCurrentTime()
            stub.CommitPlan(metadata_pb2.CommitPlanRequest(plan=plan))
            stub.AppendJobEvent(metadata_pb2.AppendJobEventRequest(job_id=jobs[0].id, type="resize",
                                                                   message="resized by plan 2"))
            samples = []
            for i, (throughput, step) in enumerate(((100.0, 0.16), (120.0, 0.13), (90.0, 0.18))):
                for name, value in (("samples_per_s", throughput), ("step_time_s", step)):
                    sample = common_pb2.MetricSample(job_id=jobs[0].id, name=name, value=value, labels={"rank": "0"})
                    sample.time.FromSeconds(int(time.time()) - 30 + 10 * i)
                    samples.append(sample)
            stub.AppendMetrics(metadata_pb2.AppendMetricsRequest(samples=samples))
        md.job_ids = [j.id for j in jobs]  # type: ignore[attr-defined]
        yield md


@pytest.fixture(scope="module")
def dashboard(metadata_with_cluster: ServiceProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp_path = tmp_path_factory.mktemp("dashboard")
    with start_service("dashboard", "--metadata-address", metadata_with_cluster.address, "--auth-token", TOKEN,
                       "--cache-timeout-s", "0.5", "--history-interval-s", "0.2", "--log-level", "warning",
                       workdir=tmp_path) as dash:
        yield f"http://{dash.address}"


def test_overview_labels_training_lent_and_idle_gpus_and_unreachable_caches(dashboard: str) -> None:
    status, _, body = _get(f"{dashboard}/api/overview", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, body
    data = json.loads(body)
    assert data["latest_plan_version"] == 2
    assert data["gpu_totals"] == {"idle": 1, "training": 2, "lent": 0, "inference": 0, "faulted": 1}
    nodes = {n["name"]: n for n in data["nodes"]}
    assert [g["use"] for g in nodes["train-0"]["gpus"]] == ["training", "training"]
    assert [g["use"] for g in nodes["infer-0"]["gpus"]] == ["faulted", "idle"]
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
    assert jobs["<b>bold</b>"]["gpus"] == 2 and jobs["queued"]["gpus"] == 0
    assert [p["loans"] for p in data["plans"]] == [0, 1]


def test_token_is_required_except_for_health(dashboard: str) -> None:
    for path in ("/", "/api/overview", "/metrics", "/static/app.js", "/api/history", "/api/job/job-1",
                 "/job/job-1", "/static/vendor/uplot/uPlot.iife.min.js"):
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


def test_history_samples_the_overview_for_the_charts(dashboard: str) -> None:
    deadline = time.monotonic() + 30
    while True:  # a sample every 0.2 s
        status, _, body = _get(f"{dashboard}/api/history", AUTH)
        assert status == 200, body
        h = json.loads(body)
        if len(h["times"]) >= 3:
            break
        assert time.monotonic() < deadline, h
    n = len(h["times"])
    assert h["interval_s"] == 0.2 and h["capacity"] == 18000 and h["times"] == sorted(h["times"])
    assert h["idle_gpus"] == [1] * n and h["pending_jobs"] == [2] * n  # nothing moved the jobs from PENDING
    [job] = h["gpus_by_job"]
    assert (job["name"], job["tenant"], job["values"]) == ("<b>bold</b>", "default", [2] * n)
    assert h["gpus_by_tenant"] == [{"tenant": "default", "values": [2] * n}]
    # train-0's GPUs report utilisation (mean 0.375); infer-0's do not: the chart says so.
    assert h["gpu_utilization_by_node"] == [{"node": "train-0", "values": [0.375] * n}]
    assert h["nodes_without_gpu_figures"] == ["infer-0"]
    assert h["cache_hit_ratio_by_job"] == [] and h["remote_io_bytes_per_s_by_job"] == []  # no cache server answers
    recent = json.loads(_get(f"{dashboard}/api/history?window_s=0.3", AUTH)[2])
    assert 1 <= len(recent["times"]) < len(json.loads(_get(f"{dashboard}/api/history", AUTH)[2])["times"])
    for bad in ("0", "-1", "nan", "inf", "soon"):
        status, _, body = _get(f"{dashboard}/api/history?window_s={bad}", AUTH)
        assert status == 400 and "window_s" in json.loads(body)["error"], (bad, body)


def test_history_is_a_bounded_ring() -> None:
    history = History(window_s=10, interval_s=2)
    assert history.capacity == 5
    for t in range(8):
        history.add({"generated_at": float(t), "gpu_totals": {"idle": t}, "nodes": [],
                     "jobs": [{"id": f"job-{t}", "name": f"j{t}", "tenant": "a", "state": "running", "gpus": 1}]})
    series = history.series()
    assert series["times"] == [3.0, 4.0, 5.0, 6.0, 7.0] and series["idle_gpus"] == [3, 4, 5, 6, 7]
    assert [j["id"] for j in series["gpus_by_job"]] == [f"job-{t}" for t in range(3, 8)]
    assert sorted(history.names) == [f"job-{t}" for t in range(3, 8)]  # names of dropped jobs go too


def test_job_detail_has_events_plans_and_throughput(dashboard: str, metadata_with_cluster: ServiceProcess) -> None:
    job_id = metadata_with_cluster.job_ids[0]  # type: ignore[attr-defined]
    status, _, body = _get(f"{dashboard}/api/job/{job_id}", AUTH)
    assert status == 200, body
    data = json.loads(body)
    assert (data["job"]["id"], data["job"]["name"], data["job"]["state"]) == (job_id, "<b>bold</b>", "pending")
    assert [e["type"] for e in data["events"]][-1] == "resize" and data["events"][-1]["message"] == "resized by plan 2"
    assert [(p["version"], p["gpus"], p["generation"]) for p in data["plans"]] == [(1, 3, 1), (2, 2, 2)]
    assert data["plans"][0]["nodes"] == ["infer-0", "train-0"] and data["plans_scanned"] == 2
    assert data["metrics"]["samples_per_s"]["values"] == [100.0, 120.0, 90.0]
    assert data["metrics"]["step_time_s"]["values"] == [0.16, 0.13, 0.18]
    assert data["metrics"]["samples_per_s"]["times"] == sorted(data["metrics"]["samples_per_s"]["times"])
    assert data["logs_command"] == f"silod logs {job_id}"
    status, headers, page = _get(f"{dashboard}/job/{job_id}", AUTH)
    assert status == 200 and b"/static/job.js" in page


def test_bad_job_ids_are_400_or_404_naming_the_parameter(dashboard: str) -> None:
    for path in ("/api/job/", "/job/"):
        status, _, body = _get(f"{dashboard}{path}job-000000000000", AUTH)
        assert status == 404 and b"job_id" in body and b"job-000000000000" in body, (path, body)
        for bad in (".hidden", "-rf", "a%20b", "x" * 65, "%C3%A9t%C3%A9"):
            status, _, body = _get(f"{dashboard}{path}{bad}", AUTH)
            assert status == 400 and b"job_id" in body and b"Traceback" not in body, (path, bad, body)
    assert json.loads(_get(f"{dashboard}/api/job/.hidden", AUTH)[2])["error"].startswith("job_id: a job id")
