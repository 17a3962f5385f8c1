"""The SDK data API: SilodDataset (batched lease path, direct reads, fallback) and
EpochShuffleSampler (order, epochs, shards, prefetch hints)."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch.utils.data
from prometheus_client import REGISTRY

from silod.data import EpochShuffleSampler, SilodDataset
from silod.data.dataset import DataError
from silod.data.sampler import HintedIndex
from silod.v1 import cache_pb2, cache_pb2_grpc
from tests.cache_server.harness import InProcessCache, digests, finish_job, make_dataset, register, start_job
from tests.support.procs import free_port, start_service


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, metadata: str) -> tuple[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("sdk-store")
    files = make_dataset(root, 300, 1500, seed=21)
    register(metadata, "sdk", f"file://{root}")
    return "sdk", files


def _lease_calls(method: str = "") -> float:
    """Lease calls the cache server answered OK: over gRPC, on its local lease socket, or both ("")."""
    methods = [method] if method else ["/silod.v1.CacheService/Lease", "local:/silod.v1.CacheService/Lease"]
    return sum(REGISTRY.get_sample_value(
        "silod_grpc_requests_total", {"service_process": "cache-server", "method": m, "code": "OK"},
    ) or 0.0 for m in methods)


def test_dataset_reads_through_the_cache_with_one_lease_per_batch(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    name, files = store
    with InProcessCache(tmp_path, metadata) as cache:
        dataset = SilodDataset(name, cache_addr=cache.address, metadata_addr=metadata, job_id="sdk-job",
                               transform=lambda b: b[::-1])
        assert len(dataset) == 300 and dataset.keys == sorted(files)
        assert dataset[5] == files[dataset.keys[5]][::-1]
        assert dataset[-1] == files[dataset.keys[-1]][::-1]
        with pytest.raises(IndexError):
            dataset[300]
        before = _lease_calls()
        loader = torch.utils.data.DataLoader(dataset, batch_size=25, shuffle=True, collate_fn=list)
        seen = Counter(b for batch in loader for b in batch)
        assert seen == Counter(v[::-1] for v in files.values())
        assert _lease_calls() - before == 12  # 300 samples / 25 per batch: no per-sample RPC
        assert dataset.counters["leased"] == 302 and dataset.counters["direct"] == 0
        job = cache.stats("sdk-job").jobs[0]
        assert job.hits + job.misses == 302


def test_each_lease_releases_the_previous_one_and_workers_release_their_last_at_exit(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    """One call per batch: the reader's next Lease carries the previous lease id
    (release_lease_ids); a DataLoader worker's last lease is released when the worker exits."""
    name, files = store
    with InProcessCache(tmp_path, metadata) as cache:
        dataset = SilodDataset(name, cache_addr=cache.address, metadata_addr=metadata, job_id="rel")
        held = lambda: cache.call(lambda: len(cache.core._leases))  # noqa: E731
        for start in range(0, 100, 25):
            assert dataset.read_batch(range(start, start + 25)) == [files[k] for k in dataset.keys[start:start + 25]]
            assert held() == 1  # this batch's lease; the one before went with this call
        assert dataset._done_leases and cache.call(lambda: dataset._done_leases[0] in cache.core._leases)
        # DataLoader workers (forkserver: this process runs a gRPC server) each exit holding the
        # lease of their last batch and release it then.
        loader = torch.utils.data.DataLoader(dataset, batch_size=25, num_workers=2, collate_fn=list,
                                             multiprocessing_context="forkserver")
        assert sum(len(batch) for batch in loader) == 300
        assert held() == 1  # only this process's own last lease is left
        with pytest.raises(grpc.RpcError) as refused:  # a malformed id is refused, naming it
            cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address)).Lease(cache_pb2.LeaseRequest(
                job_id="rel", dataset=name, keys=dataset.keys[:1], release_lease_ids=["ok-1", "../x"]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("release_lease_ids[1]: a lease id may not contain '/'")


def test_dataloader_workers_open_their_own_channels(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    """A job process (tests/sdk/sdk_job.py) whose DataLoader forks two workers per epoch; the
    parent talks to the cache server too (Prefetch hints from the sampler)."""
    name, files = store
    with start_service("cache-server", "--metadata-address", metadata, "--disk-cache-dir", str(tmp_path / "d"),
                       "--memory-cache-bytes", "0", "--log-level", "warning", workdir=tmp_path / "cs") as proc:
        report, _ = finish_job(start_job("--dataset", name, "--cache", proc.address, "--metadata", metadata,
                                         "--job", "w", "--epochs", "2", "--batch", "30"))
        assert report["epochs"] == [digests(files.values())] * 2
        stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(proc.address))
        job = stub.Stats(cache_pb2.StatsRequest(job_id="w")).jobs[0]
        assert job.hits >= 300 and job.misses <= 300 and job.hits + job.misses == 600


def test_off_cluster_reads_the_store_directly(store: tuple[str, dict[str, bytes]], metadata: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    name, files = store
    monkeypatch.delenv("SILOD_CACHE_ADDR", raising=False)
    monkeypatch.setenv("SILOD_METADATA_ADDR", metadata)
    monkeypatch.setenv("SILOD_JOB_ID", "from-env")
    dataset = SilodDataset(name)
    assert (dataset.cache_addr, dataset.metadata_addr, dataset.job_id) == ("", metadata, "from-env")
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, collate_fn=list)
    assert Counter(b for batch in loader for b in batch) == Counter(files.values())
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy[7] == files[dataset.keys[7]]


def test_unreachable_cache_falls_back_once_and_tries_again_later(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str, caplog: pytest.LogCaptureFixture
) -> None:
    name, files = store
    port = free_port()
    dataset = SilodDataset(name, cache_addr=f"127.0.0.1:{port}", metadata_addr=metadata, job_id="fb",
                           retry_cache_after_s=0.0)
    caplog.set_level(logging.DEBUG, logger="silod.data")
    batches = [list(range(i, i + 50)) for i in range(0, 300, 50)]
    for batch in batches[:3]:
        assert dataset.__getitems__(batch) == [files[dataset.keys[i]] for i in batch]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert dataset.counters["direct"] == 150
    # The cache server comes up where the job expects it: the next batch goes through it again.
    with InProcessCache(tmp_path, metadata, listen=f"127.0.0.1:{port}") as cache:  # noqa: SIM117
        assert dataset.__getitems__(batches[3]) == [files[dataset.keys[i]] for i in batches[3]]
        assert cache.stats("fb").jobs[0].misses == 50
    assert dataset.counters["leased"] == 50


def test_objects_the_server_could_not_materialize_are_read_directly(
    store: tuple[str, dict[str, bytes]], metadata: str
) -> None:
    name, files = store
    dataset = SilodDataset(name, cache_addr="127.0.0.1:1", metadata_addr=metadata)
    keys = dataset.keys[:3]

    class Stub:
        class ReleaseLease:
            @staticmethod
            def future(request: Any, timeout: float) -> None:
                return None

        def Lease(self, request: Any, timeout: float) -> cache_pb2.LeaseResponse:
            return cache_pb2.LeaseResponse(lease_id="l", objects=[
                cache_pb2.LeasedObject(key=k, path="" if i != 1 else "/nonexistent", size_bytes=1500,
                                       etag=dataset.manifest.etags[i], tier="remote")
                for i, k in enumerate(keys)
            ])

    dataset._ensure_process()
    dataset._stub = Stub()
    assert dataset.__getitems__([0, 1, 2]) == [files[k] for k in keys]
    assert dataset.counters["lease_unreadable"] == 3 and dataset.counters["direct"] == 3


def test_unknown_dataset(metadata: str) -> None:
    with pytest.raises(DataError, match="not registered"):
        SilodDataset("no-such-dataset", cache_addr="", metadata_addr=metadata)


class _Hints:
    cache_addr = "127.0.0.1:1"

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def prefetch_hint(self, positions: list[int]) -> None:
        raise AssertionError("the sampler must not call the cache itself (it runs where workers are forked)")


def test_sampler_orders_epochs_shards_and_hints() -> None:
    data = _Hints(1000)
    sampler = EpochShuffleSampler(data, seed=3, prefetch_ahead=100)
    first = list(sampler)
    assert sorted(first) == list(range(1000)) and first != list(range(1000))
    assert list(sampler) == first  # same epoch, same order
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(1000)) and second != first
    # Hints ride on the indices (to the worker that reads them): the first index carries two
    # chunks, then every chunk boundary carries the chunk after the next.
    hinted = [(i, index.prefetch_hint) for i, index in enumerate(second) if isinstance(index, HintedIndex)]
    assert [i for i, _ in hinted] == list(range(0, 900, 100))
    assert [p for _, hint in hinted for p in hint] == second
    assert pickle.loads(pickle.dumps(second[100])).prefetch_hint == second[200:300]
    assert not any(isinstance(i, HintedIndex) for i in EpochShuffleSampler(data, prefetch=False))
    assert list(EpochShuffleSampler(data, seed=3, epoch=1)) == second

    shards = [list(EpochShuffleSampler(_Hints(10), seed=1, num_replicas=3, rank=r, prefetch=False)) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]
    assert set().union(*shards) == set(range(10))
    assert len(EpochShuffleSampler(_Hints(10), num_replicas=3, rank=0, drop_last=True)) == 3
    with pytest.raises(ValueError):
        EpochShuffleSampler(data, num_replicas=2, rank=2)


def test_torch_stays_out_of_the_rest_of_silod() -> None:
    code = ("import sys, cache_server.service, silod.data, silod.data.store, silod.data.catalog; "
            "from silod.cli.main import build_parser; build_parser(['cache-server']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_transform_applies_to_leased_and_directly_read_samples_alike(
    store: tuple[str, dict[str, bytes]], metadata: str, tmp_path: Path
) -> None:
    name, files = store
    dataset = SilodDataset(name, cache_addr="127.0.0.1:1", metadata_addr=metadata, transform=lambda b: b[::-1])
    keys = dataset.keys[:3]
    leased = tmp_path / "leased"
    leased.write_bytes(files[keys[0]])

    class Stub:
        def Lease(self, request: Any, timeout: float) -> cache_pb2.LeaseResponse:
            # The first from a leased file, the other two not materialized: read from the store.
            return cache_pb2.LeaseResponse(lease_id="l", objects=[
                cache_pb2.LeasedObject(key=k, path=str(leased) if i == 0 else "", size_bytes=1500,
                                       etag=dataset.manifest.etags[i], tier="memory" if i == 0 else "remote")
                for i, k in enumerate(keys)
            ])

        def ReleaseLease(self, request: Any, timeout: float) -> None:
            return None

    dataset._ensure_process()
    dataset._stub = Stub()
    assert dataset.__getitems__([0, 1, 2]) == [files[k][::-1] for k in keys]
    assert dataset.counters["lease_unreadable"] == 2 and dataset.counters["direct"] == 2


def test_loader_pins_memory_only_for_a_gpu_and_to_device_moves_nested_batches(
        store: tuple[str, dict[str, bytes]], metadata: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    import torch

    import silod.data

    name, files = store
    monkeypatch.delenv("SILOD_CACHE_ADDR", raising=False)
    monkeypatch.setenv("SILOD_METADATA_ADDR", metadata)
    dataset = SilodDataset(name, transform=len)
    # The GPU path's choice, checked here without a GPU: batches bound for CUDA come from pinned memory.
    assert silod.data.loader(dataset, batch_size=8, device="cuda").pin_memory is True
    assert silod.data.loader(dataset, batch_size=8, device="cuda", pin_memory=False).pin_memory is False
    cpu_loader = silod.data.loader(dataset, batch_size=64, device="cpu")  # the default on this machine too
    assert cpu_loader.pin_memory is False and silod.data.loader(dataset, batch_size=8).pin_memory is False
    sizes = sorted(int(n) for batch in cpu_loader for n in silod.data.to_device(batch, "cpu"))
    assert sizes == sorted(len(b) for b in files.values())
    Pair = collections.namedtuple("Pair", "x y")
    moved = silod.data.to_device({"a": [torch.ones(2), (torch.zeros(1), "label")], "p": Pair(torch.ones(1), 3)},
                                 torch.device("cpu"))
    assert isinstance(moved["p"], Pair) and moved["p"].y == 3 and moved["a"][1][1] == "label"
    assert torch.equal(moved["a"][0], torch.ones(2))
