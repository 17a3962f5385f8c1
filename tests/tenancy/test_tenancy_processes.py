"""Many teams on one cluster, with real `silod metadata` and `silod scheduler` processes and auth on:
an admin makes tenants and user credentials with `silod admin`, users see and act on their own
tenant's jobs only, a revoked credential is refused within the cache TTL without a restart, the
cluster token is still an admin, and an upgraded database keeps its jobs (SQLite, PostgreSQL)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from silod.v1 import access_pb2 as a, common_pb2, metadata_pb2 as m, metadata_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from services.metadata.migrate import upgrade
from services.metadata.store import MetadataStore
from silod.cli import locate
from silod.cli.main import main
from silod.launcher import ServiceProcess, start_service
from silod.rpc.channels import open_channel
from tests.metadata.metadata_harness import PostgresScratch, assert_rpc_error
from tests.metadata.metadata_samples import training_spec

CLUSTER_TOKEN = "cluster-secret-for-tests"
CACHE_S = 1.0  # the scheduler's credential_cache_s: how long a revoked credential may still work there
DENIED, UNAUTHENTICATED = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED
PENDING, CANCELLED = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_CANCELLED


@pytest.fixture
def isolated_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("SILOD_AUTH_TOKEN", "SILOD_CLIENT_CONFIG", locate.LOGIN_FILE_ENV, "SILOD_METADATA_ADDR",
                 "SILOD_SCHEDULER_ADDR", "SILOD_STATE_DIR", "SILOD_TLS_CA_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def cluster(isolated_user: Path) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    auth = ("--auth-token", CLUSTER_TOKEN, "--log-level", "warning")
    with start_service("metadata", "--db", f"sqlite:///{isolated_user / 'meta.db'}", *auth,
                       workdir=isolated_user / "md") as metadata, \
         start_service("scheduler", "--metadata-address", metadata.address, "--interval-s", "600",
                       "--credential-cache-s", str(CACHE_S), *auth, workdir=isolated_user / "sched") as scheduler:
        yield metadata, scheduler


def jobs_stub(address: str, token: str) -> scheduler_pb2_grpc.JobServiceStub:
    return scheduler_pb2_grpc.JobServiceStub(open_channel(address, token=token))


def submit(stub: scheduler_pb2_grpc.JobServiceStub, tenant: str) -> common_pb2.Job:
    spec = common_pb2.JobSpec(name=f"{tenant}-job", tenant=tenant, application="cifar10", min_gpus=1, max_gpus=1,
                              batch_size=128, epochs=1)
    return stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))


def admin_cli(capsys: pytest.CaptureFixture[str], metadata: str, *argv: str) -> str:
    code = main(["admin", *argv, "--metadata", metadata, "--token", CLUSTER_TOKEN])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_teams_share_a_cluster(cluster, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    metadata, scheduler = cluster
    admin_cli(capsys, metadata.address, "tenant", "create", "vision", "alice")
    admin_cli(capsys, metadata.address, "tenant", "create", "speech", "bob")
    alice_token = admin_cli(capsys, metadata.address, "credential", "create", "user", "alice").strip()
    bob_token = admin_cli(capsys, metadata.address, "credential", "create", "user", "bob").strip()
    admin, alice, bob = (jobs_stub(scheduler.address, t) for t in (CLUSTER_TOKEN, alice_token, bob_token))

    visions = [submit(alice, "vision") for _ in range(2)]
    speech = submit(bob, "speech")
    refused = assert_rpc_error(lambda: submit(bob, "vision"), DENIED, "spec.tenant")
    assert "'bob' is not a member of tenant 'vision'" in refused.details()
    assert_rpc_error(lambda: submit(bob, ""), DENIED, "spec.tenant")  # empty is the default tenant
    all_jobs = admin.ListJobs(m.ListJobsRequest()).jobs  # the cluster token is still an admin
    assert sorted(j.id for j in all_jobs) == sorted([*(j.id for j in visions), speech.id]), "refusals created nothing"

    assert sorted(j.id for j in alice.ListJobs(m.ListJobsRequest()).jobs) == sorted(j.id for j in visions)
    assert [j.id for j in bob.ListJobs(m.ListJobsRequest()).jobs] == [speech.id]
    assert_rpc_error(lambda: bob.ListJobs(m.ListJobsRequest(tenant="vision")), DENIED, "tenant")

    assert_rpc_error(lambda: alice.CancelJob(scheduler_pb2.CancelJobRequest(job_id=speech.id)), DENIED, "job_id")
    assert_rpc_error(lambda: alice.GetJob(m.GetJobRequest(job_id=speech.id)), DENIED, "job_id")
    assert_rpc_error(lambda: next(iter(alice.WatchJob(scheduler_pb2.WatchJobRequest(job_id=speech.id)))),
                     DENIED, "job_id")
    assert admin.GetJob(m.GetJobRequest(job_id=speech.id)).state == PENDING, "a refused cancel changes nothing"
    assert alice.CancelJob(scheduler_pb2.CancelJobRequest(job_id=visions[0].id)).state == CANCELLED
    assert admin.CancelJob(scheduler_pb2.CancelJobRequest(job_id=speech.id)).state == CANCELLED

    # `silod login`, then a client command with no token given: it uses the stored credential.
    (Path.cwd() / "alice.token").write_text(alice_token)
    assert main(["login", "--token-file", "alice.token"]) == 0
    capsys.readouterr()
    assert main(["jobs", "--scheduler", scheduler.address]) == 0
    listed = capsys.readouterr().out
    assert visions[1].id in listed and speech.id not in listed

    # Revoked: refused by the scheduler within its cache TTL, with no restart.
    credential_id = alice_token.split("_")[1]
    alice.ListJobs(m.ListJobsRequest())  # cached as valid now
    admin_cli(capsys, metadata.address, "credential", "revoke", credential_id)
    revoked_at = time.monotonic()
    while True:
        try:
            alice.ListJobs(m.ListJobsRequest())
        except grpc.RpcError as exc:
            assert exc.code() == UNAUTHENTICATED
            break
        assert time.monotonic() - revoked_at < CACHE_S + 2, "the revoked credential still works past the cache TTL"
        time.sleep(0.1)
    metadata_as_alice = metadata_pb2_grpc.MetadataServiceStub(open_channel(metadata.address, token=alice_token))
    assert_rpc_error(lambda: metadata_as_alice.ListDatasets(m.ListDatasetsRequest()), UNAUTHENTICATED, None)
    assert [j.id for j in bob.ListJobs(m.ListJobsRequest()).jobs] == [speech.id], "other credentials still work"


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_an_upgraded_cluster_keeps_its_jobs_and_teams(request, isolated_user: Path, database: str) -> None:  # type: ignore[no-untyped-def]
    if database == "sqlite":
        url = f"sqlite:///{isolated_user / 'old.db'}"
    else:
        postgres: PostgresScratch = request.getfixturevalue("postgres")
        url = postgres.create()
    upgrade(url, "0003")  # the schema before identities and access
    store = MetadataStore.open(url)
    try:
        old = {t: store.jobs.create(training_spec(tenant=t)) for t in ("vision", "speech")}
    finally:
        store.close()
    with start_service("metadata", "--db", url, "--auth-token", CLUSTER_TOKEN, "--log-level", "warning",
                       workdir=isolated_user / "md") as metadata:  # migrates at start
        admin = metadata_pb2_grpc.MetadataServiceStub(open_channel(metadata.address, token=CLUSTER_TOKEN))
        assert sorted(j.id for j in admin.ListJobs(m.ListJobsRequest()).jobs) == sorted(j.id for j in old.values())
        assert [t.name for t in admin.ListTenants(a.ListTenantsRequest()).tenants] == ["speech", "vision"]
        admin.SetTenantMembers(a.SetTenantMembersRequest(name="vision", members=["alice"]))
        token = admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="alice")).token
        alice = metadata_pb2_grpc.MetadataServiceStub(open_channel(metadata.address, token=token))
        assert [j.id for j in alice.ListJobs(m.ListJobsRequest()).jobs] == [old["vision"].id]
