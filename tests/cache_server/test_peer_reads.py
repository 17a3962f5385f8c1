"""Peer reads between the cache servers of a multi-node job's nodes: two in-process cache
servers ("node-a", "node-b") over real gRPC, a real ``silod metadata`` process, a ``file://``
store. A miss on one node is served from the other's cache (not admitted, no store read), the
job's content on its two nodes stays disjoint so its hit ratio is that of their union, and a
peer that is down or hangs never fails a read."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from services.runtime.errors import InvalidArgument
from silod.v1 import cache_pb2, plan_pb2
from tests.cache_server.harness import InProcessCache, make_dataset, quota, read_leased, register

SIZE = 1000
COUNT = 100


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _peer_quota(job: str, dataset: str, cache_bytes: int, *peers: InProcessCache | tuple[str, str]
                ) -> plan_pb2.JobCacheQuota:
    q = quota(job, dataset, cache_bytes, policy="uniform")
    for peer in peers:
        node, address = peer if isinstance(peer, tuple) else (peer.settings.node, peer.address)
        q.peers.add(node=node, cache_address=address)
    return q


@pytest.fixture
def dataset(tmp_path: Path, metadata: str, request: pytest.FixtureRequest) -> tuple[str, dict[str, bytes], Path]:
    name = "peers-" + request.node.name.replace("[", "-").replace("]", "")[:80]
    root = tmp_path / "store"
    files = make_dataset(root, COUNT, SIZE, seed=7)
    register(metadata, name, f"file://{root}")
    return name, files, root


@pytest.fixture
def two_nodes(tmp_path: Path, metadata: str) -> Iterator[tuple[InProcessCache, InProcessCache]]:
    a = InProcessCache(tmp_path / "a", metadata, node="node-a", peer_timeout_s=1.0)
    try:
        b = InProcessCache(tmp_path / "b", metadata, node="node-b", peer_timeout_s=1.0)
    except BaseException:
        a.stop()
        raise
    try:
        yield a, b
    finally:
        b.stop()
        if not getattr(a, "stopped", False):
            a.stop()


def _cached(cache: InProcessCache, dataset: str, keys: list[str]) -> set[str]:
    return {k for k in keys if cache.call(cache.core.entry, dataset, k) is not None}


def _job(cache: InProcessCache, job: str) -> cache_pb2.JobCacheStats:
    return cache.stats(job).jobs[0]


def test_a_miss_on_one_node_is_served_from_the_other_nodes_cache_without_a_store_read(
    dataset: tuple[str, dict[str, bytes], Path], two_nodes: tuple[InProcessCache, InProcessCache]
) -> None:
    name, files, root = dataset
    a, b = two_nodes
    job = "job-peer-serve"
    keys = sorted(files)[:10]
    assert a.apply_quotas([_peer_quota(job, name, 40 * SIZE, b)], 1)
    assert b.apply_quotas([_peer_quota(job, name, 40 * SIZE, a)], 1)

    first = a.lease(job, name, keys)
    assert {o.tier for o in first.objects} == {"remote"}
    assert _cached(a, name, keys) == set(keys)
    for key in keys:  # from now on only node-a's cache has these bytes: a store read would fail
        (root / key).unlink()

    hits_before = _metric("silod_cache_peer_hits_total")
    served = b.lease(job, name, keys)
    assert [o.tier for o in served.objects] == ["peer"] * len(keys)
    assert read_leased(served) == {k: files[k] for k in keys}
    streamed = b.read_all(job, name, keys)
    assert streamed == {k: files[k] for k in keys}

    stats = _job(b, job)
    assert (stats.hits, stats.misses, stats.hit_ratio, stats.remote_bytes) == (20, 0, 1.0, 0)
    assert (stats.peer_hits, stats.peer_bytes, stats.cached_bytes) == (20, 20 * SIZE, 0)
    assert _cached(b, name, keys) == set(), "a peer's object must not be admitted: the job's nodes stay disjoint"
    assert _metric("silod_cache_peer_hits_total") - hits_before == 20
    # Serving a peer is not a read of the job on node-a.
    assert (_job(a, job).hits, _job(a, job).misses) == (0, 10)
    # A cached-only read is never passed on: node-b's own peer (node-a) holds these, node-b does not.
    request = cache_pb2.ReadRequest(job_id=job, dataset=name, keys=keys, cached_only=True)
    assert list(b.stub.Read(request)) == []


def test_prefetch_takes_what_a_peer_holds_from_the_peer_and_does_not_admit_it(
    dataset: tuple[str, dict[str, bytes], Path], two_nodes: tuple[InProcessCache, InProcessCache]
) -> None:
    name, files, root = dataset
    a, b = two_nodes
    job = "job-peer-prefetch"
    keys = sorted(files)[:10]
    others = sorted(files)[10:15]
    assert a.apply_quotas([_peer_quota(job, name, 40 * SIZE, b)], 1)
    assert b.apply_quotas([_peer_quota(job, name, 40 * SIZE, a)], 1)
    a.lease(job, name, keys)
    for key in keys:
        (root / key).unlink()

    queued = b.stub.Prefetch(cache_pb2.PrefetchRequest(job_id=job, dataset=name, keys=keys + others))
    assert queued.objects_queued == 15
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = b.call(lambda: b.core.job(job))
        if len(b.call(lambda: set(state.staged_from_peer))) == 10 and _cached(b, name, others) == set(others):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("prefetch did not finish")
    assert _cached(b, name, keys) == set()  # held for the job's read, not admitted
    assert _job(b, job).remote_bytes == 5 * SIZE  # the objects no peer held, from the store
    served = b.lease(job, name, keys + others)
    assert [o.tier for o in served.objects] == ["peer"] * 10 + ["disk"] * 5
    assert read_leased(served) == {k: files[k] for k in keys + others}
    stats = _job(b, job)
    assert (stats.hits, stats.misses, stats.peer_hits, stats.remote_bytes) == (15, 0, 10, 5 * SIZE)
    assert _cached(b, name, keys) == set()


def test_cached_only_reads_answer_from_the_cache_and_never_from_the_store(
    dataset: tuple[str, dict[str, bytes], Path], two_nodes: tuple[InProcessCache, InProcessCache]
) -> None:
    name, files, _ = dataset
    a, _ = two_nodes
    keys = sorted(files)
    a.lease("job-cached-only", name, keys[:3])
    request = cache_pb2.ReadRequest(job_id="job-cached-only", dataset=name, keys=keys[:6], cached_only=True)
    chunks = list(a.stub.Read(request))
    assert [c.key for c in chunks] == keys[:3]  # uncached keys get no chunks
    assert all(c.last and c.etag and c.tier == "disk" for c in chunks)
    assert {c.key: c.data for c in chunks} == {k: files[k] for k in keys[:3]}
    assert _job(a, "job-cached-only").remote_bytes == 3 * SIZE  # the lease only
    # A dataset nobody registered is just not cached: no manifest is needed for a cached-only read.
    assert list(a.stub.Read(cache_pb2.ReadRequest(dataset="never-registered", keys=["x"], cached_only=True))) == []

    for bad, field in [(cache_pb2.ReadRequest(dataset=name, keys=["../etc/passwd"], cached_only=True), "keys[0]"),
                       (cache_pb2.ReadRequest(dataset="", keys=["x"], cached_only=True), "dataset"),
                       (cache_pb2.ReadRequest(dataset=name, keys=[], cached_only=True), "keys")]:
        with pytest.raises(grpc.RpcError) as info:
            list(a.stub.Read(bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert info.value.details().startswith(f"{field}:"), info.value.details()


def test_two_readers_fill_disjoint_caches_and_the_next_epoch_hits_their_union(
    dataset: tuple[str, dict[str, bytes], Path], two_nodes: tuple[InProcessCache, InProcessCache]
) -> None:
    name, files, _ = dataset
    a, b = two_nodes
    job = "job-peer-epochs"
    keys = sorted(files)
    quota_a, quota_b = 30 * SIZE, 25 * SIZE  # qA + qB < D = 100 objects
    assert a.apply_quotas([_peer_quota(job, name, quota_a, b)], 1)
    assert b.apply_quotas([_peer_quota(job, name, quota_b, a)], 1)

    def epoch(seed: int) -> None:
        """A DistributedSampler's epoch: a fresh permutation, rank 0 (node-a) the even places,
        rank 1 (node-b) the odd ones, batch by batch on both nodes."""
        order = keys[:]
        random.Random(seed).shuffle(order)
        for start in range(0, COUNT, 20):
            for cache, mine in ((a, order[start:start + 20:2]), (b, order[start + 1:start + 20:2])):
                response = cache.lease(job, name, mine)
                assert read_leased(response) == {k: files[k] for k in mine}
                cache.stub.ReleaseLease(cache_pb2.ReleaseLeaseRequest(lease_id=response.lease_id))

    epoch(1)
    on_a, on_b = _cached(a, name, keys), _cached(b, name, keys)
    assert len(on_a) == 30 and len(on_b) == 25
    assert not on_a & on_b, "the job's content on its nodes must be disjoint"

    before = {c: _job(c, job) for c in (a, b)}
    epoch(2)
    ratios = {}
    for cache in (a, b):
        now, then = _job(cache, job), before[cache]
        hits, misses = now.hits - then.hits, now.misses - then.misses
        assert hits + misses == COUNT // 2
        ratios[cache.settings.node] = hits / (hits + misses)
        assert now.remote_bytes - then.remote_bytes == misses * SIZE
        assert now.peer_hits - then.peer_hits > 0  # part of its hits came from the other node
    pooled = (quota_a + quota_b) / (COUNT * SIZE)  # 0.55, what the simulator assumes
    total_hits = sum(_job(c, job).hits - before[c].hits for c in (a, b))
    assert total_hits == 55  # every cached object read once in the epoch, wherever it is cached
    for ratio in ratios.values():
        assert abs(ratio - pooled) < 0.15, ratios  # not quota_x / D (0.30 and 0.25)
    assert _cached(a, name, keys) == on_a and _cached(b, name, keys) == on_b  # full quotas: nothing admitted


def test_a_stopped_peer_does_not_fail_reads(
    dataset: tuple[str, dict[str, bytes], Path], two_nodes: tuple[InProcessCache, InProcessCache]
) -> None:
    name, files, _ = dataset
    a, b = two_nodes
    job = "job-peer-down"
    keys = sorted(files)[:10]
    assert a.apply_quotas([_peer_quota(job, name, 40 * SIZE, b)], 1)
    assert b.apply_quotas([_peer_quota(job, name, 40 * SIZE, a)], 1)
    a.lease(job, name, keys)
    a.stop()
    a.stopped = True  # type: ignore[attr-defined]
    errors_before = _metric("silod_cache_peer_errors_total", peer="node-a")

    started = time.monotonic()
    served = b.lease(job, name, keys)
    assert time.monotonic() - started < 5
    assert [o.tier for o in served.objects] == ["remote"] * len(keys)
    assert read_leased(served) == {k: files[k] for k in keys}
    assert b.read_all(job, name, sorted(files)[10:14]) == {k: files[k] for k in sorted(files)[10:14]}
    assert _metric("silod_cache_peer_errors_total", peer="node-a") > errors_before
    stats = _job(b, job)
    assert (stats.misses, stats.peer_hits, stats.remote_bytes) == (14, 0, 14 * SIZE)
    assert _cached(b, name, keys) == set(keys)  # read from the store: admitted here as before


def test_a_peer_that_never_answers_costs_one_deadline_then_is_skipped(
    dataset: tuple[str, dict[str, bytes], Path], tmp_path: Path, metadata: str
) -> None:
    name, files, _ = dataset
    keys = sorted(files)
    job = "job-peer-hung"
    # Accepts TCP connections (the kernel's backlog) but never speaks HTTP/2: a hung node.
    with socket.socket() as hung, InProcessCache(tmp_path / "b", metadata, node="node-b",
                                                 peer_timeout_s=0.5) as b:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        assert b.apply_quotas([_peer_quota(job, name, 40 * SIZE, ("node-hung", address))], 1)
        started = time.monotonic()
        first = b.lease(job, name, keys[:10])
        first_s = time.monotonic() - started
        assert read_leased(first) == {k: files[k] for k in keys[:10]}
        assert first_s < 3, first_s  # one deadline for the whole batch, not one per key
        started = time.monotonic()
        second = b.lease(job, name, keys[10:20])
        assert read_leased(second) == {k: files[k] for k in keys[10:20]}
        assert time.monotonic() - started < 0.4  # skipped while it cools down: no deadline paid
        assert _job(b, job).misses == 20


def test_peers_in_a_plan_are_checked(
    dataset: tuple[str, dict[str, bytes], Path], tmp_path: Path, metadata: str
) -> None:
    name, _, _ = dataset
    with InProcessCache(tmp_path / "a", metadata, node="node-a") as a:
        with pytest.raises(InvalidArgument, match=r"^cache_quotas\[0\]\.peers\[0\]\.node: must not be empty"):
            a.apply_quotas([_peer_quota("job-bad-peer", name, SIZE, ("", "127.0.0.1:1"))], 1)
        # Its own node among the peers (a plan cut for every node alike) is ignored, not asked.
        assert a.apply_quotas([_peer_quota("job-self-peer", name, SIZE, ("node-a", a.address))], 2)
        assert a.call(lambda: a.core.job("job-self-peer").peers) == ()


def test_a_peer_without_an_address_in_the_plan_is_found_through_the_metadata_service(
    dataset: tuple[str, dict[str, bytes], Path], two_nodes: tuple[InProcessCache, InProcessCache], metadata: str
) -> None:
    from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc

    name, files, root = dataset
    a, b = two_nodes
    job = "job-peer-lookup"
    keys = sorted(files)[:5]
    # gpus=0: no scheduler sharing this metadata service would place anything on it.
    with grpc.insecure_channel(metadata) as channel:
        metadata_pb2_grpc.MetadataServiceStub(channel).UpsertNode(metadata_pb2.UpsertNodeRequest(
            spec=common_pb2.NodeSpec(name="peer-lookup-a", gpus=0, pool=common_pb2.NODE_POOL_TRAINING,
                                     agent_address="127.0.0.1:1", cache_address=a.address)))
    assert a.apply_quotas([_peer_quota(job, name, 40 * SIZE)], 1)
    assert b.apply_quotas([_peer_quota(job, name, 40 * SIZE, ("peer-lookup-a", ""))], 1)
    a.lease(job, name, keys)
    for key in keys:
        (root / key).unlink()
    served = b.lease(job, name, keys)
    assert [o.tier for o in served.objects] == ["peer"] * len(keys)
    assert read_leased(served) == {k: files[k] for k in keys}
