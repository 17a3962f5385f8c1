"""The compose topology executed in network namespaces (silod.lab): every service on its own
host, reaching the others by compose service name, the demo's mixed workload across the
training and inference worker hosts, and hosts losing their network.

Runs where namespaces can be made (root and `ip`); elsewhere skips with the reason, except
under CI=true where a missing capability is a failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from silod.lab import netns

REASON = netns.available()
if REASON and os.environ.get("CI") == "true":
    raise RuntimeError(f"tests/lab must run under CI=true: {REASON}")
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "namespaces available")

from silod.lab.cluster import Lab, LabError  # noqa: E402
from silod.rpc.channels import open_channel  # noqa: E402
from silod.v1 import cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2, metadata_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from worker_agent.warm_process import IDLE_NAME  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except grpc.RpcError:
            value = None   # a service still reconnecting (TCP backs off while a link is down)
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    # A short node timeout keeps the link-down case inside the suite's budget; the agents then
    # heartbeat every 4 s instead of compose's 5 (the scheduler refuses nodes whose heartbeats come
    # less often than a third of its node timeout: they would count as lost between two).
    lab = Lab(tmp_path_factory.mktemp("lab"), nodes=2)
    for scheduler in ("scheduler", "scheduler-2"):  # compose runs two; either may lead
        lab.services[scheduler].environment["SILOD_NODE_TIMEOUT_S"] = "12"
    for name, service in lab.services.items():
        if name.startswith("agent"):
            service.environment["SILOD_HEARTBEAT_S"] = "4"
    # A read of an uncached object gives up after 2 x 4 s (+10 s slack) instead of the deployed
    # 4 x 30 s when the storage host is gone: the case stays short, the behaviour is the same.
    for n in range(2):
        lab.services[f"cache-{n}"].environment.update({"SILOD_REMOTE_TIMEOUT_S": "4", "SILOD_REMOTE_RETRIES": "1"})
    with lab:
        yield lab


def stubs(lab: Lab):
    # The product's channels (retries, keepalive), as the CLI uses: after a partition a plain
    # channel waits out TCP's retransmission backoff on its old connection, which measured the
    # test's own client instead of the cluster (26 s "to converge" where the agents were back in 3).
    meta = metadata_pb2_grpc.MetadataServiceStub(open_channel(lab.address("metadata", 7070)))
    jobs = scheduler_pb2_grpc.JobServiceStub(open_channel(lab.address("scheduler", 7073)))
    return meta, jobs


def node(meta, name: str):
    return meta.GetNode(metadata_pb2.GetNodeRequest(node=name), timeout=10)


def task_pids(lab: Lab, host: str) -> list[int]:
    """Processes in ``host``'s namespace other than its agent and its idle warm processes: the job
    ranks it started."""
    pids = [int(p) for p in os.popen(f"ip netns pids {lab.net.hosts[host].netns}").read().split()]
    return [p for p in pids if p != lab.procs[host].pid and _name(p) != IDLE_NAME]


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_every_service_is_healthy_on_its_own_host_and_reaches_the_others_by_name(lab: Lab) -> None:
    addresses = lab.hosts()
    assert len(set(addresses.values())) == len(addresses)
    assert all(a.startswith("198.18.") for a in addresses.values())
    for name, svc in lab.services.items():
        if not svc.one_shot:
            assert lab.procs[name].poll() is None, f"{name} exited:\n{lab.log(name)[-2000:]}"
        if svc.healthcheck:
            assert lab.healthy(name), f"{name}'s compose health check fails"
    assert lab.procs["migrate"].returncode == 0
    # Across hosts by compose names: agent-0's host reaches agent-1 and cache-1.
    for target in ("agent-1:7074", "cache-1:7071", "metadata:7070", "scheduler:7073"):
        done = lab.run("agent-0", [str(ROOT / ".venv/bin/silod"), "health", target])
        assert done.returncode == 0, f"agent-0 cannot reach {target}: {done.stdout}{done.stderr}"
    # The metadata (on PostgreSQL, its own host) knows the three nodes by their advertised addresses.
    meta, _ = stubs(lab)
    nodes = wait_for(lambda: (lambda ns: ns if len(ns) == 3 and all(n.alive for n in ns) else None)(
        meta.ListNodes(metadata_pb2.ListNodesRequest(), timeout=10).nodes), 60, "three live nodes")
    assert sorted(n.spec.agent_address for n in nodes) == ["agent-0:7074", "agent-1:7074", "agent-infer-0:7074"]
    assert {n.spec.name: n.spec.pool for n in nodes} == {"node-0": common_pb2.NODE_POOL_TRAINING,
                                                         "node-1": common_pb2.NODE_POOL_TRAINING,
                                                         "infer-0": common_pb2.NODE_POOL_INFERENCE}
    page = urllib.request.urlopen(f"http://{lab.address('dashboard', 8080)}/", timeout=10).read().decode()
    assert "dashboard" in page.lower()
    assert_dashboard_lists_every_worker_host(lab)


def assert_dashboard_lists_every_worker_host(lab: Lab) -> None:
    """The dashboard, on its own host, shows every worker host's node alive, in its pool, with its
    cache server (on yet another host) reached."""
    overview = json.loads(urllib.request.urlopen(f"http://{lab.address('dashboard', 8080)}/api/overview",
                                                 timeout=20).read())
    shown = {n["name"]: n for n in overview["nodes"]}
    assert {name: n["pool"] for name, n in shown.items()} == {"node-0": "training", "node-1": "training",
                                                             "infer-0": "inference"}, shown
    assert all(n["alive"] for n in shown.values()), shown
    assert all(n["cache"].get("reachable", True) and "error" not in n["cache"] for n in shown.values()), shown


def rank_logs(lab: Lab, job_id: str) -> dict[str, dict[str, str]]:
    """Host -> rank log name -> text: the logs each worker host's agent wrote for the ranks it
    started (in that agent's own work volume)."""
    found = {}
    for host in AGENT_HOSTS:
        work = lab.work_dir(host) / "jobs" / job_id
        logs = {p.name: p.read_text(errors="replace") for p in work.glob("rank-*.log")}
        if logs:
            found[host] = logs
    return found


def test_the_demos_mixed_workload_runs_across_training_and_inference_hosts(lab: Lab) -> None:
    """`silod lab workload --short`: two of the demo's elastic training jobs reading its datasets
    from the storage host, then three of its inference tasks. Which host ran what is read from
    the rank logs each agent wrote, not from the command's own report."""
    t0 = time.monotonic()
    done = subprocess.run([str(ROOT / ".venv/bin/silod"), "lab", "workload", "--short", "--state-dir", str(lab.state_dir)],
                          capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    transcript = done.stdout + done.stderr
    assert done.returncode == 0, transcript
    submitted = dict(re.findall(r"submitted (\S+)\s+-> (job-\w+)", done.stdout))
    assert sorted(submitted) == ["bert-text", "infer-0", "infer-1", "infer-2", "resnet-images"], transcript
    meta, _ = stubs(lab)
    for name, job_id in submitted.items():
        job = meta.GetJob(metadata_pb2.GetJobRequest(job_id=job_id), timeout=10)
        assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{name}: {job.message}\n{transcript}"
    training = {name: rank_logs(lab, job_id) for name, job_id in submitted.items() if not name.startswith("infer-")}
    inference = {name: rank_logs(lab, job_id) for name, job_id in submitted.items() if name.startswith("infer-")}
    # Training ranks ran on both training worker hosts and each job reached its budget ...
    assert {"agent-0", "agent-1"} <= {h for logs in training.values() for h in logs}, {n: sorted(l) for n, l in training.items()}
    for name, logs in training.items():
        assert any("emulated: done samples=" in text for by_rank in logs.values() for text in by_rank.values()), (name, logs)
    # ... and every inference task on the inference host, to its end.
    for name, logs in inference.items():
        assert sorted(logs) == ["agent-infer-0"], (name, sorted(logs))
        assert "emulated inference: done after" in logs["agent-infer-0"]["rank-0.log"], (name, logs)
    # The command's progress named the hosts the ranks ran on.
    summary = {line.split()[0]: line.split()[5:] for line in done.stdout.split("[4/4] summary")[1].splitlines()
               if len(line.split()) > 5}   # NAME KIND STATE JCT HITS RAN-ON...
    for name, logs in {**training, **inference}.items():
        assert set(logs) <= set(summary.get(name, [])), (name, sorted(logs), transcript)
    assert "the dashboard lists 3 nodes" in done.stdout, transcript
    assert_dashboard_lists_every_worker_host(lab)
    print(f"[lab] short mixed workload: {took:.1f}s; training on {sorted({h for l in training.values() for h in l})}, "
          f"inference on agent-infer-0")


def rank_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_a_job_spread_over_two_hosts_rendezvous_at_rank_0s_advertised_host(lab: Lab) -> None:
    meta, jobs = stubs(lab)
    spec = common_pb2.JobSpec(name="wide", application="cifar10", min_gpus=4, max_gpus=4, batch_size=32,
                              sample_budget=100_000_000, emulated_step_compute_s=0.05)
    job = jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id="lab-wide"), timeout=15)
    try:
        def ranks() -> dict[str, list[dict[str, str]]]:
            found = {h: [e for e in map(rank_env, task_pids(lab, h)) if "MASTER_ADDR" in e] for h in ("agent-0", "agent-1")}
            return found if all(found.values()) else {}

        found = wait_for(ranks, 90, "ranks of the job on both worker hosts")
        envs = [e for h in found.values() for e in h]
        masters = {(e["MASTER_ADDR"], e.get("MASTER_PORT")) for e in envs}
        assert len(masters) == 1, masters
        master_addr = next(iter(masters))[0]
        assert master_addr in ("agent-0", "agent-1"), f"MASTER_ADDR {master_addr!r} is not a worker host"
        rank0_host = next(h for h, es in found.items() if any(e.get("SILOD_RANK") == "0" for e in es))
        assert master_addr == rank0_host
        # Every worker host resolves it to rank 0's host address.
        for h in found:
            done = lab.run(h, ["getent", "hosts", master_addr])
            assert done.stdout.split()[0] == lab.hosts()[rank0_host], done.stdout
        print(f"[lab] {len(envs)} ranks on {sorted(found)}; MASTER_ADDR={master_addr} ({lab.hosts()[rank0_host]})")
    finally:
        jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id, reason="test done"), timeout=15)
        wait_for(lambda: not task_pids(lab, "agent-0") and not task_pids(lab, "agent-1"), 60, "the ranks stopped")


def test_a_ddp_job_trains_across_both_worker_hosts_on_data_from_the_storage_host(lab: Lab, tmp_path: Path) -> None:
    """examples/train_ddp_digits.py as a 4-rank job, 2 ranks on each worker host: the ranks meet at
    rank 0's advertised host name, all-reduce across the bridge, and read the digits through their
    node's cache server from the storage host."""
    import boto3

    example = ROOT / "examples" / "train_ddp_digits.py"
    python = str(ROOT / ".venv/bin/python")
    subprocess.run([python, str(example), "prepare", str(tmp_path / "digits")], check=True, capture_output=True,
                   timeout=120)
    s3 = boto3.client("s3", endpoint_url=f"http://{lab.address('objectstore', 5000)}", region_name="us-east-1",
                      aws_access_key_id="silod", aws_secret_access_key="silod-secret")
    s3.create_bucket(Bucket="digits")
    with ThreadPoolExecutor(16) as pool:  # 1,797 small objects: one at a time took ~20 s
        list(pool.map(lambda png: s3.upload_file(str(png), "digits", f"png/{png.name}"),
                      sorted((tmp_path / "digits").iterdir())))
    done = lab.run("agent-0", [str(ROOT / ".venv/bin/silod"), "dataset", "register", "digits", "s3://digits/png",
                               "--option", "endpoint_url=http://objectstore:5000", "--metadata", "metadata:7070"],
                   env={"AWS_ACCESS_KEY_ID": "silod", "AWS_SECRET_ACCESS_KEY": "silod-secret",
                        "AWS_DEFAULT_REGION": "us-east-1"}, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    meta, jobs = stubs(lab)
    # resize_in_place: its ranks start in the agents' warm processes (deploy/compose.yaml turns them on).
    spec = common_pb2.JobSpec(name="ddp-lab", min_gpus=4, max_gpus=4, batch_size=64, epochs=1, dataset="digits",
                              command=[python, str(example)], resize_in_place=True)
    job = jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id="lab-ddp"), timeout=15)
    final = wait_for(lambda: (lambda j: j if j.state in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED)
                              else None)(meta.GetJob(metadata_pb2.GetJobRequest(job_id=job.id), timeout=10)),
                     240, "the DDP job to finish")
    logs = {n: {p.name: p.read_text(errors="replace")
                for p in (lab.state_dir / "volumes" / f"agent-work-{n}" / "jobs" / job.id).glob("rank-*.log")}
            for n in (0, 1)}
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED, f"{final.message}\n{logs}"
    assert all(len(by_rank) == 2 for by_rank in logs.values()), {n: sorted(r) for n, r in logs.items()}
    done_lines = [re.search(r"^done rank (\d) steps (\d+) samples (\d+) hash (\w+)$", text, re.M)
                  for by_rank in logs.values() for text in by_rank.values()]
    assert all(done_lines), logs
    assert sorted(int(m.group(1)) for m in done_lines) == [0, 1, 2, 3]
    assert len({m.group(4) for m in done_lines}) == 1, "the replicas on the two hosts differ"
    assert {int(m.group(3)) for m in done_lines} == {1797}
    assert all("(in a warm process)" in text for by_rank in logs.values() for text in by_rank.values()), logs
    print(f"[lab] DDP job: 4 ranks on agent-0 and agent-1, {done_lines[0].group(2)} steps, identical parameters")


def test_cache_servers_fill_from_the_storage_host_by_its_name(lab: Lab) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=f"http://{lab.address('objectstore', 5000)}", region_name="us-east-1",
                      aws_access_key_id="silod", aws_secret_access_key="silod-secret")
    s3.create_bucket(Bucket="labdata")
    for i in range(8):
        s3.put_object(Bucket="labdata", Key=f"train/{i:03d}.bin", Body=bytes([i]) * 4096)
    silod = str(ROOT / ".venv/bin/silod")
    done = lab.run("agent-0", [silod, "dataset", "register", "labset", "s3://labdata/train",
                               "--option", "endpoint_url=http://objectstore:5000", "--metadata", "metadata:7070"],
                   env={"AWS_ACCESS_KEY_ID": "silod", "AWS_SECRET_ACCESS_KEY": "silod-secret",
                        "AWS_DEFAULT_REGION": "us-east-1"})
    assert done.returncode == 0, done.stdout + done.stderr
    for n in (0, 1):
        done = lab.run(f"agent-{n}", [silod, "dataset", "preload", "labset", "--cache", f"cache-{n}:7071"])
        assert done.returncode == 0, done.stdout + done.stderr
    volumes = lab.state_dir / "volumes"

    def cached_bytes(n: int) -> int:   # object files in the node's memory and disk tiers
        return sum(f.stat().st_size for tier in ("mem", "disk")
                   for f in (volumes / f"cache-{tier}-{n}").glob("objects/*/*") if f.is_file())

    wait_for(lambda: cached_bytes(0) >= 8 * 4096 and cached_bytes(1) >= 8 * 4096, 60,
             "both nodes' cache tiers holding the dataset read from objectstore")


def test_storage_host_gone_cached_reads_go_on_uncached_fail_clearly_then_recover(lab: Lab) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=f"http://{lab.address('objectstore', 5000)}", region_name="us-east-1",
                      aws_access_key_id="silod", aws_secret_access_key="silod-secret")
    s3.create_bucket(Bucket="gone")
    keys = [f"{i:03d}.bin" for i in range(8)]
    for i, key in enumerate(keys):
        s3.put_object(Bucket="gone", Key=f"set/{key}", Body=bytes([i + 1]) * 8192)
    done = lab.run("agent-0", [str(ROOT / ".venv/bin/silod"), "dataset", "register", "goneset", "s3://gone/set",
                               "--option", "endpoint_url=http://objectstore:5000", "--metadata", "metadata:7070"],
                   env={"AWS_ACCESS_KEY_ID": "silod", "AWS_SECRET_ACCESS_KEY": "silod-secret",
                        "AWS_DEFAULT_REGION": "us-east-1"})
    assert done.returncode == 0, done.stdout + done.stderr
    cache = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(lab.address("cache-0", 7071)))

    def lease(some: list[str], timeout: float = 60) -> list[bytes]:
        got = cache.Lease(cache_pb2.LeaseRequest(job_id="lab-reader", dataset="goneset", keys=some), timeout=timeout)
        # The cache server's files, read where the job would read them (the same file system here).
        return [Path(o.path).read_bytes() for o in got.objects]

    assert lease(keys[:4]) == [bytes([i + 1]) * 8192 for i in range(4)]   # now cached on node 0
    lab.link("objectstore", up=False)
    try:
        t0 = time.monotonic()
        assert lease(keys[:4]) == [bytes([i + 1]) * 8192 for i in range(4)]
        cached_s = time.monotonic() - t0
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            lease(keys[4:5])
        failed_s = time.monotonic() - t0
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        assert "remote store" in failed.value.details(), failed.value.details()
        assert failed_s < 2 * 4 + 10 + 5, f"the uncached read took {failed_s:.1f}s to fail"
    finally:
        lab.link("objectstore", up=True)
    t1 = time.monotonic()
    assert wait_for(lambda: lease(keys[4:]), 60, "uncached reads working again") == \
        [bytes([i + 1]) * 8192 for i in range(4, 8)]
    print(f"[lab] storage host cut: cached reads {cached_s:.2f}s, an uncached read failed UNAVAILABLE after "
          f"{failed_s:.1f}s, reads recovered {time.monotonic() - t1:.1f}s after link up")


def test_a_broken_variable_in_compose_fails_the_lab(tmp_path: Path) -> None:
    text = (ROOT / "deploy/compose.yaml").read_text().replace("${SILOD_POLICY:-deepboot}", "${SILOD_POLICY:-no-such-policy}")
    assert "no-such-policy" in text
    broken = tmp_path / "compose.yaml"
    broken.write_text(text)
    with pytest.raises(LabError, match="scheduler"):
        Lab(tmp_path / "state", nodes=1, inference_nodes=0, prefix="sdlabx", compose_file=broken,
            health_timeout_s=40).up()
    assert not any(line.startswith("sdlabx") for line in os.popen("ip netns list").read().splitlines())


def test_worker_host_link_down_requeues_its_job_elsewhere_and_the_node_rejoins(lab: Lab) -> None:
    meta, jobs = stubs(lab)
    spec = common_pb2.JobSpec(name="long", application="cifar10", min_gpus=1, max_gpus=1, batch_size=16,
                              sample_budget=100_000_000, emulated_step_compute_s=0.05,
                              env={"SILOD_CHECKPOINT_EVERY_S": "1"})
    job = jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id="lab-long"), timeout=15)
    # compose mounts one checkpoints volume on every agent
    checkpoints = lab.state_dir / "volumes" / "checkpoints" / job.id / "checkpoints.jsonl"

    def placed_on() -> str:
        try:
            plan = meta.GetLatestPlan(metadata_pb2.GetLatestPlanRequest(), timeout=10)
        except grpc.RpcError:
            return ""
        got = meta.GetJob(metadata_pb2.GetJobRequest(job_id=job.id), timeout=10)
        if got.state != common_pb2.JOB_STATE_RUNNING:
            return ""
        return next((p.node for a in plan.jobs if a.job_id == job.id for p in a.placements), "")

    first = wait_for(placed_on, 90, "the job running")
    host = "agent-" + first.split("-")[1]
    other = "node-1" if first == "node-0" else "node-0"
    wait_for(lambda: checkpoints.exists() and checkpoints.read_text().strip(), 60, "a checkpoint of the job")
    t0 = time.monotonic()
    lab.link(host, up=False)
    try:
        wait_for(lambda: placed_on() == other, 90, f"the job running on {other}")
        moved_s = time.monotonic() - t0
        # It resumed there from the checkpoint its ranks on the cut host wrote.
        saved = max(json.loads(line)["samples_done"] for line in checkpoints.read_text().splitlines() if line.strip())
        new_log = lab.state_dir / "volumes" / f"agent-work-{other.split('-')[1]}" / "jobs" / job.id / "rank-0.log"
        resumed = wait_for(lambda: re.findall(r"emulated: resumed at samples=(\d+)", new_log.read_text())
                           if new_log.exists() else None, 60, "the moved job's rank started")
        assert int(resumed[-1]) > 0, f"the moved job started from scratch (a checkpoint held {saved} samples)"
        # Longer than the metadata's liveness window too: the node shows as down.
        wait_for(lambda: not node(meta, first).alive, 60, f"{first} shown down")
        # Cut off, the old agent cannot hear of the new plan: its rank is still running.
        assert task_pids(lab, host), "the cut host's rank stopped before the link came back"
    finally:
        lab.link(host, up=True)
    t1 = time.monotonic()
    # Fenced: back on the network, the stale agent sees the newer generation and stops its ranks.
    wait_for(lambda: not task_pids(lab, host), 60, f"the stale rank on {host} stopped")
    fenced_s = time.monotonic() - t1
    wait_for(lambda: node(meta, first).alive, 60, f"{first} alive again")
    print(f"[lab] job moved off the cut host in {moved_s:.1f}s; stale rank stopped {fenced_s:.1f}s and "
          f"node alive {time.monotonic() - t1:.1f}s after link up")
    # No GPU booked twice: in the latest plan every (node, gpu) belongs to one job at most.
    plan = meta.GetLatestPlan(metadata_pb2.GetLatestPlanRequest(), timeout=10)
    booked = [(p.node, g) for a in plan.jobs for p in a.placements for g in p.gpu_indices]
    assert len(booked) == len(set(booked))
    assert lab.procs[host].poll() is None, f"{host}'s agent died:\n{lab.log(host)[-2000:]}"
    jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id, reason="test done"), timeout=15)


def test_postgres_restarted_under_load_loses_and_duplicates_no_acknowledged_submission(lab: Lab) -> None:
    """Submissions keep coming while PostgreSQL is stopped and started again; a client retries
    with the same request id until acknowledged. Each ends up exactly once."""
    meta, jobs = stubs(lab)
    spec = dict(application="cifar10", min_gpus=1, max_gpus=1, batch_size=16, sample_budget=64,
                emulated_step_compute_s=0.01)
    names = [f"pg-{i}" for i in range(12)]
    acknowledged: dict[str, str] = {}
    failures = 0
    for i, name in enumerate(names):
        if i == 4:
            lab.stop("postgres")
        if i == 8:
            lab.start("postgres")
        deadline = time.monotonic() + 90
        while name not in acknowledged:
            assert time.monotonic() < deadline, f"{name} never acknowledged"
            try:
                job = jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(name=name, **spec),
                                                                    client_request_id=f"lab-{name}"), timeout=10)
                acknowledged[name] = job.id
            except grpc.RpcError as exc:
                failures += 1
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
                if 4 <= i < 8:
                    break   # PostgreSQL is down: this one is retried after the restart
                time.sleep(0.5)
    assert failures > 0, "no submission saw PostgreSQL down: the restart did not happen under load"
    for name in names:   # the ones refused while it was down, retried now with their request ids
        deadline = time.monotonic() + 90
        while name not in acknowledged:
            try:
                acknowledged[name] = jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(
                    spec=common_pb2.JobSpec(name=name, **spec), client_request_id=f"lab-{name}"), timeout=10).id
            except grpc.RpcError:
                assert time.monotonic() < deadline, f"{name} never acknowledged after the restart"
                time.sleep(0.5)
    listed = [j for j in meta.ListJobs(metadata_pb2.ListJobsRequest(page_size=500), timeout=10).jobs
              if j.spec.name.startswith("pg-")]
    assert sorted(j.spec.name for j in listed) == sorted(names)
    assert {j.spec.name: j.id for j in listed} == acknowledged


def nodes_of(meta, job_id: str) -> set[str]:
    """The nodes the latest plan gives the job."""
    plan = meta.GetLatestPlan(metadata_pb2.GetLatestPlanRequest(), timeout=10)
    return {p.node for a in plan.jobs if a.job_id == job_id for p in a.placements}


CONTROL_HOSTS = ("metadata", "scheduler", "scheduler-2", "allocation", "estimator", "dashboard", "postgres")
AGENT_HOSTS = ("agent-0", "agent-1", "agent-infer-0")   # deepboot may lend the inference host's GPUs


@pytest.mark.lab_full  # 30 s control-plane partition: `make lab-test` (tests/lab/conftest.py)
def test_control_hosts_cut_off_for_30s_jobs_keep_training_and_the_cluster_converges(lab: Lab) -> None:
    meta, jobs = stubs(lab)
    spec = common_pb2.JobSpec(name="steady", application="cifar10", min_gpus=1, max_gpus=1, batch_size=16,
                              sample_budget=100_000_000, emulated_step_compute_s=0.05)
    job = jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id="lab-steady"), timeout=15)
    try:
        wait_for(lambda: meta.GetJob(metadata_pb2.GetJobRequest(job_id=job.id), timeout=10).state
                 == common_pb2.JOB_STATE_RUNNING, 90, "the job running")
        # Its own rank: jobs of the test before (pg-*) may still be running beside it.
        def own_pids(host: str) -> list[int]:
            return [pid for pid in task_pids(lab, host) if rank_env(pid).get("SILOD_JOB_ID") == job.id]

        host = wait_for(lambda: next((h for h in AGENT_HOSTS if own_pids(h)), ""), 30, "its rank")
        pids = own_pids(host)
        before = meta.GetJob(metadata_pb2.GetJobRequest(job_id=job.id), timeout=10)
        seen = meta.ListJobEvents(metadata_pb2.ListJobEventsRequest(job_id=job.id), timeout=10).events
        last_event = max((e.sequence for e in seen), default=0)
        node_before = nodes_of(meta, job.id)
        for h in CONTROL_HOSTS:
            lab.link(h, up=False)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 30:
                assert own_pids(host) == pids, "the rank stopped while the control hosts were cut off"
                time.sleep(1)
        finally:
            for h in CONTROL_HOSTS:
                lab.link(h, up=True)
        t1 = time.monotonic()
        # Converges: progress moves on again; the job was not requeued off its node on stale heartbeats.
        wait_for(lambda: meta.GetJob(metadata_pb2.GetJobRequest(job_id=job.id), timeout=10).progress.samples_done
                 > before.progress.samples_done, 30, "progress reported again")  # 3 s measured; 27 s without keepalive
        wait_for(lambda: all(n.alive for n in meta.ListNodes(metadata_pb2.ListNodesRequest(), timeout=10).nodes),
                 60, "every node alive")
        print(f"[lab] control hosts cut 30 s: converged {time.monotonic() - t1:.1f}s after links up")
        # Not requeued on stale heartbeats: never back to PENDING, still on its node. deepboot may
        # retune the batch of a running job (a new generation: RESIZING), a decision on fresh state;
        # without such a resize its rank must be the very one that ran through the partition.
        events = meta.ListJobEvents(metadata_pb2.ListJobEventsRequest(job_id=job.id, after_sequence=last_event),
                                    timeout=10).events
        moves = [(common_pb2.JobState.Name(e.to_state), e.message) for e in events if e.type == "state"]
        assert not [m for m in moves if m[0] == "JOB_STATE_PENDING"], moves
        assert nodes_of(meta, job.id) == node_before, (node_before, moves)
        after = meta.GetJob(metadata_pb2.GetJobRequest(job_id=job.id), timeout=10)
        assert after.state in (common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_RESIZING), moves
        if not moves:
            assert after.state == common_pb2.JOB_STATE_RUNNING
            assert own_pids(host) == pids, "the job was restarted after the partition"
        else:
            print(f"[lab] after the partition the policy moved the job: {moves}")
    finally:
        jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id, reason="test done"), timeout=15)
