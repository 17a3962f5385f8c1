"""The audit log with real `silod metadata` and `silod scheduler` processes, auth on, on SQLite and
PostgreSQL: an admin credential's credential creation, a user's submit and cancel, a refused
cross-tenant cancel and a bad token are recorded with the right who, what and outcome (the
scheduler's through its buffered AppendAuditEvents); reads and the scheduler's own routine calls
are not; `silod admin audit` shows and filters them and names a bad flag; old rows go by
retention while recent ones stay."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
from silod.v1 import access_pb2 as a, audit_pb2, common_pb2, metadata_pb2 as m, metadata_pb2_grpc
from silod.v1 import scheduler_pb2, scheduler_pb2_grpc

from silod.cli.main import main
from silod.launcher import ServiceProcess, start_service
from silod.rpc.channels import open_channel
from tests.metadata.metadata_harness import PostgresScratch, assert_rpc_error

CLUSTER_TOKEN = "cluster-secret-for-audit-tests"
OK, DENIED, UNAUTHENTICATED = 0, grpc.StatusCode.PERMISSION_DENIED.value[0], grpc.StatusCode.UNAUTHENTICATED.value[0]
JOBS = "/silod.v1.JobService/"
META = "/silod.v1.MetadataService/"


@dataclass
class Cluster:
    metadata: ServiceProcess
    scheduler: ServiceProcess
    root_token: str  # an admin credential: a person
    alice_token: str  # user in tenant vision
    bob_token: str  # user in tenant speech

    def meta(self, token: str = CLUSTER_TOKEN) -> metadata_pb2_grpc.MetadataServiceStub:
        return metadata_pb2_grpc.MetadataServiceStub(open_channel(self.metadata.address, token=token))

    def jobs(self, token: str) -> scheduler_pb2_grpc.JobServiceStub:
        return scheduler_pb2_grpc.JobServiceStub(open_channel(self.scheduler.address, token=token))


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp(f"audit-{request.param}")
    if request.param == "sqlite":
        url = f"sqlite:///{work / 'meta.db'}"
    else:
        postgres: PostgresScratch = request.getfixturevalue("postgres")
        url = postgres.create()
    auth = ("--auth-token", CLUSTER_TOKEN, "--log-level", "warning")
    with start_service("metadata", "--db", url, "--retention-interval-s", "0.5", "--retention-audit-s", "86400",
                       *auth, workdir=work / "md") as metadata, \
         start_service("scheduler", "--metadata-address", metadata.address, "--interval-s", "600",
                       "--credential-cache-s", "1", *auth, workdir=work / "sched") as scheduler:
        admin = metadata_pb2_grpc.MetadataServiceStub(open_channel(metadata.address, token=CLUSTER_TOKEN))
        root_token = admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_ADMIN, name="root")).token
        root = metadata_pb2_grpc.MetadataServiceStub(open_channel(metadata.address, token=root_token))
        root.CreateTenant(a.CreateTenantRequest(name="vision", members=["alice"]))
        root.CreateTenant(a.CreateTenantRequest(name="speech", members=["bob"]))
        alice = root.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="alice")).token
        bob = root.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="bob")).token
        yield Cluster(metadata, scheduler, root_token, alice, bob)


def submit(stub: scheduler_pb2_grpc.JobServiceStub, tenant: str) -> common_pb2.Job:
    spec = common_pb2.JobSpec(name=f"{tenant}-job", tenant=tenant, application="cifar10", min_gpus=1, max_gpus=1,
                              batch_size=128, epochs=1)
    return stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))


def wait_for(cluster: Cluster, found: Callable[[list[audit_pb2.AuditEvent]], bool],
             request: audit_pb2.ListAuditEventsRequest | None = None, timeout_s: float = 15.0) -> list[audit_pb2.AuditEvent]:
    """The events ListAuditEvents answers once ``found`` holds for them (recorders flush every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = list(cluster.meta().ListAuditEvents(request or audit_pb2.ListAuditEventsRequest(page_size=1000)).events)
        if found(events):
            return events
        assert time.monotonic() < deadline, f"audit events never matched; have: {[(e.method, e.code) for e in events]}"
        time.sleep(0.2)


def one(events: list[audit_pb2.AuditEvent], method: str, **fields: object) -> audit_pb2.AuditEvent:
    matching = [e for e in events if e.method == method and all(getattr(e, k) == v for k, v in fields.items())]
    assert len(matching) == 1, f"{method} {fields}: {len(matching)} events"
    return matching[0]


def test_who_did_what_and_how_it_ended(cluster: Cluster) -> None:
    alice, bob = cluster.jobs(cluster.alice_token), cluster.jobs(cluster.bob_token)
    mine, theirs = submit(alice, "vision"), submit(bob, "speech")
    assert alice.CancelJob(scheduler_pb2.CancelJobRequest(job_id=mine.id)).state == common_pb2.JOB_STATE_CANCELLED
    assert_rpc_error(lambda: alice.CancelJob(scheduler_pb2.CancelJobRequest(job_id=theirs.id)), grpc.StatusCode.PERMISSION_DENIED, "job_id")
    alice.ListJobs(m.ListJobsRequest())  # a read: not recorded
    forged = "silod_" + "0123456789abcdef" + "_" + "0" * 64
    assert_rpc_error(lambda: cluster.meta(forged).ListJobs(m.ListJobsRequest()), grpc.StatusCode.UNAUTHENTICATED, None)

    alice_id, root_id = cluster.alice_token.split("_")[1], cluster.root_token.split("_")[1]
    events = wait_for(cluster, lambda es: sum(e.method == JOBS + "CancelJob" for e in es) >= 2
                      and any(e.code == UNAUTHENTICATED for e in es))

    created = one(events, META + "CreateCredential", principal_name="root", message=f"issued credential {alice_id} for user 'alice'")
    assert (created.principal_kind, created.credential, created.code) == (a.PRINCIPAL_KIND_ADMIN, root_id, OK)
    assert (created.service, created.reporter) == ("metadata", "metadata")
    assert created.peer.startswith(("ipv4:", "ipv6:"))

    submitted = one(events, JOBS + "SubmitJob", target_job=mine.id)
    assert (submitted.principal_kind, submitted.principal_name, submitted.credential) == (a.PRINCIPAL_KIND_USER, "alice", alice_id)
    assert (submitted.target_tenant, submitted.code, submitted.service) == ("vision", OK, "scheduler")
    assert submitted.reporter == "admin cluster-token"  # the scheduler handed it in with the cluster token

    cancelled = one(events, JOBS + "CancelJob", target_job=mine.id)
    assert (cancelled.principal_name, cancelled.code, cancelled.target_tenant) == ("alice", OK, "vision")
    refused = one(events, JOBS + "CancelJob", target_job=theirs.id)
    assert (refused.principal_name, refused.code, refused.target_tenant) == ("alice", DENIED, "speech")
    assert "is not a member of tenant 'speech'" in refused.message

    stranger = one(events, META + "ListJobs", code=UNAUTHENTICATED)  # a refusal of a read is recorded
    assert (stranger.principal_kind, stranger.principal_name, stranger.credential) == (0, "", "0123456789abcdef")

    assert not [e for e in events if e.method in (JOBS + "ListJobs", META + "CreateJob", META + "GetJob")], \
        "reads and the scheduler's routine calls with the cluster token are not recorded"
    assert [e.id for e in events] == sorted((e.id for e in events), reverse=True), "newest first"


def test_filters_and_pages(cluster: Cluster) -> None:
    wait_for(cluster, lambda es: any(e.method == JOBS + "CancelJob" and e.code == DENIED for e in es))
    meta = cluster.meta()
    denied = meta.ListAuditEvents(audit_pb2.ListAuditEventsRequest(outcome=audit_pb2.AUDIT_OUTCOME_DENIED)).events
    assert denied and all(e.code in (DENIED, UNAUTHENTICATED) for e in denied)
    by_alice = meta.ListAuditEvents(audit_pb2.ListAuditEventsRequest(principal="alice", method="CancelJob")).events
    assert len(by_alice) == 2 and {e.code for e in by_alice} == {OK, DENIED}
    speech = meta.ListAuditEvents(audit_pb2.ListAuditEventsRequest(tenant="speech", method=JOBS + "CancelJob")).events
    assert [e.code for e in speech] == [DENIED]
    later = audit_pb2.ListAuditEventsRequest()
    later.since.FromDatetime(datetime.now(timezone.utc) + timedelta(hours=1))
    assert not meta.ListAuditEvents(later).events

    everything = meta.ListAuditEvents(audit_pb2.ListAuditEventsRequest(page_size=1000)).events
    paged, token = [], ""
    while True:
        page = meta.ListAuditEvents(audit_pb2.ListAuditEventsRequest(page_size=2, page_token=token))
        paged += page.events
        token = page.next_page_token
        if not token:
            break
    assert [e.id for e in paged][: len(everything)] == [e.id for e in everything][: len(paged)]

    assert_rpc_error(lambda: meta.ListAuditEvents(audit_pb2.ListAuditEventsRequest(page_size=5000)),
                     grpc.StatusCode.INVALID_ARGUMENT, "page_size")
    assert_rpc_error(lambda: meta.ListAuditEvents(audit_pb2.ListAuditEventsRequest(outcome=9)),
                     grpc.StatusCode.INVALID_ARGUMENT, "outcome")
    assert_rpc_error(lambda: meta.ListAuditEvents(audit_pb2.ListAuditEventsRequest(method="JobService/CancelJob")),
                     grpc.StatusCode.INVALID_ARGUMENT, "method")
    # Users may not read the log, nor write it; each refusal is recorded as hers.
    alice = cluster.meta(cluster.alice_token)
    assert_rpc_error(lambda: alice.ListAuditEvents(audit_pb2.ListAuditEventsRequest()), grpc.StatusCode.PERMISSION_DENIED, None)
    forged = audit_pb2.AuditEvent(method=JOBS + "CancelJob", service="scheduler", principal_name="bob")
    assert_rpc_error(lambda: alice.AppendAuditEvents(audit_pb2.AppendAuditEventsRequest(events=[forged])),
                     grpc.StatusCode.PERMISSION_DENIED, None)
    wait_for(cluster, lambda es: {e.method for e in es if e.principal_name == "alice" and e.code == DENIED}
             >= {META + "ListAuditEvents", META + "AppendAuditEvents"})
    assert_rpc_error(lambda: meta.AppendAuditEvents(audit_pb2.AppendAuditEventsRequest()),
                     grpc.StatusCode.INVALID_ARGUMENT, "events")

    # A node's processes append with its node credential; the stored reporter is the caller, whatever was sent.
    node_token = cluster.meta(cluster.root_token).CreateCredential(
        a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_NODE, name="gpu-7")).token
    claimed = audit_pb2.AuditEvent(method="/silod.v1.CacheService/Prefetch", service="cache-server", reporter="metadata")
    assert cluster.meta(node_token).AppendAuditEvents(audit_pb2.AppendAuditEventsRequest(events=[claimed])).appended == 1
    stored = meta.ListAuditEvents(audit_pb2.ListAuditEventsRequest(method="Prefetch")).events
    assert [(e.reporter, e.service) for e in stored] == [("node gpu-7", "cache-server")]


def admin_audit(capsys: pytest.CaptureFixture[str], cluster: Cluster, *argv: str, token: str = CLUSTER_TOKEN) -> tuple[int, str, str]:
    code = main(["admin", "audit", *argv, "--metadata", cluster.metadata.address, "--token", token])
    out, err = capsys.readouterr()
    return code, out, err


def test_silod_admin_audit(cluster: Cluster, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Alice's refusals: the cross-tenant cancel, and (test_filters_and_pages, which waited for them
    # to be stored) her refused read and write of the log. Every one is listed, newest first.
    events = wait_for(cluster, lambda es: any(e.method == JOBS + "CancelJob" and e.code == DENIED for e in es))
    hers = [e.method.rsplit("/", 1)[-1] for e in events if e.principal_name == "alice" and e.code in (DENIED, UNAUTHENTICATED)]
    code, out, err = admin_audit(capsys, cluster, "--since", "1h", "--principal", "alice", "--outcome", "denied")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["TIME", "(UTC)", "WHO", "METHOD"]
    assert len(lines) == 1 + len(hers) and all(f"/{method}" in line for method, line in zip(hers, lines[1:])), out
    assert all("PERMISSION_DENIED" in line and "user alice (" in line for line in lines[1:]), out
    cancel = [line for line in lines[1:] if "JobService/CancelJob" in line]
    assert len(cancel) == 1 and "tenant=speech" in cancel[0], out

    code, out, err = admin_audit(capsys, cluster, "--method", "CreateCredential", "--kind", "admin", "--json",
                                 "--limit", "2", token=cluster.root_token)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2 and all(r["method"] == META + "CreateCredential" and r["code_name"] == "OK" for r in rows)
    assert {r["principal_name"] for r in rows} == {"root"}

    for argv, flag in ((["--since", "yesterday"], "--since"), (["--outcome", "maybe"], "--outcome"),
                       (["--job", "no such id!"], "--job"), (["--limit", "0"], "--limit"),
                       (["--method", "JobService/CancelJob"], "--method")):
        with pytest.raises(SystemExit) as exited:
            main(["admin", "audit", *argv, "--metadata", cluster.metadata.address, "--token", CLUSTER_TOKEN])
        assert exited.value.code == 2
        assert f"argument {flag}:" in capsys.readouterr().err
    code, _, err = admin_audit(capsys, cluster, "--since", "1h", "--until", "2h")
    assert code == 2 and "--until" in err
    code, _, err = admin_audit(capsys, cluster, token=cluster.alice_token)
    assert code == 1 and "PERMISSION_DENIED" in err


def test_retention_removes_old_rows_and_keeps_recent_ones(cluster: Cluster) -> None:
    meta = cluster.meta()
    old, recent = (audit_pb2.AuditEvent(method="/silod.v1.Test/Retention", service="test", message=label)
                   for label in ("old", "recent"))
    old.time.FromDatetime(datetime.now(timezone.utc) - timedelta(days=2))  # kept 1 day (--retention-audit-s)
    recent.time.FromDatetime(datetime.now(timezone.utc) - timedelta(hours=1))
    assert meta.AppendAuditEvents(audit_pb2.AppendAuditEventsRequest(events=[old, recent])).appended == 2
    request = audit_pb2.ListAuditEventsRequest(method="/silod.v1.Test/Retention")
    deadline = time.monotonic() + 15
    while [e.message for e in meta.ListAuditEvents(request).events] != ["recent"]:
        assert time.monotonic() < deadline, "the old audit row was never compacted away"
        time.sleep(0.2)
    kept = meta.ListAuditEvents(request).events[0]
    assert kept.reporter == "admin cluster-token" and kept.service == "test"
