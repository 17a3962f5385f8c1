"""Tenant quotas in the metadata store, its RPC and `silod admin tenant quota`, on SQLite and
PostgreSQL: set, merge, show, clear; bad input names its field or flag; only an admin sets a
quota; migration 0007 keeps the data in place."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from silod.v1 import access_pb2 as a
from silod.v1 import metadata_pb2_grpc

from services.metadata.migrate import current_revision, upgrade
from services.metadata.service import Settings
from services.metadata.store import MetadataStore
from silod.cli.main import main
from silod.rpc.channels import open_channel
from tests.metadata.metadata_harness import InProcessServer, PostgresScratch, assert_rpc_error
from tests.metadata.metadata_samples import training_spec

TOKEN = "cluster-secret"


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request, tmp_path: Path) -> Iterator[InProcessServer]:  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'meta.db'}"
    else:
        postgres: PostgresScratch = request.getfixturevalue("postgres")
        url = postgres.create()
    with InProcessServer(Settings(db=url, log_level="warning", auth_token=TOKEN)) as running:
        yield running


def stub(server: InProcessServer, token: str = TOKEN) -> metadata_pb2_grpc.MetadataServiceStub:
    return metadata_pb2_grpc.MetadataServiceStub(open_channel(server.address, token=token))


def test_set_show_clear_and_refusals(server: InProcessServer) -> None:
    admin = stub(server)
    admin.CreateTenant(a.CreateTenantRequest(name="vision", members=["alice"]))
    admin.CreateTenant(a.CreateTenantRequest(name="speech"))
    quota = a.TenantQuota(gpus=[a.GpuQuota(gpu_type="v100", gpus=8), a.GpuQuota(gpus=4)], cache_bytes=200 * 10**9,
                          remote_io_share=0.25, borrowing_limit_gpus=4)
    reply = admin.SetTenantQuota(a.SetTenantQuotaRequest(name="vision", quota=quota))
    assert reply.quota.cache_bytes == 200 * 10**9 and reply.quota.updated_at.seconds > 0
    assert not reply.quota.HasField("lending_limit_gpus") and list(reply.members) == ["alice"]
    listed = {t.name: t for t in admin.ListTenants(a.ListTenantsRequest()).tenants}
    assert {(g.gpu_type, g.gpus) for g in listed["vision"].quota.gpus} == {("v100", 8), ("", 4)}
    assert listed["vision"].quota.remote_io_share == 0.25 and not listed["speech"].HasField("quota")

    bad = a.TenantQuota(gpus=[a.GpuQuota(gpu_type="v100", gpus=-1), a.GpuQuota(gpu_type="v100", gpus=1)],
                        remote_io_share=1.5, lending_limit_gpus=-2)
    error = assert_rpc_error(lambda: admin.SetTenantQuota(a.SetTenantQuotaRequest(name="vision", quota=bad)),
                             grpc.StatusCode.INVALID_ARGUMENT, None)
    for field in ("quota.gpus[0].gpus", "quota.gpus[1].gpu_type", "quota.remote_io_share", "quota.lending_limit_gpus"):
        assert field in error.details(), field
    assert_rpc_error(lambda: admin.SetTenantQuota(a.SetTenantQuotaRequest(name="nobody", quota=quota)),
                     grpc.StatusCode.NOT_FOUND, "name")
    user = stub(server, admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="alice")).token)
    assert_rpc_error(lambda: user.SetTenantQuota(a.SetTenantQuotaRequest(name="vision")), grpc.StatusCode.PERMISSION_DENIED, None)
    # Nothing changed by the refusals; then an absent quota removes it.
    after = {t.name: t for t in admin.ListTenants(a.ListTenantsRequest()).tenants}["vision"]
    assert after.quota == listed["vision"].quota
    assert not admin.SetTenantQuota(a.SetTenantQuotaRequest(name="vision")).HasField("quota")


def test_the_cli(server: InProcessServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SILOD_AUTH_TOKEN", TOKEN)
    at = ("--metadata", server.address)

    def silod(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv) + list(at))
        out, err = capsys.readouterr()
        return code, out, err

    assert silod("admin", "tenant", "create", "vision", "alice")[0] == 0
    code, out, _ = silod("admin", "tenant", "quota", "vision", "--gpus", "4", "--gpus-type", "v100=8",
                         "--cache-bytes", "200G", "--remote-io", "25%")
    assert code == 0 and out.strip() == "vision: gpus 4, v100=8; cache 200 GB; remote IO 25%"
    code, out, _ = silod("admin", "tenant", "quota", "vision", "--borrowing-limit", "2", "--gpus-type", "v100=0")
    assert code == 0 and "gpus 4; cache 200 GB; remote IO 25%; borrow <= 2" in out  # merged, v100 removed
    code, out, _ = silod("admin", "tenant", "list")
    assert out.splitlines()[1].split() == ["vision", "alice"] and "quota: gpus 4;" in out.splitlines()[2]
    for flags, message in ((("--gpus", "-3"), "--gpus: expected a whole number"),
                           (("--remote-io", "2"), "--remote-io: expected a fraction"),
                           (("--cache-bytes", "lots"), "--cache-bytes: expected bytes"),
                           (("--gpus-type", "v100"), "--gpus-type: expected TYPE=N"),
                           (("--clear", "--gpus", "1"), "--clear: give it alone")):
        code, _, err = silod("admin", "tenant", "quota", "vision", *flags)
        assert code == 1 and message in err, (flags, err)
    code, _, err = silod("admin", "tenant", "quota", "nobody", "--gpus", "1")
    assert code == 1 and "NOT_FOUND: name" in err
    code, out, _ = silod("admin", "tenant", "quota", "vision", "--clear")
    assert code == 0 and out.strip() == "vision: no quota"
    assert silod("admin", "tenant", "quota", "vision")[1].strip() == "vision: no quota"


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_migration_0007_keeps_the_data(request, tmp_path, database) -> None:  # type: ignore[no-untyped-def]
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'old.db'}"
    else:
        postgres: PostgresScratch = request.getfixturevalue("postgres")
        url = postgres.create()
    upgrade(url, "0006")
    store = MetadataStore.open(url)
    try:
        job = store.jobs.create(training_spec(tenant="vision"))
        store.access.create_tenant("speech", ["bob"])
    finally:
        store.close()
    upgrade(url)
    store = MetadataStore.open(url)
    try:
        assert current_revision(store.db.engine) >= "0007"
        assert store.jobs.get(job.id) == job
        assert [(t.name, list(t.members), t.HasField("quota")) for t in store.access.list_tenants()] == \
            [("speech", ["bob"], False)]
        store.quotas.set_quota("speech", a.TenantQuota(gpus=[a.GpuQuota(gpus=2)]))
        assert store.quotas.quotas()["speech"].gpus[0].gpus == 2
    finally:
        store.close()
