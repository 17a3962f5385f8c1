"""The container runtime for real: `silod worker-agent --runtime container` (a real process) against
the scripted AllocationService (tests/worker_agent/conftest.py) and the Docker Engine and images of
tests/support/docker_engine.py (skipped where there is none, failed under CI=true).

A job without a command runs the image's ``python3 -m silod.jobs.emulated`` (the job image holds
its own Python, torch and this checkout's SDK); ranks run as their job's uid in a PID namespace of
their own, with their job's credential and no secret of the agent's; a memory hog is OOM-killed
alone with the reason; SIGTERM reaches a rank the plan stops; a killed agent's containers are
killed by its watchdog, or stopped by the next agent when the watchdog died with it; images come
from a registry with the operator's credentials, and a pull that cannot be done fails the rank
promptly, naming the image; a pull that hangs holds up its own job only, until
image_pull_timeout_s. benchmarks/rank_start.py runs small."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from silod.v1 import allocation_pb2, metadata_pb2 as m, plan_pb2, worker_agent_pb2
from tests.metadata.metadata_samples import training_spec
from tests.support import docker_engine as engines
from tests.support.docker_engine import Engine, docker_engine as docker_engine, job_image as job_image
from tests.support.procs import free_port
from tests.worker_agent.conftest import assignment, node_plan, wait_until

pytestmark = pytest.mark.timeout(900)  # the first test of a fresh machine installs Docker and builds the images (about 3 min here)

EXITED = allocation_pb2.TASK_PHASE_EXITED
RUNNING = allocation_pb2.TASK_PHASE_RUNNING
CLUSTER_TOKEN = "cluster-secret-of-the-agent"
JOB_UIDS = (1000000, 1065535)  # the agent's default job_uids


@pytest.fixture(autouse=True)
def _no_containers_left(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    """Containers of the test's agents are removed after it, whatever happened (an agent killed by
    the test or its fixture leaves them, stopped, for the next agent on its work_dir)."""
    yield
    if "docker_engine" not in request.fixturenames:
        return
    engine: Engine = request.getfixturevalue("docker_engine")
    for info in _containers(engine, "silod.work_dir"):
        if info["Config"]["Labels"]["silod.work_dir"].startswith(str(tmp_path.resolve())):
            engine.docker("rm", "-f", info["Id"], check=False)


def _latest(allocation, job: str, rank: int = 0, generation: int = 1):  # type: ignore[no-untyped-def]
    found = [t for t in allocation.task_reports() if (t.job_id, t.rank, t.generation) == (job, rank, generation)]
    return found[-1] if found else None


def _exited(allocation, job: str, generation: int = 1):  # type: ignore[no-untyped-def]
    report = _latest(allocation, job, 0, generation)
    return report if report is not None and report.phase == EXITED else None


def _training(allocation, job: str, generation: int = 1) -> bool:  # type: ignore[no-untyped-def]
    report = _latest(allocation, job, 0, generation)
    return report is not None and report.phase == RUNNING and report.progress.samples_done > 0


def _containers(engine: Engine, *labels: str) -> list[dict]:  # type: ignore[type-arg]
    """docker inspect of every container (running or not) with these labels."""
    ids = engine.docker("ps", "-aq", "--no-trunc", *(f"--filter=label={label}" for label in labels)).stdout.split()
    return engine.inspect_existing(*ids)


def _of(agent) -> list[str]:  # type: ignore[no-untyped-def]
    """The labels of the agent's containers (an earlier run's of the same node name have another work_dir)."""
    return [f"silod.node={agent.node}", f"silod.work_dir={agent.work_dir.resolve()}"]


def _one(engine: Engine, agent, task: str) -> dict:  # type: ignore[no-untyped-def,type-arg]
    found = _containers(engine, *_of(agent), f"silod.task={task}")
    assert len(found) == 1, found
    return found[0]


def _exec(engine: Engine, cid: str, code: str) -> str:
    return engine.docker("exec", cid, "python3", "-c", code, timeout=60).stdout


def _agent(start_agent, image: str, *extra: str, **kwargs):  # type: ignore[no-untyped-def]
    return start_agent("--runtime", "container", "--default-image", image, *extra, **kwargs)


def _watchdog(agent_pid: int) -> int:
    """The container watchdog the agent started (its child)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                if int(stat[1]) == agent_pid and b"container_watchdog" in cmdline:
                    return int(entry)
    raise AssertionError(f"agent {agent_pid} has no container watchdog")


def test_emulated_job_runs_in_its_container_as_its_job_uid_with_its_credential(  # type: ignore[no-untyped-def]
        metadata, allocation, start_agent, docker_engine, job_image) -> None:
    agent = _agent(start_agent, job_image, "--auth-token", CLUSTER_TOKEN, gpus=2)
    job = metadata.stub.CreateJob(m.CreateJobRequest(spec=training_spec(tenant="vision"))).id
    latest = 0
    with contextlib.suppress(Exception):  # none committed yet
        latest = metadata.stub.GetLatestPlan(m.GetLatestPlanRequest()).version
    metadata.stub.CommitPlan(m.CommitPlanRequest(plan=plan_pb2.AllocationPlan(version=latest + 1, jobs=[
        plan_pb2.JobAllocation(job_id=job, generation=1,
                               placements=[plan_pb2.GpuPlacement(node=agent.node, gpu_indices=[1])])])))
    allocation.push(node_plan(agent.node, 1, assignment(job, 0, 1, [1], budget=1200, step_s=0.02)))
    wait_until(lambda: _training(allocation, job), timeout=60, what="the containerised rank reporting progress")

    info = _one(docker_engine, agent, f"{job}/0/1")
    labels = info["Config"]["Labels"]
    assert labels["silod.work_dir"] == str(agent.work_dir.resolve()) and labels["silod.job"] == job
    uid = int(info["Config"]["User"].split(":")[0])
    assert JOB_UIDS[0] <= uid <= JOB_UIDS[1] and info["Config"]["User"] == f"{uid}:{uid}"
    host = info["HostConfig"]
    assert host["NetworkMode"] == "host" and host["Init"] is True and host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"] and not host["Privileged"]
    work = agent.work_dir.resolve() / "jobs" / job / "work"
    checkpoints = agent.work_dir.resolve() / "checkpoints" / job
    assert sorted((mnt["Source"], mnt["Destination"], mnt["RW"]) for mnt in info["Mounts"]) == sorted(
        [(str(work), str(work), True), (str(checkpoints), str(checkpoints), True)])  # nothing else of the host
    assert (work.stat().st_uid, work.stat().st_mode & 0o777) == (uid, 0o700)
    env = dict(item.split("=", 1) for item in info["Config"]["Env"])
    token = env["SILOD_AUTH_TOKEN"]
    assert token and token != CLUSTER_TOKEN and CLUSTER_TOKEN not in env.values()
    assert not {"SILOD_NODE_NAME", "SILOD_GPUS", "SILOD_WORK_DIR", "SILOD_AGENT_PID"} & set(env)
    assert env["PATH"].startswith("/opt/venv/bin:") and env["HOME"] == "/tmp"  # the image's PATH, not the host's
    seen = json.loads(_exec(docker_engine, info["Id"], (
        "import json, os; print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), "
        "'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), "
        "'init': open('/proc/1/cmdline').read(), 'caps': [l for l in open('/proc/self/status') "
        "if l.startswith(('CapEff', 'NoNewPrivs'))]}))")))
    assert (seen["uid"], seen["gid"]) == (uid, uid)
    assert 1 in seen["pids"] and max(seen["pids"]) < 1000, seen  # its own PID namespace, docker-init as 1
    assert "init" in seen["init"] and "silod.jobs.emulated" in seen["init"], seen
    assert sorted(seen["caps"]) == ["CapEff:\t0000000000000000\n", "NoNewPrivs:\t1\n"], seen

    done = wait_until(lambda: _exited(allocation, job), timeout=60, what="the rank done")
    assert done.exit_code == 0 and done.progress.samples_done == 1200, agent.log(job, 0)
    log = agent.log(job, 0)
    shown = json.loads(re.search(r"silod-env: (.*)", log).group(1))
    assert shown["CUDA_VISIBLE_DEVICES"] == "1" and shown["SILOD_CHECKPOINT_DIR"] == str(checkpoints)
    assert "emulated: done samples=1200" in log
    chunks = agent.stub.TailLogs(worker_agent_pb2.TailLogsRequest(job_id=job, rank=0), timeout=5,
                                 metadata=(("authorization", f"Bearer {CLUSTER_TOKEN}"),))
    assert b"emulated: done samples=1200" in b"".join(c.data for c in chunks)  # silod logs
    wait_until(lambda: not _containers(docker_engine, *_of(agent)), what="the container removed")


def test_memory_hog_is_oom_killed_alone_and_a_stopped_rank_checkpoints(  # type: ignore[no-untyped-def]
        allocation, start_agent, docker_engine, job_image) -> None:
    agent = _agent(start_agent, job_image)
    hog = assignment("job-hog", 0, 1, [0], command=["python3", "-c", "b = []\nwhile True: b.append(b'x' * (8 << 20))"])
    hog.spec.memory_bytes_per_rank = 96 * 2**20
    calm = assignment("job-calm", 0, 1, [1], budget=10_000_000, step_s=0.02)
    allocation.push(node_plan(agent.node, 1, hog, calm))
    ended = wait_until(lambda: _exited(allocation, "job-hog"), timeout=60, what="the hog's end")
    assert ended.exit_code == 137, agent.log("job-hog", 0)
    assert ended.exit_reason == "out of memory: the rank passed its limit of 96 MiB"
    wait_until(lambda: _training(allocation, "job-calm"), timeout=60, what="its neighbour training")
    assert _latest(allocation, "job-calm").phase == RUNNING  # killed alone

    # The plan takes the neighbour off the node: SIGTERM reaches the rank in its container, which
    # checkpoints into the job's checkpoint directory on the host and exits 0.
    allocation.push(node_plan(agent.node, 2))
    stopped = wait_until(lambda: _exited(allocation, "job-calm"), timeout=30, what="the neighbour stopped")
    assert stopped.exit_code == 0, agent.log("job-calm", 0)
    assert "checkpointed at samples=" in agent.log("job-calm", 0)
    assert any((agent.work_dir / "checkpoints" / "job-calm").iterdir())


def test_a_killed_agents_containers_are_killed_by_its_watchdog_or_stopped_by_the_next_agent(  # type: ignore[no-untyped-def]
        allocation, start_agent, docker_engine, job_image) -> None:
    first = _agent(start_agent, job_image)
    allocation.push(node_plan(first.node, 1, assignment("job-k", 0, 1, [0], budget=10_000_000, step_s=0.02)))
    wait_until(lambda: _training(allocation, "job-k"), timeout=60, what="training")
    killed_id = _one(docker_engine, first, "job-k/0/1")["Id"]
    first.proc.kill()  # its watchdog kills its containers, as the machine's death would
    wait_until(lambda: not _containers(docker_engine, *_of(first), "silod.task=job-k/0/1")[0]
               ["State"]["Running"], timeout=10, what="the rank killed with its agent")
    assert _containers(docker_engine, *_of(first))[0]["State"]["ExitCode"] == 137

    # The next agent removes it, relaunches the rank, and is then killed with its watchdog.
    second = _agent(start_agent, job_image, node=first.node, work_dir=first.work_dir)
    assert killed_id not in {c["Id"] for c in _containers(docker_engine, *_of(first))}
    # Until the relaunch the rank has no container: wait for one, running.
    wait_until(lambda: any(c["State"]["Running"] for c in
                           _containers(docker_engine, *_of(first), "silod.task=job-k/0/1")), timeout=60,
               what="the relaunched rank")
    left = _one(docker_engine, first, "job-k/0/1")["Id"]
    os.kill(_watchdog(second.proc.pid), signal.SIGKILL)
    second.proc.kill()
    time.sleep(1.5)
    assert _one(docker_engine, first, "job-k/0/1")["State"]["Running"]  # outlives its agent...

    third = _agent(start_agent, job_image, node=first.node, work_dir=first.work_dir)
    assert left not in {c["Id"] for c in _containers(docker_engine, *_of(first))}  # ...till the next
    assert "stopping containers an earlier agent left" in third.proc.log()
    allocation.push(node_plan(first.node, 2))


def test_images_come_from_a_registry_with_the_operators_credentials(  # type: ignore[no-untyped-def]
        allocation, start_agent, docker_engine, tmp_path: Path) -> None:
    tiny = engines.tiny_image(docker_engine)
    with engines.registry(tmp_path, free_port()) as reg:
        image = f"{reg.address}/silod-test/tiny:1"
        engines.push(docker_engine, tiny, image, reg, tmp_path / "docker-config")
        try:
            auth = tmp_path / "registry-auth.json"
            auth.write_text("{}")  # read at each pull: no credentials yet
            agent = start_agent("--runtime", "container", "--registry-auth-file", str(auth))
            command = ["/tini", "--version"]
            noauth = assignment("job-noauth", 0, 1, [0], command=command)
            noauth.spec.image = image
            started = time.monotonic()
            allocation.push(node_plan(agent.node, 1, noauth, assignment("job-none", 0, 1, [1])))
            refused = wait_until(lambda: _exited(allocation, "job-noauth"), timeout=30, what="the refused pull")
            assert time.monotonic() - started < 20  # promptly
            assert refused.exit_code == 127 and refused.exit_reason.startswith(f"cannot pull image {image}: ")
            assert re.search("auth|unauthorized", refused.exit_reason), refused.exit_reason
            assert f"--- silod: cannot pull image {image}: " in agent.log("job-noauth", 0)
            none = wait_until(lambda: _exited(allocation, "job-none"), timeout=30, what="the job without an image")
            assert none.exit_code == 127 and "no image" in none.exit_reason and "default_image" in none.exit_reason

            auth.write_text(json.dumps({reg.address: {"username": reg.username, "password": reg.password}}))
            pulled = assignment("job-pull", 0, 1, [0], command=command)
            pulled.spec.image = image
            unknown = assignment("job-unknown", 0, 1, [1], command=command)
            unknown.spec.image = f"{reg.address}/silod-test/nope:1"
            allocation.push(node_plan(agent.node, 2, pulled, unknown))
            done = wait_until(lambda: _exited(allocation, "job-pull"), timeout=60, what="the pulled image's rank")
            assert done.exit_code == 0 and "tini version" in agent.log("job-pull", 0), agent.log("job-pull", 0)
            assert docker_engine.has_image(image)
            missing = wait_until(lambda: _exited(allocation, "job-unknown"), timeout=30, what="the unknown image")
            assert missing.exit_code == 127, agent.log("job-unknown", 0)
            assert missing.exit_reason.startswith(f"cannot pull image {unknown.spec.image}: ")
            assert "manifest unknown" in missing.exit_reason, missing.exit_reason
            assert f'"{reg.username}" ' in reg.log() or reg.username in reg.log()  # the registry saw who pulled
        finally:
            docker_engine.docker("rmi", image, check=False)


@pytest.fixture
def silent_registry() -> Iterator[str]:
    """HOST:PORT of a server that takes connections and never answers: a registry that hangs."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


def test_a_hanging_pull_holds_up_its_own_job_only_and_fails_in_bounded_time(  # type: ignore[no-untyped-def]
        allocation, start_agent, docker_engine, job_image, silent_registry) -> None:
    agent = _agent(start_agent, job_image, "--image-pull-timeout-s", "4")
    slow = assignment("job-slow", 0, 1, [0], command=["/tini", "--version"])
    slow.spec.image = f"{silent_registry}/silod-test/slow:1"
    pushed = time.monotonic()
    allocation.push(node_plan(agent.node, 1, slow, assignment("job-quick", 0, 1, [1], budget=10_000_000)))
    wait_until(lambda: _training(allocation, "job-quick"), timeout=60, what="the other job training")
    assert _exited(allocation, "job-slow") is None  # launched while the pull still hangs
    failed = wait_until(lambda: _exited(allocation, "job-slow"), timeout=30, what="the pull given up")
    assert 4 <= time.monotonic() - pushed < 20
    assert failed.exit_code == 127 and failed.exit_reason == (
        f"cannot pull image {slow.spec.image}: not done within 4 s (image_pull_timeout_s)"), failed.exit_reason
    allocation.push(node_plan(agent.node, 2))


BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "rank_start.py"


def test_rank_start_benchmark_runs_small(docker_engine, job_image, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "rank_start.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--runtimes", "process", "container", "--repeats", "1",
                           "--warmup", "0", "--image", job_image, "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())["figures"]
    assert set(figures) == {"process", "container"} and all(0 < f["median_s"] < 60 for f in figures.values())
    assert "container - process:" in done.stdout


@pytest.mark.parametrize(("flags", "says"), [
    (["--repeats", "0"], "--repeats: must be 1 or more"),
    (["--warmup", "-1"], "--warmup: must be 0 or more"),
    (["--runtimes", "process", "process"], "--runtimes: each runtime once"),
    (["--runtimes", "process", "--image", "x:1"], "--image: only the container runtime uses an image"),
    (["--runtimes", "vm"], "--runtimes: invalid choice: 'vm'"),
])
def test_rank_start_benchmark_refuses_nonsense_flags(flags: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, str(BENCHMARK), *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr, done.stderr
