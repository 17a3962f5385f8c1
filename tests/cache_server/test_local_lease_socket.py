"""The cache server's local lease socket (cache_server/local_socket.py) and the SDK's use of it:
the reader moves its Lease calls there after one gRPC Lease, forked workers of later epochs go
there straight away, refusals name the field as gRPC's do, a token guards it, a restarted
server's new socket is found again, and the sampler's prefetch hints ride on the Lease."""

from __future__ import annotations

import os
import socket
import struct
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from silod.data import SilodDataset
from silod.data.dataset import DataError
from silod.data.local_lease import LeaseRefused, LocalLeaseClient
from silod.v1 import cache_pb2
from tests.cache_server.harness import InProcessCache, digests, finish_job, make_dataset, register, start_job
from tests.sdk.test_sdk_data import _lease_calls
from tests.support.procs import free_port, start_service

GRPC_LEASE = "/silod.v1.CacheService/Lease"
LOCAL_LEASE = "local:/silod.v1.CacheService/Lease"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, metadata: str) -> tuple[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("socket-store")
    files = make_dataset(root, 120, 900, seed=5)
    register(metadata, "sock", f"file://{root}")
    return "sock", files


def _request(name: str, keys: list[str], job: str = "j", **extra: object) -> bytes:
    return cache_pb2.LeaseRequest(job_id=job, dataset=name, keys=keys, **extra).SerializeToString()  # type: ignore[arg-type]


def test_the_sdk_moves_its_leases_to_the_local_socket_after_one_grpc_lease(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    name, files = store
    with InProcessCache(tmp_path, metadata) as cache:
        path = cache.lease("probe", name, [next(iter(files))]).local_socket
        # By default beside the cache's files, where a reader on the node looks already.
        assert path == str(tmp_path / "disk" / "lease.sock") and Path(path).is_socket()
        grpc_before, local_before = _lease_calls(GRPC_LEASE), _lease_calls(LOCAL_LEASE)
        dataset = SilodDataset(name, cache_addr=cache.address, metadata_addr=metadata, job_id="moves")
        for start in range(0, 120, 30):
            assert dataset.read_batch(range(start, start + 30)) == [files[k] for k in dataset.keys[start:start + 30]]
        assert _lease_calls(GRPC_LEASE) - grpc_before == 1  # the first: it names the socket
        assert _lease_calls(LOCAL_LEASE) - local_before == 3
        assert dataset.counters["local_lease_calls"] == 3 and dataset.counters["direct"] == 0
        # Leases taken over the socket are released by the next call as over gRPC: one is held.
        assert cache.call(lambda: len(cache.core.leases.held)) == 2  # the probe's and this reader's last

        grpc_before = _lease_calls(GRPC_LEASE)
        stays = SilodDataset(name, cache_addr=cache.address, metadata_addr=metadata, job_id="stays",
                             use_local_socket=False)
        for start in range(0, 120, 30):
            assert stays.read_batch(range(start, start + 30)) == [files[k] for k in stays.keys[start:start + 30]]
        assert _lease_calls(GRPC_LEASE) - grpc_before == 4 and stays.counters["local_lease_calls"] == 0
    assert not os.path.exists(path)  # a stopped server leaves no socket behind


def test_forked_workers_of_later_epochs_go_to_the_socket_without_grpc(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    """A job process whose DataLoader forks two workers per epoch: the workers of the first epoch
    learn the socket from a gRPC Lease (each at most one), those of the second start on it."""
    name, files = store
    metrics_port = free_port()
    with start_service("cache-server", "--metadata-address", metadata, "--disk-cache-dir", str(tmp_path / "d"),
                       "--memory-cache-bytes", "0", "--metrics-port", str(metrics_port), "--log-level", "warning",
                       workdir=tmp_path / "cs") as proc:
        report, _ = finish_job(start_job("--dataset", name, "--cache", proc.address, "--metadata", metadata,
                                         "--job", "fork", "--epochs", "3", "--batch", "20", "--workers", "2"))
        assert report["epochs"] == [digests(files.values())] * 3
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    calls = {s.labels["method"]: s.value for family in text_string_to_metric_families(text)
             for s in family.samples
             if s.name == "silod_grpc_requests_total" and s.labels.get("code") == "OK"}
    assert calls.get(GRPC_LEASE, 0) + calls.get(LOCAL_LEASE, 0) == 18  # 3 epochs x 120 / 20
    assert 1 <= calls.get(GRPC_LEASE, 0) <= 2, calls  # only first-epoch workers, before the path was shared


def test_refusals_on_the_socket_name_the_field_as_grpc_does(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    name, files = store
    keys = list(files)[:2]
    with InProcessCache(tmp_path, metadata) as cache:
        path = cache.lease("probe", name, keys[:1]).local_socket
        client = LocalLeaseClient(path)
        bad_keys = [keys[0], "no/such/key"]
        with pytest.raises(LeaseRefused) as local:
            client.lease(_request(name, bad_keys))
        with pytest.raises(grpc.RpcError) as remote:
            cache.lease("j", name, bad_keys)
        assert local.value.code == remote.value.code() == grpc.StatusCode.NOT_FOUND
        assert local.value.message == remote.value.details()
        assert local.value.message.startswith("keys[1]: no object 'no/such/key'")
        with pytest.raises(LeaseRefused, match="job_id") as bad_id:
            client.lease(_request(name, keys, job="../up"))
        assert bad_id.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(LeaseRefused, match=r"prefetch_keys\[0\]: no object 'gone'") as hint:
            client.lease(_request(name, keys, prefetch_keys=["gone"]))
        assert hint.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(LeaseRefused, match="not a LeaseRequest"):
            client.lease(b"\xff\xff\xff")
        # The same connection still serves after each refusal.
        answer = cache_pb2.LeaseResponse.FromString(client.lease(_request(name, keys)))
        assert [Path(o.path).read_bytes() for o in answer.objects] == [files[k] for k in keys]

        # An SDK reader gets the same DataError over the socket as over gRPC.
        dataset = SilodDataset(name, cache_addr=cache.address, metadata_addr=metadata, job_id="sdk")
        dataset.read_batch([0])
        dataset.manifest.keys[1] = "no/such/key"
        with pytest.raises(DataError, match=r"cache server: NOT_FOUND: keys\[0\]: no object 'no/such/key'"):
            dataset.read_batch([1])
        assert dataset.counters["local_lease_calls"] == 0  # refused: not counted as served

        # Frames that break the protocol: an unknown kind, a length over the bound. The server
        # answers, closes that connection, and goes on serving others.
        with socket.socket(socket.AF_UNIX) as raw:
            raw.settimeout(10)
            raw.connect(path)
            raw.sendall(struct.pack(">I", 1) + b"\x00")  # hello, no token
            assert raw.recv(5) == struct.pack(">I", 1) + b"\x00"
            raw.sendall(struct.pack(">I", 2) + b"\x07x")
            answer = raw.recv(1024)
            assert answer[4] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"unknown frame kind 7" in answer
            assert raw.recv(1024) == b""  # closed
        with socket.socket(socket.AF_UNIX) as raw:
            raw.settimeout(10)
            raw.connect(path)
            raw.sendall(struct.pack(">I", 1 << 30))
            answer = raw.recv(1024)
            assert answer[4] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"at most" in answer
        assert cache_pb2.LeaseResponse.FromString(LocalLeaseClient(path).lease(_request(name, keys))).lease_id


def test_the_socket_asks_for_the_auth_token(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    name, files = store
    with InProcessCache(tmp_path, metadata, auth_token="s3cret") as cache:
        path = cache.definition.state["local_socket"].path  # type: ignore[attr-defined]
        with pytest.raises(LeaseRefused) as refused:
            LocalLeaseClient(path, token="guess")
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(LeaseRefused):
            LocalLeaseClient(path)  # none at all
        dataset = SilodDataset(name, cache_addr=cache.address, metadata_addr=metadata, job_id="tok", token="s3cret")
        for start in (0, 40, 80):
            assert dataset.read_batch(range(start, start + 40)) == [files[k] for k in dataset.keys[start:start + 40]]
        assert dataset.counters["local_lease_calls"] == 2


def test_a_restarted_server_has_a_new_socket_and_readers_find_it(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    name, files = store
    port = free_port()
    dataset = SilodDataset(name, cache_addr=f"127.0.0.1:{port}", metadata_addr=metadata, job_id="again")
    with InProcessCache(tmp_path, metadata, listen=f"127.0.0.1:{port}"):
        for start in (0, 30):
            dataset.read_batch(range(start, start + 30))
        first = dataset._local.path
        assert dataset.counters["local_lease_calls"] == 1
    with InProcessCache(tmp_path / "2", metadata, listen=f"127.0.0.1:{port}"):
        for start in (60, 90):
            assert dataset.read_batch(range(start, start + 30)) == [files[k] for k in dataset.keys[start:start + 30]]
        assert dataset._local is not None and dataset._local.path != first
        # The first batch after the restart went over gRPC (the old socket was gone), the next one
        # over the new socket; nothing was read around the cache.
        assert dataset.counters["local_lease_calls"] == 2 and dataset.counters["direct"] == 0


def test_no_socket_when_switched_off(store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str) -> None:
    name, files = store
    with InProcessCache(tmp_path, metadata, lease_socket="off") as cache:
        assert cache.lease("j", name, list(files)[:1]).local_socket == ""
        dataset = SilodDataset(name, cache_addr=cache.address, metadata_addr=metadata, job_id="off")
        for start in (0, 60):
            assert dataset.read_batch(range(start, start + 60)) == [files[k] for k in dataset.keys[start:start + 60]]
        assert dataset.counters["local_lease_calls"] == 0


def test_prefetch_hints_ride_on_the_lease(store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str) -> None:
    """A Lease's prefetch_keys are queued as a Prefetch call's keys: they are fetched in the
    background and the next Lease finds them cached."""
    name, files = store
    keys = list(files)
    with InProcessCache(tmp_path, metadata) as cache:
        first = cache.stub.Lease(cache_pb2.LeaseRequest(job_id="hint", dataset=name, keys=keys[:10],
                                                        prefetch_keys=keys[10:40]))
        assert {o.tier for o in first.objects} == {"remote"}
        cached = lambda: cache.call(lambda: sum((name, k) in cache.core.entries.index for k in keys[10:40]))  # noqa: E731
        deadline = time.monotonic() + 20
        while cached() < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cached() == 30
        second = cache.lease("hint", name, keys[10:40])
        assert {o.tier for o in second.objects} == {"disk"}
        with pytest.raises(grpc.RpcError) as refused:
            cache.stub.Lease(cache_pb2.LeaseRequest(job_id="hint", dataset=name, keys=keys[:1],
                                                    prefetch_keys=[keys[0], "../x"]))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("prefetch_keys[1]: ")


def test_a_given_socket_path_is_reused_when_stale_and_never_taken_from_a_live_server(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    name, files = store
    path = tmp_path / "lease.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # bound, never listening: what a killed server leaves behind
    stale.close()
    with InProcessCache(tmp_path / "a", metadata, lease_socket=str(path)) as first:
        assert first.lease("j", name, list(files)[:1]).local_socket == str(path)
        with InProcessCache(tmp_path / "b", metadata, lease_socket=str(path)) as second:
            assert second.lease("j", name, list(files)[:1]).local_socket == ""  # gRPC only, first keeps it
        assert LocalLeaseClient(str(path)).lease(_request(name, list(files)[:1]))


def test_a_tier_path_too_long_for_a_socket_puts_it_in_a_temporary_directory(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    name, files = store
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with InProcessCache(tmp_path, metadata, disk_cache_dir=str(deep)) as cache:
        path = cache.lease("j", name, list(files)[:1]).local_socket
        assert Path(path).parent.name.startswith("silod-lease-") and Path(path).is_socket()
        assert LocalLeaseClient(path).lease(_request(name, list(files)[:1]))
    assert not Path(path).parent.exists()  # the server's own directory goes with it


def test_threads_of_one_reader_lease_at_the_same_time_each_on_its_own_connection(
    store: tuple[str, dict[str, bytes]], tmp_path: Path, metadata: str
) -> None:
    """A job that reads ahead in a thread of its own (silod/jobs/emulated.py) leases from two
    threads at once: each call gets a connection of its own, none waits for another's answer."""
    from concurrent.futures import ThreadPoolExecutor

    name, files = store
    with InProcessCache(tmp_path, metadata) as cache:
        dataset = SilodDataset(name, cache_addr=cache.address, metadata_addr=metadata, job_id="threads")
        dataset.read_batch([0])  # learns the socket
        local_before = _lease_calls(LOCAL_LEASE)

        def batch(start: int) -> bool:
            return dataset.read_batch(range(start, start + 12)) == [files[k] for k in dataset.keys[start:start + 12]]

        with ThreadPoolExecutor(6) as pool:
            assert all(pool.map(batch, [i % 108 for i in range(0, 6 * 12 * 8, 12)]))
        # Counted by the server (the reader's counters are not meant for several threads).
        assert _lease_calls(LOCAL_LEASE) - local_before == 48 and dataset.counters["direct"] == 0
        assert 1 <= len(dataset._local._idle) <= 6  # connections opened as calls overlapped, then kept


def test_a_jobs_own_credential_leases_its_own_job_on_the_socket(
    store: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    """With auth on, ranks hold their job's credential (not the cluster token): the socket takes
    it, for that job's leases only, and stops taking it once it is revoked."""
    from services.metadata.service import Settings as MetadataSettings
    from silod.rpc.channels import open_channel
    from silod.v1 import access_pb2 as a
    from silod.v1 import metadata_pb2, metadata_pb2_grpc
    from tests.metadata.metadata_harness import InProcessServer
    from tests.metadata.metadata_samples import training_spec

    _, files = store
    keys = sorted(files)[:4]
    secured = MetadataSettings(db=f"sqlite:///{tmp_path / 'md.db'}", listen="127.0.0.1:0", log_level="warning",
                               auth_token="cluster-secret")
    with InProcessServer(secured) as metadata:
        md = metadata_pb2_grpc.MetadataServiceStub(open_channel(metadata.address, token="cluster-secret"))
        job = md.CreateJob(metadata_pb2.CreateJobRequest(spec=training_spec(name="mine", dataset="ds-not-registered")))
        other = md.CreateJob(metadata_pb2.CreateJobRequest(spec=training_spec(name="other")))
        issued = md.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_JOB, name=job.id))
        user = md.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_ADMIN, name="ops"))
        with InProcessCache(tmp_path, metadata.address, auth_token="cluster-secret", credential_cache_s=0.2) as cache:
            path = cache.definition.state["local_socket"].path  # type: ignore[attr-defined]
            client = LocalLeaseClient(path, token=issued.token)
            with pytest.raises(LeaseRefused) as refused:
                client.lease(_request("ds-not-needed", keys, job=other.id))
            assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED and "job_id" in str(refused.value)
            # Its own job, another dataset than its spec names: refused, as over gRPC (the access table).
            with pytest.raises(LeaseRefused) as elsewhere:
                client.lease(_request("ds-not-needed", keys, job=job.id))
            assert elsewhere.value.code == grpc.StatusCode.PERMISSION_DENIED and "dataset" in str(elsewhere.value)
            # Its own job and dataset: past the credential check (the dataset is not registered here: NOT_FOUND).
            with pytest.raises(LeaseRefused) as own:
                client.lease(_request("ds-not-registered", keys, job=job.id))
            assert own.value.code == grpc.StatusCode.NOT_FOUND, own.value
            with pytest.raises(LeaseRefused) as admin_kind:
                LocalLeaseClient(path, token=user.token)
            assert admin_kind.value.code == grpc.StatusCode.PERMISSION_DENIED
            LocalLeaseClient(path, token="cluster-secret")  # the cluster token, as before
            # Revoked: the open connection is refused at its next call once the cache lapses.
            md.RevokeCredential(a.RevokeCredentialRequest(id=issued.credential.id))
            time.sleep(0.5)
            with pytest.raises(LeaseRefused) as revoked:
                client.lease(_request("ds-not-registered", keys, job=job.id))
            assert revoked.value.code == grpc.StatusCode.UNAUTHENTICATED
