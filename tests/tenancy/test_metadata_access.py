"""The access table enforced on a metadata service with auth on (in-process, SQLite):
who may call what, what ownership rules refuse (naming the field), that a refusal changes
nothing, and that the cluster token is still an admin."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from silod.v1 import access_pb2 as a, metadata_pb2 as m, metadata_pb2_grpc

from services.metadata.service import Settings
from silod.rpc.channels import open_channel
from silod.rpc.errors import field_violations
from tests.metadata.metadata_harness import InProcessServer, assert_rpc_error
from tests.metadata.metadata_samples import node_spec, training_spec

CLUSTER_TOKEN = "cluster-secret"
DENIED, UNAUTHENTICATED = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


class Cluster:
    def __init__(self, server: InProcessServer) -> None:
        self.server = server
        self.admin = self.stub(CLUSTER_TOKEN)

    def stub(self, token: str) -> metadata_pb2_grpc.MetadataServiceStub:
        return metadata_pb2_grpc.MetadataServiceStub(open_channel(self.server.address, token=token))

    def credential(self, kind: int, name: str) -> metadata_pb2_grpc.MetadataServiceStub:
        return self.stub(self.admin.CreateCredential(a.CreateCredentialRequest(kind=kind, name=name)).token)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    settings = Settings(db=f"sqlite:///{tmp_path / 'meta.db'}", log_level="warning", auth_token=CLUSTER_TOKEN)
    with InProcessServer(settings) as server:
        yield Cluster(server)


def test_no_or_a_bad_token_is_unauthenticated_health_needs_none(cluster: Cluster) -> None:
    for stub in (cluster.server.stub, cluster.stub("nope"), cluster.stub("silod_0123456789abcdef_" + "0" * 64)):
        assert_rpc_error(lambda: stub.ListDatasets(m.ListDatasetsRequest()), UNAUTHENTICATED, None)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert health_pb2_grpc.HealthStub(cluster.server.channel).Check(health_pb2.HealthCheckRequest()).status == 1


def test_users_see_and_act_on_their_tenants_jobs_only(cluster: Cluster) -> None:
    admin = cluster.admin
    admin.CreateTenant(a.CreateTenantRequest(name="vision", members=["alice"]))
    admin.CreateTenant(a.CreateTenantRequest(name="speech", members=["bob", "alice"]))
    mine = admin.CreateJob(m.CreateJobRequest(spec=training_spec(tenant="vision")))
    theirs = admin.CreateJob(m.CreateJobRequest(spec=training_spec(tenant="speech")))
    bob = cluster.credential(a.PRINCIPAL_KIND_USER, "bob")
    alice = cluster.credential(a.PRINCIPAL_KIND_USER, "alice")

    assert [j.id for j in bob.ListJobs(m.ListJobsRequest()).jobs] == [theirs.id], "the only tenant is filled in"
    refused = assert_rpc_error(lambda: bob.ListJobs(m.ListJobsRequest(tenant="vision")), DENIED, "tenant")
    assert "'bob' is not a member of tenant 'vision'" in refused.details()
    assert_rpc_error(lambda: alice.ListJobs(m.ListJobsRequest()), DENIED, "tenant")  # two tenants: name one
    assert [j.id for j in alice.ListJobs(m.ListJobsRequest(tenant="vision")).jobs] == [mine.id]
    # Asking by id, in either view, stays inside the caller's tenant: another's job is left out.
    for view in (m.JOB_VIEW_FULL, m.JOB_VIEW_STATE):
        listed = bob.ListJobs(m.ListJobsRequest(job_ids=[mine.id, theirs.id], view=view)).jobs
        assert [j.id for j in listed] == [theirs.id]

    assert bob.GetJob(m.GetJobRequest(job_id=theirs.id)).id == theirs.id
    refused = assert_rpc_error(lambda: bob.GetJob(m.GetJobRequest(job_id=mine.id)), DENIED, "job_id")
    assert [v.field for v in field_violations(refused)] == ["job_id"]
    assert_rpc_error(lambda: bob.GetJob(m.GetJobRequest(job_id="job-000000000000")), grpc.StatusCode.NOT_FOUND, None)
    assert_rpc_error(lambda: bob.ListJobEvents(m.ListJobEventsRequest(job_id=mine.id)), DENIED, "job_id")

    # Not open to users at all, whatever the request: refusals change nothing.
    assert_rpc_error(lambda: bob.TransitionJob(m.TransitionJobRequest(
        job_id=theirs.id, expected_state=1, new_state=7)), DENIED, None)
    assert admin.GetJob(m.GetJobRequest(job_id=theirs.id)).state == 1
    assert_rpc_error(lambda: bob.CreateTenant(a.CreateTenantRequest(name="mine", members=["bob"])), DENIED, None)
    assert_rpc_error(lambda: bob.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_ADMIN, name="bob")),
                     DENIED, None)
    assert [t.name for t in admin.ListTenants(a.ListTenantsRequest()).tenants] == ["speech", "vision"]

    admin.SetTenantMembers(a.SetTenantMembersRequest(name="vision", members=["alice", "bob"]))
    assert bob.GetJob(m.GetJobRequest(job_id=mine.id)).id == mine.id, "a new membership counts at the next call"


def test_nodes_and_jobs_act_for_themselves(cluster: Cluster) -> None:
    admin = cluster.admin
    job = admin.CreateJob(m.CreateJobRequest(spec=training_spec(tenant="vision")))
    other = admin.CreateJob(m.CreateJobRequest(spec=training_spec(tenant="vision")))
    node = cluster.credential(a.PRINCIPAL_KIND_NODE, "node-0")
    node.UpsertNode(m.UpsertNodeRequest(spec=node_spec("node-0")))
    node.Heartbeat(m.HeartbeatRequest(node="node-0"))
    assert_rpc_error(lambda: node.Heartbeat(m.HeartbeatRequest(node="node-1")), DENIED, "node")
    assert_rpc_error(lambda: node.UpsertNode(m.UpsertNodeRequest(spec=node_spec("node-1"))), DENIED, "spec.name")
    # Reading another node is open to a node (a cache server looks up its peers' addresses).
    assert_rpc_error(lambda: node.GetNode(m.GetNodeRequest(node="node-1")), grpc.StatusCode.NOT_FOUND, "node")
    assert [n.spec.name for n in admin.ListNodes(m.ListNodesRequest()).nodes] == ["node-0"]

    rank = cluster.credential(a.PRINCIPAL_KIND_JOB, job.id)
    assert rank.GetJob(m.GetJobRequest(job_id=job.id)).id == job.id
    assert_rpc_error(lambda: rank.GetJob(m.GetJobRequest(job_id=other.id)), DENIED, "job_id")
    assert_rpc_error(lambda: rank.ListJobs(m.ListJobsRequest()), DENIED, None)


def test_revocation_takes_effect_at_the_next_call(cluster: Cluster) -> None:
    issued = cluster.admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="bob"))
    bob = cluster.stub(issued.token)
    bob.ListNodes(m.ListNodesRequest())
    cluster.admin.RevokeCredential(a.RevokeCredentialRequest(id=issued.credential.id))
    assert_rpc_error(lambda: bob.ListNodes(m.ListNodesRequest()), UNAUTHENTICATED, None)


def test_an_admin_credential_is_an_admin(cluster: Cluster) -> None:
    root = cluster.credential(a.PRINCIPAL_KIND_ADMIN, "ops")
    root.CreateTenant(a.CreateTenantRequest(name="vision"))
    assert root.ResolveCredential(a.ResolveCredentialRequest(
        token=cluster.admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="x")).token
    )).principal.name == "x"
