"""The audit recorder's rules and buffer, without processes: which calls it records, what it reads
from a request, and that events it cannot store are kept, then logged (refusals one per line),
never dropped silently. The recorder sends to a real gRPC address where nothing listens."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import pytest
from silod.v1 import access_pb2 as a, common_pb2, metadata_pb2 as m, scheduler_pb2

from services.runtime.access_rules import MUTATING, ROUTINE, RULES
from services.runtime.audit import AuditRecorder, Noted, RemoteSink, resources, should_record
from services.runtime.principals import ADMIN, CLUSTER_ADMIN, JOB, NODE, USER, Principal

READ_VERBS = ("Get", "List", "Query", "Watch", "Stats", "Read", "Tail", "Predict", "Resolve", "Check",
              "ServerReflectionInfo")
ALICE = Principal(USER, "alice", ("vision",), "0123456789abcdef")
ROOT = Principal(ADMIN, "root", (), "fedcba9876543210")
NODE_1 = Principal(NODE, "node-1", (), "1111111111111111")
A_JOB = Principal(JOB, "job-1", ("vision",), "2222222222222222")


def test_every_method_that_changes_something_is_marked() -> None:
    unmarked = [method for method in RULES if not method.rsplit("/", 1)[1].startswith(READ_VERBS)
                and method not in MUTATING]
    assert not unmarked, f"methods that change something but are not in access_rules.MUTATING: {unmarked}"
    assert not MUTATING - set(RULES), "MUTATING names methods the table does not have"
    assert ROUTINE <= MUTATING
    assert not [m for m in MUTATING if m.rsplit("/", 1)[1].startswith(("Get", "List", "Query", "Watch"))]


@pytest.mark.parametrize("method, principal, code, recorded", [
    ("/silod.v1.JobService/CancelJob", ALICE, grpc.StatusCode.OK, True),
    ("/silod.v1.JobService/CancelJob", ALICE, grpc.StatusCode.NOT_FOUND, True),  # every outcome
    ("/silod.v1.JobService/SubmitJob", CLUSTER_ADMIN, grpc.StatusCode.OK, True),  # not routine: recorded for anyone
    ("/silod.v1.JobService/ListJobs", ALICE, grpc.StatusCode.OK, False),  # a read
    ("/silod.v1.JobService/ListJobs", ALICE, grpc.StatusCode.PERMISSION_DENIED, True),  # a refused read
    ("/silod.v1.MetadataService/GetJob", None, grpc.StatusCode.UNAUTHENTICATED, True),
    ("/silod.v1.MetadataService/Heartbeat", NODE_1, grpc.StatusCode.OK, False),  # routine traffic
    ("/silod.v1.MetadataService/Heartbeat", NODE_1, grpc.StatusCode.PERMISSION_DENIED, True),
    ("/silod.v1.AllocationService/CommitPlan", CLUSTER_ADMIN, grpc.StatusCode.OK, False),
    ("/silod.v1.AllocationService/CommitPlan", ROOT, grpc.StatusCode.OK, True),  # a person committing a plan
    ("/silod.v1.MetadataService/TransitionJob", CLUSTER_ADMIN, grpc.StatusCode.OK, False),
    ("/silod.v1.CacheService/Lease", A_JOB, grpc.StatusCode.OK, False),
    ("/silod.v1.MetadataService/MintJobCredential", NODE_1, grpc.StatusCode.OK, True),  # a credential made
    ("/silod.v1.MetadataService/CreateCredential", ROOT, grpc.StatusCode.OK, True),
])
def test_which_calls_are_recorded(method: str, principal: Principal | None, code: grpc.StatusCode,
                                  recorded: bool) -> None:
    assert should_record(method, principal, code) is recorded


def test_what_a_request_names() -> None:
    spec = common_pb2.JobSpec(name="x", tenant="vision")
    assert resources(scheduler_pb2.SubmitJobRequest(spec=spec))["target_tenant"] == "vision"
    assert resources(scheduler_pb2.CancelJobRequest(job_id="job-7"))["target_job"] == "job-7"
    assert resources(a.CreateTenantRequest(name="speech"))["target_tenant"] == "speech"
    assert resources(m.RegisterDatasetRequest(spec=common_pb2.DatasetSpec(name="imagenet")))["target_dataset"] == "imagenet"
    assert resources(m.UpsertNodeRequest(spec=common_pb2.NodeSpec(name="gpu-3")))["target_node"] == "gpu-3"
    made = resources(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_JOB, name="job-9"))
    assert made == {"target_job": "job-9", "target_dataset": "", "target_tenant": "", "target_node": ""}
    assert resources(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="bob"))["target_job"] == ""


def _dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed when the block ends: nothing listens


def test_events_that_cannot_be_stored_are_kept_then_logged(caplog: pytest.LogCaptureFixture) -> None:
    refusal = grpc.StatusCode.PERMISSION_DENIED.value[0]

    async def scenario() -> list[int]:
        recorder = AuditRecorder("scheduler", RemoteSink(_dead_address(), "token", timeout_s=2.0), max_buffered=3)
        recorder.record(Noted(USER, refusal, {"principal_name": "mallory", "method": "/silod.v1.JobService/CancelJob"}))
        await recorder.flush()  # the metadata service is down: kept for the next flush
        kept = len(recorder._buffer)
        for i in range(3):  # one past the bound: the oldest (mallory's refusal) is logged and let go
            recorder.record(Noted(USER, 0, {"principal_name": f"user-{i}", "method": "/silod.v1.JobService/SubmitJob"}))
        after = len(recorder._buffer)
        await recorder.close()  # still down: the rest are logged too
        return [kept, after, len(recorder._buffer)]

    with caplog.at_level(logging.INFO, logger="silod.audit"):
        assert asyncio.run(scenario()) == [1, 3, 0]
    warnings = [r for r in caplog.records if "cannot store audit events" in r.getMessage()]
    assert len(warnings) == 1, "one warning while failing, not one per flush"
    dropped = [r for r in caplog.records if "audit event not stored" in r.getMessage()]
    assert [(r.levelno, r.audit_principal_name) for r in dropped] == [  # type: ignore[attr-defined]
        (logging.ERROR, "mallory"), (logging.WARNING, "user-0"), (logging.WARNING, "user-1"),
        (logging.WARNING, "user-2")]
    assert "the audit buffer is full" in dropped[0].getMessage()
    assert dropped[0].audit_service == "scheduler"  # type: ignore[attr-defined]


def test_events_the_store_refuses_are_logged_and_do_not_block_the_rest(tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    from silod.v1 import audit_pb2

    from services.metadata.migrate import upgrade
    from services.metadata.store import MetadataStore
    from services.runtime.audit import StoreSink

    url = f"sqlite:///{tmp_path / 'audit.db'}"
    upgrade(url)
    store = MetadataStore.open(url)
    try:
        async def scenario() -> None:
            recorder = AuditRecorder("metadata", StoreSink(store.audit))
            recorder.record(Noted(USER, 99, {"principal_name": "poison", "method": "/silod.v1.JobService/CancelJob"}))
            await recorder.flush()  # refused for good (no status code 99): logged, not retried for ever
            recorder.record(Noted(USER, 0, {"principal_name": "alice", "method": "/silod.v1.JobService/CancelJob"}))
            await recorder.close()

        with caplog.at_level(logging.WARNING, logger="silod.audit"):
            asyncio.run(scenario())
        stored, _ = store.audit.list(audit_pb2.ListAuditEventsRequest())
        assert [(e.principal_name, e.reporter, e.service) for e in stored] == [("alice", "metadata", "metadata")]
        refused = [r for r in caplog.records if "refused them" in r.getMessage()]
        assert [r.audit_principal_name for r in refused] == ["poison"]  # type: ignore[attr-defined]
        assert "events[0].code" in refused[0].getMessage()
    finally:
        store.close()
