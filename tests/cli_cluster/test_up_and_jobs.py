"""`silod up` as a real subprocess, driven by the job CLI as a user would, and its dashboard in Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc
from tests.dashboard import browser
from tests.support.procs import free_port, start_service

SMALL = "application: cifar10\nmin_gpus: 1\nmax_gpus: 2\nbatch_size: 16\nsample_budget: 480\nemulated_step_compute_s: 0.02\n"
LONG = "name: long\napplication: cifar10\nmin_gpus: 1\nmax_gpus: 1\nbatch_size: 16\nsample_budget: 100000000\nemulated_step_compute_s: 0.05\n"


def _silod(state: Path, *args: str, timeout: float = 60, **env_extra: str) -> subprocess.CompletedProcess[str]:
    """A client command as a user runs it beside `silod up`: no address given, only the state dir
    (and no user config file unless ``env_extra`` names one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env.update({"SILOD_STATE_DIR": str(state), "SILOD_CLIENT_CONFIG": str(state / "no-client-config.yaml"), **env_extra})
    return subprocess.run([sys.executable, "-m", "silod.cli", *args], capture_output=True, text=True, timeout=timeout, env=env)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it has exited
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def up_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """One `silod up` (2 nodes x 2 GPUs) for this module's two tests: the dashboard page in
    Chromium, then the job CLI, which ends by shutting it down. Starting it costs 8 processes."""
    state = tmp_path_factory.mktemp("up") / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    up = subprocess.Popen([sys.executable, "-m", "silod.cli", "up", "--nodes", "2", "--gpus-per-node", "2",
                           "--state-dir", str(state), "--interval-s", "1", "--storage-bandwidth-bytes-per-s", "50e6"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (state / "cluster.json").exists():
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            assert time.monotonic() < deadline, "cluster.json not written"
            time.sleep(0.1)
        children = _children(up.pid)
        yield up, state
    finally:
        _cleanup(up, children)


def _charts(dom: str) -> dict[str, dict[str, str]]:
    """Each chart's container attributes in a dumped DOM: data-points (the fewest points of its
    lines), data-painted (canvas pixels in its lines' colours), and its note if it has one."""
    charts = {}
    for match in re.finditer(r'<div class="chart" id="(chart-[a-z-]+)"([^>]*)>(.*?)</figure>', dom, re.S):
        attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', match.group(2)))
        note = re.search(r'<p class="chart-note">([^<]*)</p>', match.group(3))
        charts[match.group(1)] = {**attrs, "note": note.group(1) if note else ""}
    return charts


def _drawn(chart: dict[str, str]) -> bool:
    return int(chart.get("points", "0")) >= 2 and int(chart.get("painted", "0")) > 0


def _until(chromium: str, url: str, ready: Callable[[str], bool], what: str, timeout_s: float = 90) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        dom = browser.run(chromium, url, "--dump-dom").stdout
        if 'data-loaded="true"' in dom and ready(dom):
            return dom
        assert time.monotonic() < deadline, f"{what}; charts {_charts(dom)}; DOM:\n{dom[-3000:]}"
        time.sleep(0.5)


def _screenshot(chromium: str, url: str, shot: Path, height: int) -> None:
    shot.unlink(missing_ok=True)
    done = browser.run(chromium, url, f"--window-size=1280,{height}", "--hide-scrollbars", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    browser.ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, browser.ARTIFACTS / shot.name)  # kept after the run, beside the other test artifacts


def test_page_in_chromium_shows_a_live_cluster(up_cluster: tuple[subprocess.Popen[str], Path], tmp_path: Path) -> None:
    """`silod dashboard` (tests/dashboard covers the rest of it) on a live cluster, in Chromium:
    the tables, the charts over time drawn from its history, and a job's page."""
    chromium = browser.chromium()
    up, state = up_cluster
    assert up.poll() is None, "silod up exited early"
    cluster = json.loads((state / "cluster.json").read_text())
    data = tmp_path / "dash-data"
    data.mkdir()
    for i in range(400):
        (data / f"{i:03d}.bin").write_bytes(bytes([i % 256]) * 20_000)
    reg = _silod(state, "dataset", "register", "dash-data", f"file://{data}")
    assert reg.returncode == 0, reg.stdout + reg.stderr
    job = tmp_path / "job.yaml"
    job.write_text("name: dash-job\napplication: cifar10\nmin_gpus: 1\nmax_gpus: 2\nbatch_size: 16\n"
                   "sample_budget: 100000000\nemulated_step_compute_s: 0.05\ndataset: dash-data\n")
    submitted = _silod(state, "submit", str(job))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    try:
        with start_service("dashboard", "--metadata-address", cluster["metadata"], "--auth-token", browser.TOKEN,
                           "--history-interval-s", "0.5", "--log-level", "warning", workdir=tmp_path) as dash:
            url = f"http://{dash.address}/?token={browser.TOKEN}"
            live = ("chart-gpus", "chart-tenants", "chart-pending", "chart-hits", "chart-io")
            # The job shows as running once its ranks reported; the charts once the history has points.
            dom = _until(chromium, url, lambda d: "running" in d and all(_drawn(_charts(d).get(c, {})) for c in live),
                         "dashboard never showed the job running with every chart drawn")
            assert job_id in dom and "<td>dash-job</td>" in dom and f'href="/job/{job_id}"' in dom
            for node in cluster["nodes"]:
                assert f"<td>{node['name']}</td>" in dom
            assert 'class="gpu training"' in dom  # the job's GPUs are drawn as held
            charts = _charts(dom)
            assert set(charts) == {*live, "chart-util"}, charts
            # Emulated GPUs have no NVML figures: the chart says so instead of drawing nothing.
            assert charts["chart-util"]["points"] == "0" and "no NVML figures from node-" in charts["chart-util"]["note"]
            assert "dash-job" in dom.split('id="chart-gpus"')[1].split("</figure>")[0]  # the legend names the job
            _screenshot(chromium, url, tmp_path / "dashboard.png", 1500)

            job_url = f"http://{dash.address}/job/{job_id}?token={browser.TOKEN}"
            page = _until(chromium, job_url, lambda d: all(_drawn(_charts(d).get(c, {})) for c in
                                                           ("chart-plan-gpus", "chart-throughput", "chart-step")),
                          "the job's page never drew its plan, throughput and step-time charts")
            assert f"silod logs {job_id}" in page and "pending → scheduled" in page and "dash-job" in page
            _screenshot(chromium, job_url, tmp_path / "dashboard-job.png", 1400)
            bad = browser.run(chromium, f"http://{dash.address}/job/no-such-job?token={browser.TOKEN}", "--dump-dom")
            assert "job_id: no job 'no-such-job'" in bad.stdout, bad.stdout[-2000:]
    finally:
        # Its GPUs go back to the next test's jobs.
        _silod(state, "cancel", job_id)


def test_every_client_command_finds_the_cluster_of_silod_up_without_an_address(
        up_cluster: tuple[subprocess.Popen[str], Path], tmp_path: Path) -> None:
    up, state = up_cluster
    info = json.loads((state / "cluster.json").read_text())
    health = _silod(state, "health")
    assert health.returncode == 0, health.stdout + health.stderr
    names = [line.split("  ")[0].strip() for line in health.stdout.splitlines()]
    assert names == ["metadata", "estimator", "scheduler", "allocation", *(f"{kind} {n['name']}" for n in info["nodes"]
                                                             for kind in ("cache", "agent"))], health.stdout
    assert all(line.endswith("SERVING") for line in health.stdout.splitlines())

    data = tmp_path / "files"
    data.mkdir()
    for i in range(5):
        (data / f"{i}.bin").write_bytes(bytes([i]) * 1000)
    reg = _silod(state, "dataset", "register", "located", f"file://{data}")
    assert reg.returncode == 0 and reg.stdout.startswith("registered located: 5 objects"), reg.stdout + reg.stderr
    listing = _silod(state, "dataset", "list")
    assert listing.returncode == 0 and "located" in listing.stdout, listing.stderr
    show = _silod(state, "dataset", "show", "located", "--objects", "2")
    assert show.returncode == 0 and "objects:          5" in show.stdout, show.stderr
    preload = _silod(state, "dataset", "preload", "located")
    first_cache = info["nodes"][0]["cache"]
    assert preload.returncode == 0 and f"at {first_cache}" in preload.stdout, preload.stdout + preload.stderr
    second = info["nodes"][1]
    preload = _silod(state, "dataset", "preload", "located", "--node", second["name"])
    assert preload.returncode == 0 and f"at {second['cache']}" in preload.stdout, preload.stdout + preload.stderr
    # Reaching the metadata service: the refusal is its own (the GPU has no fault), not a connection error.
    clear = _silod(state, "nodes", "clear-gpu-fault", second["name"], "0")
    assert clear.returncode == 1 and clear.stderr.startswith("silod: FAILED_PRECONDITION"), clear.stderr

    # Without cluster.json, the user's config file; a flag beats everything and is named when it fails.
    elsewhere = tmp_path / "no-cluster"
    config = tmp_path / "client.yaml"
    config.write_text(f"metadata: {info['metadata']}\nscheduler: {info['scheduler']}\n")
    by_config = _silod(elsewhere, "dataset", "list", SILOD_CLIENT_CONFIG=str(config))
    assert by_config.returncode == 0 and "located" in by_config.stdout, by_config.stderr
    assert _silod(elsewhere, "jobs", SILOD_CLIENT_CONFIG=str(config)).returncode == 0
    wrong = _silod(state, "dataset", "list", "--metadata", "127.0.0.1:1")
    assert wrong.returncode == 1 and "127.0.0.1:1 (from --metadata)" in wrong.stderr, wrong.stderr
    by_env = _silod(state, "jobs", SILOD_SCHEDULER_ADDR="127.0.0.1:1")
    assert by_env.returncode == 1 and "(from SILOD_SCHEDULER_ADDR)" in by_env.stderr, by_env.stderr
    config.write_text("metadata: 7070\n")
    bad = _silod(elsewhere, "dataset", "list", SILOD_CLIENT_CONFIG=str(config))
    assert bad.returncode == 1 and f"{config}: metadata: expected a string" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr + wrong.stderr + by_env.stderr


def test_up_submit_watch_logs_cancel_and_shutdown(up_cluster: tuple[subprocess.Popen[str], Path], tmp_path: Path) -> None:
    up, state = up_cluster
    children: list[int] = []
    try:
        assert up.poll() is None, up.stdout.read() if up.stdout else ""
        info = json.loads((state / "cluster.json").read_text())
        assert len(info["nodes"]) == 2 and all(n["agent"] and n["cache"] for n in info["nodes"])
        children = _children(up.pid)
        # metadata, estimator, scheduler, allocation, dashboard; agent + cache per node
        assert len(children) == 5 + 2 * 2
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children]
        scheduler = [c for c in commands if b"scheduler" in c and b"allocation" not in c]
        # The nodes watch their plans, ack and report at the allocation service, which follows the scheduler.
        (allocation,) = [c for c in commands if b"allocation" in c]
        assert allocation[allocation.index(b"--scheduler-address") + 1].decode() == info["scheduler"]
        nodes = [c for c in commands if b"worker-agent" in c or b"cache-server" in c]
        assert len(nodes) == 4 and all(c[c.index(b"--scheduler-address") + 1].decode() == info["allocation"]
                                       for c in nodes)
        assert len(scheduler) == 1 and b"--storage-bandwidth-bytes-per-s" in scheduler[0]
        assert scheduler[0][scheduler[0].index(b"--storage-bandwidth-bytes-per-s") + 1] == b"5e+07"
        assert info["dashboard"].startswith("http://127.0.0.1:")

        ids = []
        for i in range(3):
            f = tmp_path / f"job{i}.yaml"
            f.write_text(f"name: small-{i}\n" + SMALL)
            r = _silod(state, "submit", str(f))
            assert r.returncode == 0, r.stderr
            ids.append(r.stdout.strip())
        assert len(set(ids)) == 3 and all(j.startswith("job-") for j in ids)

        again = _silod(state, "submit", str(tmp_path / "job0.yaml"))
        assert again.returncode == 0 and again.stdout.strip() == ids[0]

        bad = tmp_path / "bad.yaml"
        bad.write_text("name: bad\ngpus: 2\n")
        r = _silod(state, "submit", str(bad))
        assert r.returncode == 2 and "unknown key 'gpus'" in r.stderr

        listing = _silod(state, "jobs")
        assert listing.returncode == 0, listing.stderr
        assert listing.stdout.splitlines()[0].split() == ["ID", "NAME", "STATE", "GPUS", "PROGRESS", "AGE"]
        for i, job_id in enumerate(ids):
            assert job_id in listing.stdout and f"small-{i}" in listing.stdout

        w = _silod(state, "watch", ids[0], timeout=60)
        assert w.returncode == 0, w.stdout + w.stderr
        assert w.stdout.strip().splitlines()[-1] == f"{ids[0]} SUCCEEDED"

        logs = _silod(state, "logs", ids[0])
        assert logs.returncode == 0, logs.stderr
        assert "emulated: done samples=480" in logs.stdout

        # The same file once its job ended: the old id, and a note saying how to run it again.
        same = _silod(state, "submit", str(tmp_path / "job0.yaml"))
        assert same.returncode == 0 and same.stdout.strip() == ids[0]
        assert "already submitted" in same.stderr and "ended SUCCEEDED" in same.stderr and "--again" in same.stderr
        rerun = _silod(state, "submit", "--again", str(tmp_path / "job0.yaml"))
        assert rerun.returncode == 0 and rerun.stdout.strip() not in ids and not rerun.stderr, rerun.stderr
        ids.append(rerun.stdout.strip())

        (tmp_path / "long.yaml").write_text(LONG)
        long_id = _silod(state, "submit", str(tmp_path / "long.yaml")).stdout.strip()
        # Wait through gRPC (a `silod jobs` process per poll costs seconds of imports), then
        # check that `silod jobs` shows it running.
        with grpc.insecure_channel(info["metadata"]) as channel:
            md = metadata_pb2_grpc.MetadataServiceStub(channel)
            deadline = time.monotonic() + 40
            while md.GetJob(metadata_pb2.GetJobRequest(job_id=long_id), timeout=10).state != common_pb2.JOB_STATE_RUNNING:
                assert time.monotonic() < deadline, "long job never ran"
                time.sleep(0.2)
        assert "RUNNING" in next(l for l in _silod(state, "jobs").stdout.splitlines() if l.startswith(long_id))
        # `silod nodes`: both emulated nodes, alive, their GPUs, and the running job's GPU in use.
        table = _silod(state, "nodes")
        assert table.returncode == 0, table.stderr
        assert table.stdout.splitlines()[0].split() == ["NAME", "POOL", "TYPE", "RUNTIME", "GPUS", "CPUS", "MEMORY", "CACHE",
                                                        "ALIVE", "HEARTBEAT", "PLAN"]
        rows = [json.loads(line) for line in _silod(state, "nodes", "--json").stdout.splitlines()]
        assert [r["name"] for r in rows] == sorted(n["name"] for n in info["nodes"])
        assert all(r["alive"] and r["gpus"] == 2 and r["pool"] == "training" and r["cache_bytes"] > 0 for r in rows)
        assert 1 <= sum(r["gpus_used"] for r in rows) <= 4
        c = _silod(state, "cancel", long_id, "--reason", "test")
        assert c.returncode == 0, c.stderr
        w = _silod(state, "watch", long_id, timeout=60)
        assert w.stdout.strip().splitlines()[-1].startswith(f"{long_id} CANCELLED") and w.returncode == 1
        again = _silod(state, "cancel", long_id)
        assert again.returncode == 1 and again.stderr.startswith("silod: FAILED_PRECONDITION:")
        assert "Traceback" not in again.stderr

        for job_id in ids[1:]:
            assert _silod(state, "watch", job_id, timeout=60).returncode == 0

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, up.stdout.read() if up.stdout else ""
        assert not any(_alive(p) for p in children)
        assert not (state / "cluster.json").exists()
        # With cluster.json gone the client looks further. The last place it looks is this
        # machine's default ports (127.0.0.1:7073 for the scheduler), where another test's compose
        # cluster may answer meanwhile; a client config naming free ports comes first.
        config = tmp_path / "client.yaml"
        config.write_text(f"metadata: 127.0.0.1:{free_port()}\nscheduler: 127.0.0.1:{free_port()}\n")
        r = _silod(state, "jobs", SILOD_CLIENT_CONFIG=str(config))
        assert r.returncode == 1 and "silod up" in r.stderr, r.stdout + r.stderr
    finally:
        _cleanup(up, children)


def _cleanup(up: subprocess.Popen[str], children: list[int]) -> None:
    if up.poll() is None:
        up.kill()
        up.wait()
    for pid in children:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _wait_up(up: subprocess.Popen[str], state: Path) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 60
    while not (state / "cluster.json").exists():
        assert up.poll() is None, up.stdout.read() if up.stdout else ""
        assert time.monotonic() < deadline, "cluster.json not written"
        time.sleep(0.1)
    return json.loads((state / "cluster.json").read_text())


def test_a_dying_child_is_named_with_its_log_and_the_rest_stopped(tmp_path: Path) -> None:
    state = tmp_path / "state"
    up = subprocess.Popen([sys.executable, "-m", "silod.cli", "up", "--nodes", "1", "--gpus-per-node", "1",
                           "--no-cache", "--no-dashboard", "--state-dir", str(state)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: list[int] = []
    try:
        _wait_up(up, state)
        children = _children(up.pid)
        assert len(children) == 5  # metadata, estimator, scheduler, allocation, the agent
        ps = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(up.pid)], capture_output=True, text=True).stdout
        agent = next(int(line.split()[0]) for line in ps.splitlines() if " worker-agent " in line)
        os.kill(agent, signal.SIGKILL)
        assert up.wait(60) == 1
        out = up.stdout.read() if up.stdout else ""
        assert "worker-agent node-0 exited unexpectedly" in out and "log tail" in out
        assert not any(_alive(p) for p in children)
    finally:
        _cleanup(up, children)


def test_bad_up_flags_exit_2_naming_the_flag(tmp_path: Path) -> None:
    for flags, needle in ((["--inference-nodes", "-1"], "--inference-nodes"),
                          (["--cache-disk-bytes", "-5"], "--cache-disk-bytes"),
                          (["--cache", "fifo"], "--cache"),
                          (["--storage-bandwidth-bytes-per-s", "-1"], "--storage-bandwidth-bytes-per-s")):
        done = subprocess.run([sys.executable, "-m", "silod.cli", "up", "--state-dir", str(tmp_path), *flags],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr, (flags, done.stderr)
