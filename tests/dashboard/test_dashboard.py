"""`silod dashboard` as a real process: what it reads, who may read it, and the page in Chromium."""

from __future__ import annotations

import json
import os
import shutil
import signal
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
from tests.support.procs import REPO_ROOT, ServiceProcess, start_service

TOKEN = "dash-token"
ARTIFACTS = REPO_ROOT / "build" / "test-artifacts"


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture
def metadata_with_cluster(tmp_path: Path) -> Iterator[ServiceProcess]:
    """A metadata service holding a training node, an inference node, two jobs and a plan that lends a GPU."""
    with start_service("metadata", "--db", f"sqlite:///{tmp_path / 'm.db'}", "--log-level", "warning",
                       workdir=tmp_path) as md:
        with grpc.insecure_channel(md.address) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            stub.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
                name="train-0", gpus=2, pool=common_pb2.NODE_POOL_TRAINING, gpu_model="emulated",
                agent_address="127.0.0.1:1", cache_address="127.0.0.1:1")))  # nobody listens there
            stub.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
                name="infer-0", gpus=2, pool=common_pb2.NODE_POOL_INFERENCE, gpu_model="emulated",
                agent_address="127.0.0.1:2")))
            for node in ("train-0", "infer-0"):
                stub.Heartbeat(metadata_pb2.HeartbeatRequest(node=node))
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


@pytest.fixture
def dashboard(metadata_with_cluster: ServiceProcess, tmp_path: Path) -> Iterator[str]:
    with start_service("dashboard", "--metadata-address", metadata_with_cluster.address, "--auth-token", TOKEN,
                       "--cache-timeout-s", "0.5", "--log-level", "warning", workdir=tmp_path) as dash:
        yield f"http://{dash.address}"


def test_overview_labels_training_lent_and_idle_gpus_and_unreachable_caches(dashboard: str) -> None:
    status, _, body = _get(f"{dashboard}/api/overview", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, body
    data = json.loads(body)
    assert data["latest_plan_version"] == 1
    assert data["gpu_totals"] == {"idle": 1, "training": 2, "lent": 1, "inference": 0}
    nodes = {n["name"]: n for n in data["nodes"]}
    assert [g["use"] for g in nodes["train-0"]["gpus"]] == ["training", "training"]
    assert [g["use"] for g in nodes["infer-0"]["gpus"]] == ["idle", "lent"]
    assert nodes["infer-0"]["pool"] == "inference"
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


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if path is None:
        message = "Chromium is not installed (Debian: apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must run the dashboard's browser test")
        pytest.skip(message)
    return path


def _browser(chromium: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    # --virtual-time-budget lets the page's fetch and rendering settle before the DOM is taken.
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=5000", *args, url],
                          capture_output=True, text=True, timeout=120)


def test_page_in_chromium_shows_a_live_cluster(tmp_path: Path) -> None:
    chromium = _chromium()
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env["SILOD_STATE_DIR"] = str(state)
    up = subprocess.Popen([sys.executable, "-m", "silod.cli", "up", "--nodes", "2", "--gpus-per-node", "2",
                           "--state-dir", str(state), "--interval-s", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (state / "cluster.json").exists():
            assert up.poll() is None, "silod up exited early"
            assert time.monotonic() < deadline, "silod up did not come up"
            time.sleep(0.2)
        cluster = json.loads((state / "cluster.json").read_text())
        job = tmp_path / "job.yaml"
        job.write_text("name: dash-job\napplication: cifar10\nmin_gpus: 1\nmax_gpus: 2\nbatch_size: 16\n"
                       "sample_budget: 100000000\nemulated_step_compute_s: 0.05\n")
        submitted = subprocess.run([sys.executable, "-m", "silod.cli", "submit", str(job)], capture_output=True,
                                   text=True, timeout=60, env=env)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        with start_service("dashboard", "--metadata-address", cluster["metadata"], "--auth-token", TOKEN,
                           "--log-level", "warning", workdir=tmp_path) as dash:
            url = f"http://{dash.address}/?token={TOKEN}"
            deadline = time.monotonic() + 90
            while True:  # the job shows as running once its ranks reported
                dom = _browser(chromium, url, "--dump-dom").stdout
                if 'data-loaded="true"' in dom and "running" in dom:
                    break
                assert time.monotonic() < deadline, f"dashboard never showed the job running; DOM:\n{dom[-3000:]}"
                time.sleep(1)
            assert job_id in dom and "<td>dash-job</td>" in dom
            for node in cluster["nodes"]:
                assert f"<td>{node['name']}</td>" in dom
            assert 'class="gpu training"' in dom  # the job's GPUs are drawn as held
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shot = ARTIFACTS / "dashboard.png"
            shot.unlink(missing_ok=True)
            done = _browser(chromium, url, "--window-size=1280,1000", f"--screenshot={shot}")
            assert shot.exists() and shot.stat().st_size > 10_000, done.stderr[-2000:]
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
