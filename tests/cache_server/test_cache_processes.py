"""Real processes end to end: ``silod metadata`` + ``silod cache-server`` + a training job
(tests/sdk/sdk_job.py: the SDK in a torch DataLoader with forked workers) against an
S3-protocol server (moto) on loopback, against a local store while the cache server is
SIGKILLed mid-epoch, and under a plan (cache quota and remote IO rate) the cache server
follows from an AllocationService through ``--scheduler-address``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from silod.v1 import cache_pb2, cache_pb2_grpc, plan_pb2
from tests.cache_server.harness import (
    aws_test_env,
    digests,
    finish_job,
    make_dataset,
    moto_s3,
    register,
    silod_cli,
    start_job,
    stop_job,
)
from tests.support.procs import free_port, start_service
from tests.worker_agent.scripted_allocation import AllocationServer


def _cli(*argv: str, env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, "-m", "silod.cli", *argv], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return result.stdout


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("silod_cache_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_s3_dataset_end_to_end_through_real_processes(tmp_path: Path, metadata: str) -> None:
    import boto3

    env = aws_test_env()
    with moto_s3() as endpoint:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="silod-e2e")
        objects = {f"img/{i % 4}/{i:04d}.jpg": os.urandom(4000 + i) for i in range(120)}
        for key, data in objects.items():
            s3.put_object(Bucket="silod-e2e", Key=f"train/{key}", Body=data)
        out = _cli("dataset", "register", "s3-e2e", "s3://silod-e2e/train", "--option", f"endpoint_url={endpoint}",
                   "--metadata", metadata, env=env)
        assert "120 objects" in out

        metrics_port = free_port()
        with start_service(
            "cache-server", "--metadata-address", metadata, "--disk-cache-dir", str(tmp_path / "disk"),
            "--memory-cache-dir", str(tmp_path / "mem"), "--memory-cache-bytes", "200000",
            "--metrics-port", str(metrics_port), "--log-level", "warning", env=env, workdir=tmp_path / "cs",
        ) as cache:
            stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address))
            # Replaced in the bucket after registration: new ETag, never served stale ...
            changed = "img/0/0000.jpg"
            objects[changed] = os.urandom(4000)
            s3.put_object(Bucket="silod-e2e", Key=f"train/{changed}", Body=objects[changed])
            with pytest.raises(grpc.RpcError) as info:
                stub.Lease(cache_pb2.LeaseRequest(job_id="e2e", dataset="s3-e2e", keys=[changed]))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.details().startswith("keys[0]:") and "changed in the store" in info.value.details()
            # ... until the dataset is re-registered.
            _cli("dataset", "register", "s3-e2e", "s3://silod-e2e/train", "--option", f"endpoint_url={endpoint}",
                 "--replace", "--metadata", metadata, env=env)

            # The training job: its own process, DataLoader with two forked workers, two epochs.
            report, _ = finish_job(start_job("--dataset", "s3-e2e", "--cache", cache.address, "--metadata", metadata,
                                             "--job", "e2e", "--epochs", "2", "--batch", "16", env=env))
            assert report["epochs"] == [digests(objects.values())] * 2, "bytes differ from the bucket"
            job = stub.Stats(cache_pb2.StatsRequest(job_id="e2e")).jobs[0]
            assert job.hits >= 120 and job.hit_ratio >= 0.5  # the whole second epoch hit
            metrics = _scrape(metrics_port)
            # The job is this server's only reader, so the node's counters are the job's.
            lease_hits = sum(v for k, v in metrics.items()
                             if k.startswith("silod_cache_hits_total{") and 'path="lease"' in k)
            assert lease_hits == job.hits  # every hit went by lease ...
            assert metrics["silod_cache_streamed_bytes_total"] == 0  # ... none by stream
            assert metrics["silod_cache_remote_bytes_total"] == sum(len(b) for b in objects.values())


def test_sigkill_of_the_cache_server_mid_epoch_falls_back_to_the_store(tmp_path: Path, metadata: str) -> None:
    root = tmp_path / "store"
    files = make_dataset(root, 400, 4000, seed=11)
    register(metadata, "kill-me", f"file://{root}")
    with start_service("cache-server", "--metadata-address", metadata, "--disk-cache-dir", str(tmp_path / "d"),
                       "--memory-cache-bytes", "0", "--log-level", "warning", workdir=tmp_path / "cs") as cache:
        job = start_job("--dataset", "kill-me", "--cache", cache.address, "--metadata", metadata, "--job", "k",
                        "--batch", "20", "--pause-after", "4", "--pause-file", str(tmp_path / "paused"),
                        "--resume-file", str(tmp_path / "resume"))
        deadline = time.monotonic() + 60
        while not (tmp_path / "paused").exists():
            if job.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the job did not reach batch 4: {stop_job(job)}")
            time.sleep(0.02)
        cache.kill()  # SIGKILL mid-epoch: no shutdown code runs
        (tmp_path / "resume").write_text("go")
        report, stderr = finish_job(job)
    assert report["epochs"] == [digests(files.values())]
    warnings = [line for line in stderr.splitlines() if "unreachable" in line]
    assert len(warnings) == 1, stderr  # once for the job, not once per worker or per sample
    assert warnings[0].startswith("WARNING silod.data") and "reading dataset kill-me directly" in warnings[0]


def test_preload_cli_fills_the_cache(tmp_path: Path, metadata: str) -> None:
    root = tmp_path / "store"
    files = make_dataset(root, 50, 2000, seed=12)
    register(metadata, "preload-me", f"file://{root}")
    with start_service("cache-server", "--metadata-address", metadata, "--disk-cache-dir", str(tmp_path / "d"),
                       "--memory-cache-bytes", "0", "--log-level", "warning", workdir=tmp_path / "cs") as cache:
        code, out = silod_cli("dataset", "preload", "preload-me", "--cache", cache.address)
        assert code == 0 and "queued 50 objects" in out, out
        stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address))
        deadline = time.monotonic() + 10
        while stub.Stats(cache_pb2.StatsRequest()).tiers[0].used_bytes < 100_000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stub.Stats(cache_pb2.StatsRequest()).tiers[0].used_bytes == 100_000
        response = stub.Lease(cache_pb2.LeaseRequest(job_id="p", dataset="preload-me", keys=sorted(files)))
        assert {o.tier for o in response.objects} == {"disk"}
        code, out = silod_cli("dataset", "preload", "nope", "--cache", cache.address)
        assert code == 1 and "NOT_FOUND: dataset:" in out


def _node_plan(node: str, version: int, job: str, dataset: str, quota_bytes: int, rate: int,
               policy: str = "uniform") -> plan_pb2.NodePlan:
    """What the scheduler's AllocationService sends ``node`` for a plan placing ``job`` there
    with a cache grant (one GPU, cache policy ``policy``)."""
    from scheduler.live.convert import node_plan
    from silod.v1 import common_pb2

    plan = plan_pb2.AllocationPlan(version=version, policy="silod-test", cache_mode="silod")
    entry = plan.jobs.add(job_id=job, batch_size=10, cache_policy=policy, generation=1)
    entry.placements.add(node=node, gpu_indices=[0])
    entry.cache_grants.add(node=node, cache_quota_bytes=quota_bytes, remote_io_bytes_per_s=rate)
    view = node_plan(plan, node, {job: common_pb2.JobSpec(name=job, dataset=dataset, batch_size=10)}, {})
    assert [(q.job_id, q.dataset) for q in view.cache_quotas] == [(job, dataset)]
    return view


def test_quota_and_io_rate_from_a_watched_plan_are_enforced(tmp_path: Path, metadata: str) -> None:
    """The plan reaches the cache server the way it does in a cluster: ``--scheduler-address``,
    AllocationService.Watch, Ack. The real ``silod scheduler`` cannot serve it yet (no policy
    grants cache or IO: scheduler/policies never set ``cache_bytes``), so the scripted
    AllocationService (tests/worker_agent/scripted_allocation.py) serves the NodePlan a
    SiloD-style policy would: the job's dataset, its cache quota and its remote IO rate, cut
    from an AllocationPlan by the scheduler's own conversion (scheduler.live.convert.node_plan)."""
    size, count = 25_000, 120  # 3 MB: 3 s of cold reads at the planned rate
    rate, quota_bytes = 1_000_000, count * size // 2
    root = tmp_path / "store"
    files = make_dataset(root, count, size, seed=13)
    register(metadata, "planned", f"file://{root}")
    alloc = AllocationServer()
    try:
        alloc.push(_node_plan("plan-node", 7, "pj", "planned", quota_bytes, rate))
        with start_service("cache-server", "--metadata-address", metadata, "--scheduler-address", alloc.address,
                           "--node", "plan-node", "--disk-cache-dir", str(tmp_path / "d"), "--memory-cache-bytes", "0",
                           "--log-level", "warning", workdir=tmp_path / "cs") as cache:
            stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address))
            deadline = time.monotonic() + 15
            while [(a.version, a.ok) for a in list(alloc.servicer.acks)] != [(7, True)]:
                assert time.monotonic() < deadline, f"no ack of the plan: {list(alloc.servicer.acks)}"
                time.sleep(0.05)
            assert stub.Stats(cache_pb2.StatsRequest()).plan_version == 7

            job = start_job("--dataset", "planned", "--cache", cache.address, "--metadata", metadata, "--job", "pj",
                            "--epochs", "2", "--batch", "10")
            # (seconds, remote bytes, the job's cached bytes, bytes in the node's tiers), sampled
            # from outside while the job runs: the rate is measured on the test's clock.
            samples: list[tuple[float, int, int, int]] = []
            while job.poll() is None:
                stats = stub.Stats(cache_pb2.StatsRequest(job_id="pj"))
                samples.append((time.monotonic(), stats.jobs[0].remote_bytes, stats.jobs[0].cached_bytes,
                                sum(t.used_bytes for t in stats.tiers)))
                time.sleep(0.05)
            report, _ = finish_job(job)
            final = stub.Stats(cache_pb2.StatsRequest(job_id="pj")).jobs[0]
    finally:
        alloc.stop()

    assert report["epochs"] == [digests(files.values())] * 2, "bytes differ from the store"
    # The cold epoch reads every object remotely, paced by the plan's rate. Measure between 10%
    # and 90% of the dataset's bytes: the first object goes out within the bucket's burst, and
    # past the first epoch the job reads hits too.
    dataset_bytes = count * size
    t10, b10 = next((t, b) for t, b, _, _ in samples if b >= 0.1 * dataset_bytes)
    t90, b90 = next((t, b) for t, b, _, _ in samples if b >= 0.9 * dataset_bytes)
    measured = (b90 - b10) / (t90 - t10)
    print(f"\nplanned remote IO {rate:,} B/s, measured {measured:,.0f} B/s ({b90 - b10:,} B in {t90 - t10:.2f} s); "
          f"quota {quota_bytes:,} B, cached at most {max(c for _, _, c, _ in samples):,} B")
    assert measured == pytest.approx(rate, rel=0.10)
    assert final.remote_io_limit_bytes_per_s == rate
    # The quota bounds the job's cache at every moment, and nothing else was cached for it.
    assert all(cached <= quota_bytes and used <= quota_bytes for _, _, cached, used in samples)
    assert quota_bytes - size < final.cached_bytes <= quota_bytes  # uniform filled it and kept it
    assert final.quota_bytes == quota_bytes


def test_cache_policy_none_from_a_watched_plan_passes_through_at_the_planned_io_rate(
    tmp_path: Path, metadata: str
) -> None:
    """The baseline without a cache: a plan gives the job cache policy "none" and 1 MB/s of
    remote IO. The job reads a dataset another reader has already cached on the node, twice:
    every object comes from the store (hit ratio 0, remote bytes = 2 x the dataset) at the
    planned rate, and nothing is admitted for it. A later plan with an unknown policy is
    refused, acked with the reason naming the field, and the "none" plan stays in force."""
    size, count = 12_500, 240  # 3 MB; 6 MB over two epochs = 6 s at the planned rate
    rate = 1_000_000
    root = tmp_path / "store"
    files = make_dataset(root, count, size, seed=14)
    register(metadata, "baseline", f"file://{root}")
    alloc = AllocationServer()
    metrics_port = free_port()
    try:
        with start_service("cache-server", "--metadata-address", metadata, "--scheduler-address", alloc.address,
                           "--node", "none-node", "--disk-cache-dir", str(tmp_path / "d"), "--memory-cache-bytes", "0",
                           "--metrics-port", str(metrics_port), "--log-level", "warning",
                           workdir=tmp_path / "cs") as cache:
            stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address))
            # Another reader (no plan: best effort) caches the whole dataset on the node first.
            warm = stub.Lease(cache_pb2.LeaseRequest(job_id="warmer", dataset="baseline", keys=sorted(files)))
            stub.ReleaseLease(cache_pb2.ReleaseLeaseRequest(lease_id=warm.lease_id))
            used_before = sum(t.used_bytes for t in stub.Stats(cache_pb2.StatsRequest()).tiers)
            assert used_before == count * size

            # A quota in the grant is ignored for "none" (nothing would use it).
            alloc.push(_node_plan("none-node", 3, "nj", "baseline", 500_000, rate, policy="none"))
            deadline = time.monotonic() + 15
            while [(a.version, a.ok) for a in list(alloc.servicer.acks)] != [(3, True)]:
                assert time.monotonic() < deadline, f"no ack of the plan: {list(alloc.servicer.acks)}"
                time.sleep(0.05)

            # Batches of 40 objects (0.5 s of IO each) and three workers: with no prefetch (a
            # cache in disguise) only the job's own requests keep the IO rate busy.
            job = start_job("--dataset", "baseline", "--cache", cache.address, "--metadata", metadata, "--job", "nj",
                            "--epochs", "2", "--batch", "40", "--workers", "3")
            samples: list[tuple[float, int]] = []
            while job.poll() is None:
                stats = stub.Stats(cache_pb2.StatsRequest(job_id="nj"))
                if stats.jobs:
                    samples.append((time.monotonic(), stats.jobs[0].remote_bytes))
                time.sleep(0.05)
            report, _ = finish_job(job)
            final = stub.Stats(cache_pb2.StatsRequest(job_id="nj")).jobs[0]
            used_after = sum(t.used_bytes for t in stub.Stats(cache_pb2.StatsRequest()).tiers)

            # An unknown policy: refused with the field named; the applied plan stays version 3.
            alloc.push(_node_plan("none-node", 4, "nj", "baseline", 0, rate, policy="mru"))
            while len(alloc.servicer.acks) < 2:
                assert time.monotonic() < deadline + 30, f"no ack of plan 4: {list(alloc.servicer.acks)}"
                time.sleep(0.05)
            refused = alloc.servicer.acks[1]
            plan_version_after = stub.Stats(cache_pb2.StatsRequest()).plan_version
            metrics = _scrape(metrics_port)
    finally:
        alloc.stop()

    assert report["epochs"] == [digests(files.values())] * 2, "bytes differ from the store"
    dataset_bytes = count * size
    assert final.hits == 0 and final.hit_ratio == 0.0
    assert final.misses == 2 * count
    assert final.remote_bytes == 2 * dataset_bytes  # both epochs from the store, although the node had it all
    assert final.cached_bytes == 0 and final.quota_bytes == 0
    assert used_after == used_before  # nothing admitted for the job
    assert metrics['silod_cache_pass_through_total{reason="none"}'] == 2 * count  # the one job of policy none
    # Measured inside the first epoch (10% to 90% of the dataset), as for the uniform plan above:
    # between epochs the job forks new DataLoader workers and asks for nothing for a while.
    t10, b10 = next((t, b) for t, b in samples if b >= 0.1 * dataset_bytes)
    t90, b90 = next((t, b) for t, b in samples if b >= 0.9 * dataset_bytes)
    measured = (b90 - b10) / (t90 - t10)
    print(f"\ncache policy none: planned remote IO {rate:,} B/s, measured {measured:,.0f} B/s; "
          f"hit ratio {final.hit_ratio}, remote {final.remote_bytes:,} B")
    assert measured == pytest.approx(rate, rel=0.10)
    assert final.remote_io_limit_bytes_per_s == rate
    assert (refused.version, refused.ok) == (4, False)
    assert refused.message.startswith("cache_quotas[0].cache_policy:") and "'mru'" in refused.message, refused.message
    assert "none" in refused.message  # the allowed values are listed
    assert plan_version_after == 3
