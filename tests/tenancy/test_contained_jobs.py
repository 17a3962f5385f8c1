"""Jobs that cannot touch each other: a hostile tenant's rank beside another tenant's, on one node
whose agent contains its ranks, with real processes and auth on, for both runtimes that contain:
contained processes and containers (Docker, tests/support/docker_engine.py).

`silod metadata`, `silod scheduler`, `silod estimator`, a cache server and a worker agent (as
root) on node n0, node credentials for the node's processes; tenants alpha
(alice) and beta (bob). Alice's job trains; bob's job (tests/tenancy/hostile_rank.py) tries what
a rank can reach: every process's environment and command line, the node's credential file, the
agent's and the cache server's state, alice's job's directories, signals and ptrace on alice's
ranks, devices, every token it found against every service, a fork bomb past its pids limit; and
bob's second job allocates past its memory limit. Every attempt is refused or contained, alice's
job succeeds, and nothing in the store changes but bob's jobs' own states.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from silod.v1 import access_pb2 as a, common_pb2, metadata_pb2 as m, metadata_pb2_grpc, scheduler_pb2
from silod.v1 import scheduler_pb2_grpc, worker_agent_pb2, worker_agent_pb2_grpc

from silod.launcher import ServiceProcess, start_service
from silod.rpc.channels import open_channel
from tests.cache_server.harness import make_dataset, silod_cli
from tests.e2e.harness import wait_until as wait_for
from tests.support.docker_engine import docker_engine as docker_engine, job_image as job_image
from tests.tenancy.job_results import result_of

CLUSTER_TOKEN = "cluster-secret-of-the-containment-suite"
HOSTILE = Path(__file__).with_name("hostile_rank.py")
PIDS_LIMIT = 128
RUNNING, SUCCEEDED, FAILED = common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED
TERMINAL = (SUCCEEDED, FAILED, common_pb2.JOB_STATE_CANCELLED)
REFUSED_FILE = {"ENOENT", "EACCES", "EPERM"}
HARMLESS_DEVICES = {"null", "zero", "full", "random", "urandom", "tty", "fd", "stdin", "stdout", "stderr", "shm"}
DOCKER_DEVICES = {"core", "mqueue", "ptmx", "pts", "console"}  # what Docker adds to a container's /dev

# Both runtimes need root: skipped without it on a developer's machine, run (and failed) under CI=true.
pytestmark = [pytest.mark.skipif(os.geteuid() != 0 and os.environ.get("CI") != "true", reason="both runtimes need root"),
              pytest.mark.timeout(900)]  # a fresh machine installs Docker and builds the job image first


def group_pids(pgid: int) -> list[int]:
    """Every process of the process group (a rank's launcher, its namespace's init, the rank)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    found.append(int(entry))
    return found


def children(pid: int) -> list[int]:
    """Every descendant of ``pid``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def snapshot(md: Any, victim: str) -> dict[str, Any]:
    """What a hostile job must not change, read by an admin."""
    job = md.GetJob(m.GetJobRequest(job_id=victim))
    events = [(e.type, e.from_state, e.to_state) for e in md.ListJobEvents(m.ListJobEventsRequest(job_id=victim)).events]
    return {
        "victim": (job.spec.SerializeToString(deterministic=True), [e for e in events if e[0] != "state"]),
        "datasets": sorted(d.spec.SerializeToString(deterministic=True) for d in md.ListDatasets(m.ListDatasetsRequest()).datasets),
        "nodes": sorted(n.spec.SerializeToString(deterministic=True) for n in md.ListNodes(m.ListNodesRequest()).nodes),
        "credentials": sorted((c.id, c.kind, c.name, c.HasField("revoked_at")) for c in md.ListCredentials(
            a.ListCredentialsRequest(include_revoked=True)).credentials if c.kind != a.PRINCIPAL_KIND_JOB),
        "tenants": sorted((t.name, tuple(t.members)) for t in md.ListTenants(a.ListTenantsRequest()).tenants),
    }


@pytest.fixture(scope="module", params=["contained", "container"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    runtime = request.param
    if runtime == "container":  # the Engine and the job image (skipped where there is none, failed under CI)
        image = request.getfixturevalue("job_image")
        engine = request.getfixturevalue("docker_engine")
        python = "python3"  # the image's
        runtime_flags = ("--runtime", "container", "--default-image", image,
                         "--container-read-paths", str(HOSTILE.parent))
    else:
        engine, python = None, sys.executable
        runtime_flags = ("--runtime", "contained")
    root = tmp_path_factory.mktemp(runtime)
    make_dataset(root / "store", 10, 200, seed=3)
    auth = ("--auth-token", CLUSTER_TOKEN, "--log-level", "warning")
    with contextlib.ExitStack() as stack:
        md = stack.enter_context(start_service("metadata", "--db", f"sqlite:///{root / 'meta.db'}", *auth,
                                               workdir=root / "md"))
        admin_md = metadata_pb2_grpc.MetadataServiceStub(open_channel(md.address, token=CLUSTER_TOKEN))
        node_token = admin_md.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_NODE, name="n0")).token
        credential = root / "n0.credential"
        credential.write_text(node_token + "\n")
        credential.chmod(0o600)
        admin_md.CreateTenant(a.CreateTenantRequest(name="alpha", members=["alice"]))
        admin_md.CreateTenant(a.CreateTenantRequest(name="beta", members=["bob"]))
        users = {u: admin_md.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name=u)).token
                 for u in ("alice", "bob")}
        code, output = silod_cli("dataset", "register", "alpha-imgs", f"file://{root / 'store'}", "--tenant", "alpha",
                                 "--metadata", md.address, "--token", CLUSTER_TOKEN)
        assert code == 0, output
        sch = stack.enter_context(start_service("scheduler", "--metadata-address", md.address, "--interval-s", "1",
                                                *auth, workdir=root / "sch"))
        est = stack.enter_context(start_service("estimator", "--metadata-address", md.address, *auth,
                                                workdir=root / "est"))
        cache = stack.enter_context(start_service(
            "cache-server", "--metadata-address", md.address, "--node", "n0", "--disk-cache-dir", str(root / "disk"),
            "--memory-cache-bytes", "0", "--no-fsync", "--log-level", "warning",
            env={"SILOD_NODE_CREDENTIAL": node_token}, workdir=root / "cache"))
        agent = stack.enter_context(start_service(
            "worker-agent", "--metadata-address", md.address, "--scheduler-address", sch.address, "--node-name", "n0",
            "--gpus", "3", "--work-dir", str(root / "n0"), "--cache-address", cache.address,
            "--node-credential-file", str(credential), *runtime_flags,
            "--rank-pids-limit", str(PIDS_LIMIT), "--report-s", "0.5", "--heartbeat-s", "0.5",
            "--checkpoint-deadline-s", "5", "--log-level", "warning", workdir=root / "agent"))
        yield {"root": root, "md": md, "sch": sch, "est": est, "cache": cache, "agent": agent, "users": users,
               "node_token": node_token, "admin_md": admin_md, "runtime": runtime, "python": python, "engine": engine,
               "admin_jobs": scheduler_pb2_grpc.JobServiceStub(open_channel(sch.address, token=CLUSTER_TOKEN))}


def _submit(c: dict[str, Any], user: str, tenant: str, **spec: Any) -> str:
    jobs = scheduler_pb2_grpc.JobServiceStub(open_channel(c["sch"].address, token=c["users"][user]))
    return jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(
        tenant=tenant, application="cifar10", min_gpus=1, max_gpus=1, batch_size=8, **spec))).id


def _ended(c: dict[str, Any], job: str, timeout: float) -> common_pb2.Job:
    return wait_for(lambda: (j := c["admin_jobs"].GetJob(m.GetJobRequest(job_id=job))).state in TERMINAL and j,
                    timeout, f"{job} to end")


def test_a_hostile_rank_reaches_nothing_of_its_neighbour_or_the_node(cluster: dict[str, Any]) -> None:
    c = cluster
    root, admin_md = c["root"], c["admin_md"]
    victim = _submit(c, "alice", "alpha", name="victim", sample_budget=8 * 500, emulated_step_compute_s=0.05,
                     env={"SILOD_CHECKPOINT_EVERY_S": "1"})
    wait_for(lambda: (j := admin_md.GetJob(m.GetJobRequest(job_id=victim))).state == RUNNING
             and j.progress.samples_done > 0, 60, "the victim training")
    agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(open_channel(c["agent"].address, token=CLUSTER_TOKEN))
    first = next(t.pid for t in agent.GetNodeStatus(worker_agent_pb2.GetNodeStatusRequest()).tasks
                 if t.job_id == victim)
    # Contained: the launcher leads a process group with the namespace's init and the rank.
    # Container: the container's init (docker-init) and the rank, its child.
    victim_pids = group_pids(first) if c["runtime"] == "contained" else [first, *children(first)]
    assert len(victim_pids) >= (3 if c["runtime"] == "contained" else 2), victim_pids
    victim_token = next(v.split("=", 1)[1] for pid in victim_pids
                        for v in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                        if v.startswith("SILOD_AUTH_TOKEN="))
    before = snapshot(admin_md, victim)
    n0 = root / "n0"
    try_paths = [str(root / "n0.credential"), str(n0), str(n0 / "run"), str(n0 / "gpu-table.jsonl"),
                 str(n0 / "jobs" / victim / "work"), str(n0 / "jobs" / victim / "rank-0.log"),
                 str(n0 / "checkpoints" / victim), str(n0 / "checkpoints" / victim / "checkpoints.jsonl"),
                 str(root / "disk"), str(root / "disk" / "journal.jsonl"), str(root / "disk" / "objects"),
                 str(root / "meta.db"), "/proc/1/environ", "/etc/shadow"]

    hostile = _submit(c, "bob", "beta", name="hostile", sample_budget=8, command=[c["python"], str(HOSTILE)],
                      env={"VICTIM": victim, "VICTIM_PIDS": json.dumps(victim_pids), "TRY_PATHS": json.dumps(try_paths),
                           "SCHEDULER_ADDR": c["sch"].address, "ESTIMATOR_ADDR": c["est"].address})
    hog = _submit(c, "bob", "beta", name="hog", sample_budget=8, memory_bytes_per_rank=160 << 20,
                  command=[c["python"], "-c", "import time; hog = bytearray(1 << 30); time.sleep(30)"])
    done = _ended(c, hostile, 120)
    log = (n0 / "jobs" / hostile / "rank-0.log").read_text()
    assert done.state == SUCCEEDED, f"{done.message}\n{log[-3000:]}"
    found = result_of(n0 / "jobs" / hostile / "rank-0.log")

    # It saw its own processes only (its namespace's init and itself), and no secret but its own
    # credential.
    assert len(found["pids"]) == 2 and found["pids"][0] == 1, found["pids"]
    # Every token it found is a credential of its own job (by its id: the job's credential is
    # revoked now that the job has ended).
    own_ids = {x.id for x in admin_md.ListCredentials(a.ListCredentialsRequest(
        kind=a.PRINCIPAL_KIND_JOB, name=hostile, include_revoked=True)).credentials}
    assert found["tokens"] and {t.split("_")[1] for t in found["tokens"]} <= own_ids, (found["tokens"], own_ids)
    seen = " ".join(found["values_seen"])
    for secret in (CLUSTER_TOKEN, c["node_token"], victim_token, c["users"]["alice"], c["users"]["bob"]):
        assert secret not in seen and secret not in found["tokens"]
    # Files: none of the node's, the services' or the other job's could be read or listed.
    assert set(found["files"]) == set(try_paths)
    if c["runtime"] == "container":
        # The mounts' parents, made empty in the container's own filesystem; its init (docker-init)
        # runs as the job's user, with the rank's own environment (its tokens are checked above).
        assert found["files"].pop(str(n0)) in ("ENOENT", "OK: checkpoints,jobs")
        assert found["files"].pop("/proc/1/environ") == "OK"
    assert set(found["files"].values()) <= REFUSED_FILE, found["files"]
    # The other job's processes: out of its sight; its namespace's init is root's.
    assert set(found["signals"].values()) == {"ESRCH"}, found["signals"]
    assert {p: r for p, r in found["ptrace"].items() if p != "1"} == {str(p): "ESRCH" for p in victim_pids}
    if c["runtime"] == "contained":  # its init is root's (a container's runs as the job's own user)
        assert found["ptrace"]["1"] == "EPERM"
    # Devices: the harmless ones only, and no making of others.
    harmless = HARMLESS_DEVICES | (DOCKER_DEVICES if c["runtime"] == "container" else set())
    assert set(found["dev"]) <= harmless, found["dev"]
    assert found["mknod"] == "EPERM"
    # Services: its own credential acts on its own job only.
    assert found["calls"] and set(found["calls"].values()) == {"PERMISSION_DENIED"}, found["calls"]
    # The fork bomb stopped at its pids limit.
    assert found["fork_bomb"]["refused"] == "EAGAIN" and 0 < found["fork_bomb"]["children"] < PIDS_LIMIT

    # Past its memory limit, the hog was killed alone and its job says why.
    hogged = _ended(c, hog, 120)
    assert hogged.state == FAILED and "out of memory" in hogged.message, hogged.message

    # The neighbour trained to its end, and nothing in the store changed but bob's jobs' states.
    finished = _ended(c, victim, 180)
    assert finished.state == SUCCEEDED and finished.progress.samples_done == 8 * 500, finished.message
    assert snapshot(admin_md, victim) == before
    jobs = {j.id: j for j in admin_md.ListJobs(m.ListJobsRequest()).jobs}
    assert set(jobs) == {victim, hostile, hog}
    assert "silod: fast resize" not in (n0 / "jobs" / victim / "rank-0.log").read_text()


def test_a_job_uid_range_holding_an_account_is_refused_naming_the_setting(tmp_path: Path) -> None:
    # Jobs under the uid of an account (daemon is uid 1) would own that account's files.
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "silod.cli", "worker-agent", "--metadata-address", "127.0.0.1:1", "--runtime",
         "contained", "--job-uids", "1-1000", "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "job_uids" in done.stderr and "of the account" in done.stderr, done.stderr


def test_an_uncontained_agent_with_auth_on_refuses_to_start_unless_allowed(tmp_path: Path) -> None:
    import subprocess

    env = {**os.environ, "SILOD_AUTH_TOKEN": "some-cluster-token"}
    base = [sys.executable, "-m", "silod.cli", "worker-agent", "--metadata-address", "127.0.0.1:1", "--runtime",
            "process", "--work-dir", str(tmp_path)]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2 and "runtime" in refused.stderr and "--allow-uncontained" in refused.stderr, \
        refused.stderr
    allowed = subprocess.Popen([*base, "--allow-uncontained"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    try:
        time.sleep(3)
        assert allowed.poll() is None, allowed.stdout.read() if allowed.stdout else ""
    finally:
        allowed.terminate()
        out = allowed.communicate(timeout=30)[0]
    assert "ranks run uncontained" in out, out
