"""Job credentials (issue 28, slice 2): minted for one job's ranks on one node, only while the latest
plan places the job there; valid for that job's own calls only; revoked in the transaction that
moves the job to a final state (SQLite and PostgreSQL, store and RPCs on a metadata service with
auth on)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from silod.v1 import access_pb2 as a, common_pb2, metadata_pb2 as m, plan_pb2

from services.metadata.service import Settings
from services.metadata.store import MetadataStore
from services.runtime.errors import FailedPrecondition, NotFound, ServiceError, Unauthenticated
from tests.metadata.metadata_harness import InProcessServer, PostgresScratch, assert_rpc_error
from tests.metadata.metadata_samples import node_spec, placement, plan, training_spec
from tests.tenancy.test_metadata_access import CLUSTER_TOKEN, Cluster

DENIED, UNAUTHENTICATED = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED
SCHEDULED, RUNNING = common_pb2.JOB_STATE_SCHEDULED, common_pb2.JOB_STATE_RUNNING
FINAL = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)


def _walk(store: MetadataStore, job: common_pb2.Job, *states: int) -> common_pb2.Job:
    for state in states:
        job = store.jobs.transition(job.id, job.state, state)
    return job


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path: Path) -> Iterator[MetadataStore]:  # type: ignore[no-untyped-def]
    from services.metadata.migrate import upgrade

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'meta.db'}"
    else:
        postgres: PostgresScratch = request.getfixturevalue("postgres")
        url = postgres.create()
    upgrade(url)
    opened = MetadataStore.open(url)
    try:
        yield opened
    finally:
        opened.close()


@pytest.mark.parametrize("final", FINAL, ids=lambda s: common_pb2.JobState.Name(s))
def test_minted_for_a_placed_job_and_revoked_when_it_ends(store: MetadataStore, final: int) -> None:
    job = store.jobs.create(training_spec(tenant="vision"))
    other = store.jobs.create(training_spec(tenant="vision"))
    mint = store.access.mint_job_credential
    with pytest.raises(ServiceError) as refused:  # no plan yet
        mint(job.id, "n0", store.plans.latest)
    assert refused.value.code == DENIED and refused.value.field == "job_id"
    store.plans.commit(plan(1, plan_pb2.JobAllocation(job_id=job.id, placements=[placement("n0", 0, 1)]),
                            plan_pb2.JobAllocation(job_id=other.id, placements=[placement("n0", 2)])))
    with pytest.raises(ServiceError) as refused:
        mint(job.id, "n1", store.plans.latest)  # placed, but not on n1
    assert refused.value.code == DENIED and "on no GPU of node 'n1'" in str(refused.value)
    with pytest.raises(NotFound):
        mint("job-000000000000", "n0", lambda: plan(1, plan_pb2.JobAllocation(
            job_id="job-000000000000", placements=[placement("n0", 0)])))

    issued = [mint(job.id, "n0", store.plans.latest) for _ in range(2)]  # one per node (or relaunch) of the job
    theirs = mint(other.id, "n0", store.plans.latest)
    assert issued[0].credential.kind == a.PRINCIPAL_KIND_JOB and issued[0].credential.name == job.id
    assert not issued[0].credential.HasField("expires_at"), "it lasts as long as the job"
    principal = store.access.resolve(issued[0].token)
    assert (principal.kind, principal.name, principal.tenants) == (a.PRINCIPAL_KIND_JOB, job.id, ("vision",))

    job = _walk(store, job, SCHEDULED, RUNNING)
    store.access.resolve(issued[1].token)  # moves that are not final change nothing
    _walk(store, job, final)
    for credential in issued:
        with pytest.raises(Unauthenticated):
            store.access.resolve(credential.token)
    listed = store.access.list_credentials(kind=a.PRINCIPAL_KIND_JOB, name=job.id, include_revoked=True)
    assert len(listed) == 2 and all(c.HasField("revoked_at") for c in listed), "revoked in the move's transaction"
    assert store.access.resolve(theirs.token).name == other.id, "another job's credentials stay"
    with pytest.raises(FailedPrecondition):
        mint(job.id, "n0", store.plans.latest)  # ended: none after the fact


def test_a_job_credential_resolves_no_more_once_its_job_ended_whoever_made_it(store: MetadataStore) -> None:
    # One an admin made with CreateCredential before this slice: the final state is checked too.
    job = store.jobs.create(training_spec())
    token = store.access.create_credential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_JOB, name=job.id)).token
    store.access.resolve(token)
    from sqlalchemy import update

    from services.metadata.models import Job

    with store.db.write() as session:  # as if the revocation had been lost: the state alone refuses it
        session.execute(update(Job).where(Job.id == job.id).values(state=common_pb2.JOB_STATE_CANCELLED))
    with pytest.raises(Unauthenticated):
        store.access.resolve(token)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    settings = Settings(db=f"sqlite:///{tmp_path / 'meta.db'}", log_level="warning", auth_token=CLUSTER_TOKEN)
    with InProcessServer(settings) as server:
        yield Cluster(server)


def test_only_a_node_the_job_runs_on_may_mint_and_the_job_may_do_little(cluster: Cluster) -> None:
    admin = cluster.admin
    admin.CreateTenant(a.CreateTenantRequest(name="vision", members=["alice"]))
    job = admin.CreateJob(m.CreateJobRequest(spec=training_spec(tenant="vision", dataset="imgs")))
    other = admin.CreateJob(m.CreateJobRequest(spec=training_spec(tenant="vision")))
    for name in ("n0", "n1"):
        admin.UpsertNode(m.UpsertNodeRequest(spec=node_spec(name)))
    admin.CommitPlan(m.CommitPlanRequest(plan=plan(1, plan_pb2.JobAllocation(job_id=job.id,
                                                                              placements=[placement("n0", 0)]))))
    n0, n1 = (cluster.credential(a.PRINCIPAL_KIND_NODE, name) for name in ("n0", "n1"))
    alice = cluster.credential(a.PRINCIPAL_KIND_USER, "alice")
    ask = a.MintJobCredentialRequest

    assert_rpc_error(lambda: n1.MintJobCredential(ask(job_id=job.id, node="n0")), DENIED, "node")  # not itself
    assert_rpc_error(lambda: n1.MintJobCredential(ask(job_id=job.id, node="n1")), DENIED, "job_id")  # not there
    assert_rpc_error(lambda: n0.MintJobCredential(ask(job_id=other.id, node="n0")), DENIED, "job_id")
    assert_rpc_error(lambda: alice.MintJobCredential(ask(job_id=job.id, node="n0")), DENIED, None)
    assert_rpc_error(lambda: admin.MintJobCredential(ask(job_id=job.id, node="n1")), DENIED, "job_id")
    assert admin.MintJobCredential(ask(job_id=job.id, node="n0")).credential.name == job.id  # the cluster token
    rank = cluster.stub(n0.MintJobCredential(ask(job_id=job.id, node="n0")).token)
    assert_rpc_error(lambda: rank.MintJobCredential(ask(job_id=job.id, node="n0")), DENIED, None)

    # Its own job and its own dataset: yes. Everything that writes or reads others': no.
    assert rank.GetJob(m.GetJobRequest(job_id=job.id)).id == job.id
    assert rank.ListJobEvents(m.ListJobEventsRequest(job_id=job.id)).events
    # imgs, its own, is not registered here: NOT_FOUND, past the access check; another name is refused.
    assert_rpc_error(lambda: rank.GetDataset(m.GetDatasetRequest(name="imgs")), grpc.StatusCode.NOT_FOUND, "name")
    assert_rpc_error(lambda: rank.GetDataset(m.GetDatasetRequest(name="cifar10")), DENIED, "name")
    assert_rpc_error(lambda: rank.ListDatasets(m.ListDatasetsRequest()), DENIED, None)
    refusals = {
        "GetJob": lambda: rank.GetJob(m.GetJobRequest(job_id=other.id)),
        "ListJobs": lambda: rank.ListJobs(m.ListJobsRequest()),
        "TransitionJob": lambda: rank.TransitionJob(m.TransitionJobRequest(
            job_id=other.id, expected_state=1, new_state=common_pb2.JOB_STATE_CANCELLED)),
        "CommitPlan": lambda: rank.CommitPlan(m.CommitPlanRequest(plan=plan(2))),
        "UpdateJobProgress": lambda: rank.UpdateJobProgress(m.UpdateJobProgressRequest(job_id=job.id)),
        "AppendJobEvent": lambda: rank.AppendJobEvent(m.AppendJobEventRequest(job_id=job.id, type="restart")),
        "CreateJob": lambda: rank.CreateJob(m.CreateJobRequest(spec=training_spec(tenant="vision"))),
        "Heartbeat": lambda: rank.Heartbeat(m.HeartbeatRequest(node="n0")),
        "ResolveCredential": lambda: rank.ResolveCredential(a.ResolveCredentialRequest(token=CLUSTER_TOKEN)),
        "CreateCredential": lambda: rank.CreateCredential(a.CreateCredentialRequest(
            kind=a.PRINCIPAL_KIND_ADMIN, name="me")),
    }
    for method, call in refusals.items():
        assert rpc_code(call) == DENIED, method
    assert admin.GetLatestPlan(m.GetLatestPlanRequest()).version == 1
    assert admin.GetJob(m.GetJobRequest(job_id=other.id)).state == common_pb2.JOB_STATE_PENDING

    admin.TransitionJob(m.TransitionJobRequest(job_id=job.id, expected_state=1, new_state=common_pb2.JOB_STATE_CANCELLED))
    assert_rpc_error(lambda: rank.GetJob(m.GetJobRequest(job_id=job.id)), UNAUTHENTICATED, None)


def rpc_code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
