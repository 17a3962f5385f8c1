"""Credentials and tenants in the metadata store, on SQLite and PostgreSQL: issue, resolve,
revoke, rotate, expire; tenants and members; bad input names its field; the 0004 migration."""

from __future__ import annotations

from datetime import timedelta

import grpc
import pytest
from silod.v1 import access_pb2 as a

from services.metadata.migrate import head_revision, upgrade
from services.metadata.store import MetadataStore
from services.metadata.store import access as access_module
from services.runtime.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from services.runtime.principals import Principal
from tests.metadata.metadata_harness import PostgresScratch, assert_rpc_error
from tests.metadata.metadata_samples import training_spec

USER, NODE, JOB, ADMIN = a.PRINCIPAL_KIND_USER, a.PRINCIPAL_KIND_NODE, a.PRINCIPAL_KIND_JOB, a.PRINCIPAL_KIND_ADMIN


def issue(store: MetadataStore, kind: int, name: str, **fields: object) -> a.IssuedCredential:
    return store.access.create_credential(a.CreateCredentialRequest(kind=kind, name=name, **fields))


def test_a_credential_resolves_to_its_principal_and_only_its_hash_is_stored(store: MetadataStore) -> None:
    store.access.create_tenant("vision", ["alice"])
    store.access.create_tenant("speech", ["alice", "bob"])
    issued = issue(store, USER, "alice", description="laptop")
    assert issued.token.startswith(f"silod_{issued.credential.id}_")
    assert store.access.resolve(issued.token) == Principal(USER, "alice", ("speech", "vision"), issued.credential.id)
    with store.db.read() as session:
        stored = session.get(access_module.Credential, issued.credential.id)
        assert issued.token.split("_")[2] not in (stored.secret_sha256, stored.description)

    job = store.jobs.create(training_spec(tenant="vision"))
    assert store.access.resolve(issue(store, JOB, job.id).token).tenants == ("vision",)
    assert store.access.resolve(issue(store, NODE, "node-0").token) == Principal(
        NODE, "node-0", (), store.access.list_credentials(NODE)[0].id)


def test_membership_changes_show_at_the_next_resolve(store: MetadataStore) -> None:
    store.access.create_tenant("vision", [])
    token = issue(store, USER, "alice").token
    assert store.access.resolve(token).tenants == ()
    store.access.set_members("vision", ["carol", "alice"])
    assert store.access.resolve(token).tenants == ("vision",)
    assert [t.members for t in store.access.list_tenants()] == [["alice", "carol"]]
    assert [t.name for t in store.access.list_tenants(member="bob")] == []


@pytest.mark.parametrize("mangle", [
    lambda t: t[:-1] + ("0" if t[-1] != "0" else "1"),  # wrong secret
    lambda t: "silod_0123456789abcdef_" + t.split("_")[2],  # unknown id
    lambda t: t.replace("silod_", "other_"),
    lambda t: "",
])
def test_a_wrong_token_is_unauthenticated_without_saying_why(store: MetadataStore, mangle) -> None:  # type: ignore[no-untyped-def]
    token = issue(store, USER, "alice").token
    with pytest.raises(Unauthenticated, match="^invalid bearer token$"):
        store.access.resolve(mangle(token))


def test_revoke_rotate_and_expiry(store: MetadataStore, monkeypatch: pytest.MonkeyPatch) -> None:
    first = issue(store, USER, "alice", ttl_s=3600)
    rotated = store.access.rotate_credential(first.credential.id, 0)
    assert rotated.credential.name == "alice" and not rotated.credential.HasField("expires_at")
    with pytest.raises(Unauthenticated):
        store.access.resolve(first.token)
    assert store.access.resolve(rotated.token).name == "alice"
    with pytest.raises(FailedPrecondition) as refused:
        store.access.rotate_credential(first.credential.id, 0)
    assert refused.value.field == "id"

    revoked = store.access.revoke_credential(rotated.credential.id)
    assert revoked.HasField("revoked_at")
    assert store.access.revoke_credential(rotated.credential.id) == revoked, "revoking twice changes nothing"
    with pytest.raises(Unauthenticated):
        store.access.resolve(rotated.token)
    assert store.access.list_credentials() == []
    assert len(store.access.list_credentials(include_revoked=True)) == 2

    short = issue(store, NODE, "node-1", ttl_s=60)
    assert store.access.resolve(short.token).name == "node-1"
    later = access_module.utc_now() + timedelta(seconds=61)
    monkeypatch.setattr(access_module, "utc_now", lambda: later)
    with pytest.raises(Unauthenticated):
        store.access.resolve(short.token)


@pytest.mark.parametrize("fields, error, field", [
    ({"kind": 0, "name": "alice"}, InvalidArgument, "kind"),
    ({"kind": USER, "name": ""}, InvalidArgument, "name"),
    ({"kind": USER, "name": "al ice"}, InvalidArgument, "name"),
    ({"kind": NODE, "name": "-node"}, InvalidArgument, "name"),
    ({"kind": USER, "name": "alice", "ttl_s": -1}, InvalidArgument, "ttl_s"),
    ({"kind": USER, "name": "alice", "ttl_s": float("nan")}, InvalidArgument, "ttl_s"),
    ({"kind": USER, "name": "alice", "description": "x" * 1025}, InvalidArgument, "description"),
    ({"kind": JOB, "name": "job-000000000000"}, NotFound, "name"),
])
def test_bad_credential_requests_name_the_field(store: MetadataStore, fields, error, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error) as refused:
        store.access.create_credential(a.CreateCredentialRequest(**fields))
    assert refused.value.field == field


def test_bad_tenant_requests_name_the_field(store: MetadataStore) -> None:
    store.access.create_tenant("vision", [])
    cases = [
        (lambda: store.access.create_tenant("vision", []), AlreadyExists, "name"),
        (lambda: store.access.create_tenant("bad name", []), InvalidArgument, "name"),
        (lambda: store.access.create_tenant("ok", ["alice", "b b"]), InvalidArgument, "members[1]"),
        (lambda: store.access.create_tenant("ok", ["alice", "alice"]), InvalidArgument, "members"),
        (lambda: store.access.set_members("nope", []), NotFound, "name"),
        (lambda: store.access.revoke_credential("nope"), NotFound, "id"),
        (lambda: store.access.revoke_credential(""), InvalidArgument, "id"),
    ]
    for call, error, field in cases:
        with pytest.raises(error) as refused:
            call()
        assert refused.value.field == field
    assert [t.name for t in store.access.list_tenants()] == ["vision"], "a refused request changes nothing"


def test_the_rpcs(stub) -> None:  # type: ignore[no-untyped-def]
    tenant = stub.CreateTenant(a.CreateTenantRequest(name="vision", members=["bob", "alice"]))
    assert list(tenant.members) == ["alice", "bob"]
    issued = stub.CreateCredential(a.CreateCredentialRequest(kind=USER, name="alice"))
    resolved = stub.ResolveCredential(a.ResolveCredentialRequest(token=issued.token))
    assert (resolved.principal.name, list(resolved.principal.tenants), resolved.credential_id) == (
        "alice", ["vision"], issued.credential.id)
    assert [c.id for c in stub.ListCredentials(a.ListCredentialsRequest(kind=USER)).credentials] == [issued.credential.id]
    rotated = stub.RotateCredential(a.RotateCredentialRequest(id=issued.credential.id))
    stub.RevokeCredential(a.RevokeCredentialRequest(id=rotated.credential.id))
    assert_rpc_error(lambda: stub.ResolveCredential(a.ResolveCredentialRequest(token=rotated.token)),
                     grpc.StatusCode.UNAUTHENTICATED, None)
    assert_rpc_error(lambda: stub.SetTenantMembers(a.SetTenantMembersRequest(name="vision", members=["x\0"])),
                     grpc.StatusCode.INVALID_ARGUMENT, "members[0]")
    stub.SetTenantMembers(a.SetTenantMembersRequest(name="vision", members=["carol"]))
    assert [list(t.members) for t in stub.ListTenants(a.ListTenantsRequest()).tenants] == [["carol"]]


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_migration_0004_keeps_the_data_and_makes_a_tenant_of_each_job_tenant(request, tmp_path, database) -> None:  # type: ignore[no-untyped-def]
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'old.db'}"
    else:
        postgres: PostgresScratch = request.getfixturevalue("postgres")
        url = postgres.create()
    upgrade(url, "0003")
    store = MetadataStore.open(url)
    try:
        jobs = [store.jobs.create(training_spec(tenant=t)) for t in ("vision", "speech", "vision")]
    finally:
        store.close()
    upgrade(url)
    store = MetadataStore.open(url)
    try:
        assert [store.jobs.get(j.id) for j in jobs] == jobs
        assert [t.name for t in store.access.list_tenants()] == ["speech", "vision"]
        store.access.set_members("vision", ["alice"])
        assert store.access.resolve(issue(store, USER, "alice").token).tenants == ("vision",)
        from services.metadata.migrate import current_revision
        assert current_revision(store.db.engine) == head_revision() >= "0004"
    finally:
        store.close()
