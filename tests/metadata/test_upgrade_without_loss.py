"""A single-token cluster from before tenants and credentials (schema 0003) upgrades without loss,
on SQLite and PostgreSQL: its jobs (with their states and events), datasets and manifests, nodes and
plans are all there after a real `silod metadata` migrates the database at start; the jobs that named
no tenant are tenant `default`'s, and each tenant a job named (default included) is a tenant row;
the cluster's one token is still an admin: it reads everything and issues credentials, and a member
added to `default` sees those jobs.

tests/metadata/test_access_store.py checks migration 0004 alone (jobs and tenant rows, store level),
tests/tenancy/test_tenancy_processes.py an upgraded cluster's named teams; this is the whole upgrade.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
from sqlalchemy import column, insert, table
from silod.v1 import access_pb2 as a, common_pb2, metadata_pb2 as m, metadata_pb2_grpc, plan_pb2

from services.metadata import convert
from services.metadata.migrate import current_revision, head_revision, upgrade
from services.metadata.models import Plan
from services.metadata.store import MetadataStore
from silod.launcher import start_service
from silod.rpc.channels import open_channel
from tests.metadata.metadata_harness import PostgresScratch, assert_rpc_error
from tests.metadata.metadata_samples import node_spec, training_spec
from tests.tenancy.old_datasets import write_old_dataset

PRE_TENANT_SCHEMA = "0003"  # the schema before identities and access (0004)
TOKEN = "the-clusters-one-token"


def _old_cluster(url: str) -> dict[str, object]:
    """Data written at schema 0003 by the store (plans directly: today's commit reads the newer
    leadership table); returns what an admin must read back after the upgrade."""
    upgrade(url, PRE_TENANT_SCHEMA)
    store = MetadataStore.open(url)
    try:
        created = datetime(2026, 11, 1, tzinfo=timezone.utc)
        jobs = [store.jobs.create(training_spec(name=f"job-{i}", tenant=t)) for i, t in enumerate(("", "vision", ""))]
        store.jobs.transition(jobs[1].id, common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED, "placed")
        store.jobs.append_event(jobs[0].id, "note", "written before the upgrade")
        spec = node_spec("n1")
        old_nodes = table("nodes", *(column(name) for name in (
            "name", "pool", "gpu_type", "spec", "registered_at", "last_heartbeat", "applied_plan_version")))
        with store.db.write() as session:  # the columns of 0003 (0011 adds nodes.changed_seq)
            session.execute(insert(old_nodes).values(
                name=spec.name, pool=spec.pool, gpu_type=spec.gpu_type, spec=json.dumps(convert.to_json(spec)),
                registered_at=created, last_heartbeat=created, applied_plan_version=0))
        # Written with SQL, as the old store did (today's writes the tenant columns of 0008): the
        # datasets are read back tenant `default`'s and shared with every tenant.
        datasets = {name: write_old_dataset(store.db.engine, name, count) for name, count in (("imgs", 30), ("text", 5))}
        plans = []
        with store.db.write() as session:  # the columns of 0003 (0009 adds plans.base_version)
            for version in (1, 2):
                plan = plan_pb2.AllocationPlan(version=version, policy="fifo", jobs=[plan_pb2.JobAllocation(
                    job_id=jobs[1].id, placements=[plan_pb2.GpuPlacement(node="n1", gpu_indices=[0, version])])])
                at = created + timedelta(minutes=version)
                plan.created_at.FromDatetime(at)
                session.execute(insert(Plan.__table__).values(version=version, created_at=at, policy="fifo",
                                                              plan=convert.to_json(plan)))
                plans.insert(0, plan)  # ListPlans: newest first
        return {
            "jobs": {j.id: store.jobs.get(j.id) for j in jobs},
            "events": {j.id: store.jobs.list_events(j.id) for j in jobs},
            "datasets": datasets,
            "node": store.nodes.get("n1").spec,
            "plans": plans,
        }
    finally:
        store.close()


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_single_token_cluster_upgrades_without_loss(request: pytest.FixtureRequest, tmp_path: Path,
                                                      database: str) -> None:
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'old.db'}"
    else:
        postgres: PostgresScratch = request.getfixturevalue("postgres")
        url = postgres.create()
    before = _old_cluster(url)
    jobs = before["jobs"]
    assert isinstance(jobs, dict) and current_revision_of(url) == PRE_TENANT_SCHEMA

    with start_service("metadata", "--db", url, "--auth-token", TOKEN, "--log-level", "warning",
                       workdir=tmp_path / "md") as md:  # migrates at start, as an upgraded cluster's does
        admin = metadata_pb2_grpc.MetadataServiceStub(open_channel(md.address, token=TOKEN))
        after_jobs = {j.id: j for j in admin.ListJobs(m.ListJobsRequest()).jobs}
        assert after_jobs == jobs
        assert {j: list(admin.ListJobEvents(m.ListJobEventsRequest(job_id=j)).events) for j in jobs} == before["events"]
        for name, (dataset, manifest) in before["datasets"].items():  # type: ignore[union-attr]
            assert admin.GetDataset(m.GetDatasetRequest(name=name)) == dataset
            listed = admin.ListDatasetObjects(m.ListDatasetObjectsRequest(name=name, page_size=1000))
            assert list(listed.objects) == manifest
        assert admin.GetNode(m.GetNodeRequest(node="n1")).spec == before["node"]
        assert list(admin.ListPlans(m.ListPlansRequest()).plans) == before["plans"]
        assert admin.GetLatestPlan(m.GetLatestPlanRequest()).version == 2

        # Jobs that named no tenant are `default`'s; every tenant named is a tenant row.
        assert sorted(j.spec.tenant for j in jobs.values()) == ["default", "default", "vision"]
        assert [t.name for t in admin.ListTenants(a.ListTenantsRequest()).tenants] == ["default", "vision"]

        # The old token is an admin: it issues credentials; members of `default` see its jobs.
        admin.SetTenantMembers(a.SetTenantMembersRequest(name="default", members=["carol"]))
        carol = admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="carol")).token
        as_carol = metadata_pb2_grpc.MetadataServiceStub(open_channel(md.address, token=carol))
        assert sorted(j.id for j in as_carol.ListJobs(m.ListJobsRequest()).jobs) == sorted(
            j.id for j in jobs.values() if j.spec.tenant == "default")
        wrong = metadata_pb2_grpc.MetadataServiceStub(open_channel(md.address, token=TOKEN + "-not"))
        assert_rpc_error(lambda: wrong.ListJobs(m.ListJobsRequest()), grpc.StatusCode.UNAUTHENTICATED, None)
    assert current_revision_of(url) == head_revision()


def current_revision_of(url: str) -> str | None:
    store = MetadataStore.open(url)
    try:
        return current_revision(store.db.engine)
    finally:
        store.close()
