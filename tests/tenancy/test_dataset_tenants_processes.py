"""Datasets owned by tenants, with real `silod metadata` and `silod scheduler` processes and auth on.

Tenants alpha (alice) and beta (bob); carol is in both. Users register their tenant's datasets with
`silod dataset register --tenant`, see their tenants' and the shared ones only, may not replace or
read another tenant's, and a job may name only its tenant's datasets or shared ones: SubmitJob
refuses another tenant's, naming spec.dataset. A job's credential reads its own dataset only. Each
refusal is PERMISSION_DENIED naming the request field, and nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from silod.v1 import access_pb2 as a, common_pb2, metadata_pb2 as m, metadata_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from silod.launcher import start_service
from silod.rpc.channels import open_channel
from tests.cache_server.harness import make_dataset, silod_cli
from tests.metadata.metadata_harness import assert_rpc_error

CLUSTER_TOKEN = "cluster-secret-for-dataset-tenants"
DENIED = grpc.StatusCode.PERMISSION_DENIED


@dataclass
class Cluster:
    md_address: str
    scheduler_address: str
    store_uri: str
    tokens: dict[str, str]  # user -> token
    admin: Any  # MetadataService stub with the cluster token

    def md(self, user: str) -> Any:
        return metadata_pb2_grpc.MetadataServiceStub(open_channel(self.md_address, token=self.tokens[user]))

    def jobs(self, user: str) -> Any:
        return scheduler_pb2_grpc.JobServiceStub(open_channel(self.scheduler_address, token=self.tokens[user]))

    def cli(self, user: str, *argv: str) -> tuple[int, str]:
        return silod_cli(*argv, "--metadata", self.md_address, "--token", self.tokens[user])

    def manifests(self) -> dict[str, tuple[str, bool, int, int]]:
        """name -> (tenant, shared, manifest version, objects), as an admin reads them."""
        return {d.spec.name: (d.spec.tenant, d.spec.shared, d.manifest_version, d.num_objects)
                for d in self.admin.ListDatasets(m.ListDatasetsRequest()).datasets}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("dataset-tenants")
    make_dataset(root / "store", 6, 100, seed=3)
    auth = ("--auth-token", CLUSTER_TOKEN, "--log-level", "warning")
    with start_service("metadata", "--db", f"sqlite:///{root / 'meta.db'}", *auth, workdir=root / "md") as md, \
         start_service("scheduler", "--metadata-address", md.address, "--interval-s", "600",
                       "--credential-cache-s", "1", *auth, workdir=root / "sched") as scheduler:
        admin = metadata_pb2_grpc.MetadataServiceStub(open_channel(md.address, token=CLUSTER_TOKEN))
        admin.CreateTenant(a.CreateTenantRequest(name="alpha", members=["alice", "carol"]))
        admin.CreateTenant(a.CreateTenantRequest(name="beta", members=["bob", "carol"]))
        tokens = {u: admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name=u)).token
                  for u in ("alice", "bob", "carol")}
        tokens["admin"] = CLUSTER_TOKEN
        c = Cluster(md.address, scheduler.address, f"file://{root / 'store'}", tokens, admin)
        for user, name, extra in (("alice", "a-imgs", ()), ("bob", "b-imgs", ()), ("admin", "common", ("--shared",))):
            code, output = c.cli(user, "dataset", "register", name, c.store_uri, *extra)
            assert code == 0, output
        yield c


def test_registration_records_the_tenant_and_sharing_is_for_admins(cluster: Cluster) -> None:
    c = cluster
    assert c.manifests() == {"a-imgs": ("alpha", False, 1, 6), "b-imgs": ("beta", False, 1, 6),
                             "common": ("default", True, 1, 6)}
    code, output = c.cli("alice", "dataset", "register", "mine", c.store_uri, "--shared")
    assert code == 1 and "spec.shared: only an admin may share" in output, output
    code, output = c.cli("carol", "dataset", "register", "mine", c.store_uri)  # in two tenants: must name one
    assert code == 1 and "spec.tenant: name one of your tenants (alpha, beta)" in output, output
    code, output = c.cli("alice", "dataset", "register", "mine", c.store_uri, "--tenant", "beta")
    assert code == 1 and "spec.tenant: user 'alice' is not a member of tenant 'beta'" in output, output
    code, output = c.cli("carol", "dataset", "register", "carols", c.store_uri, "--tenant", "beta")
    assert code == 0 and "registered carols: 6 objects" in output and "tenant beta" in output, output
    assert c.manifests()["carols"] == ("beta", False, 1, 6)
    # Through the scheduler's front door: the tenant the check fills in travels with the stream.
    front = [m.RegisterDatasetRequest(spec=common_pb2.DatasetSpec(name="a-front", uri="file:///x"),
                                      objects=[common_pb2.DatasetObject(key=f"k{i}", size_bytes=1, etag="e")])
             for i in range(3)]
    assert c.jobs("alice").RegisterDataset(iter(front)).spec.tenant == "alpha"
    assert c.manifests()["a-front"] == ("alpha", False, 1, 3)
    # The access check reads a stream's first message; an empty stream has none and is refused by the
    # service as anyone's would be.
    assert_rpc_error(lambda: c.md("alice").RegisterDataset(iter([])), grpc.StatusCode.INVALID_ARGUMENT, "spec")


def test_another_tenants_dataset_cannot_be_replaced_or_read(cluster: Cluster) -> None:
    c = cluster
    before = c.manifests()
    # Through the metadata service and through the scheduler's front door (RegisterDataset is a stream).
    code, output = c.cli("bob", "dataset", "register", "a-imgs", c.store_uri, "--replace")
    assert code == 1 and "PERMISSION_DENIED" in output and "spec.name: dataset 'a-imgs' is of tenant 'alpha'" in output
    replace = [m.RegisterDatasetRequest(spec=common_pb2.DatasetSpec(name="a-imgs", uri="file:///x", tenant="beta"),
                                        replace=True, objects=[common_pb2.DatasetObject(key="k", size_bytes=1, etag="e")])]
    assert_rpc_error(lambda: c.jobs("bob").RegisterDataset(iter(replace)), DENIED, "spec.name")
    assert_rpc_error(lambda: c.jobs("carol").RegisterDataset(iter(replace)), DENIED, "spec.tenant")  # keeps alpha
    code, output = c.cli("alice", "dataset", "register", "common", c.store_uri, "--replace")
    assert code == 1 and "spec.name: dataset 'common' is shared with every tenant" in output, output
    assert c.manifests() == before

    assert_rpc_error(lambda: c.md("bob").GetDataset(m.GetDatasetRequest(name="a-imgs")), DENIED, "name")
    assert_rpc_error(lambda: c.jobs("bob").GetDataset(m.GetDatasetRequest(name="a-imgs")), DENIED, "name")
    assert_rpc_error(lambda: c.md("bob").ListDatasetObjects(m.ListDatasetObjectsRequest(name="a-imgs")), DENIED, "name")
    assert_rpc_error(lambda: c.md("bob").ListDatasets(m.ListDatasetsRequest(tenant="alpha")), DENIED, "tenant")
    assert c.md("bob").GetDataset(m.GetDatasetRequest(name="common")).spec.shared
    assert [d.spec.name for d in c.md("bob").ListDatasets(m.ListDatasetsRequest()).datasets] == [
        "b-imgs", "carols", "common"]
    assert [d.spec.name for d in c.jobs("alice").ListDatasets(m.ListDatasetsRequest()).datasets] == [
        "a-front", "a-imgs", "common"]
    code, output = c.cli("bob", "dataset", "list")
    assert code == 0 and "a-imgs" not in output and "TENANT" in output, output
    assert any(line.split()[:2] == ["common", "default"] and "(shared)" in line for line in output.splitlines()), output
    # A missing dataset is NOT_FOUND to a user as to anyone (its absence is no secret).
    assert_rpc_error(lambda: c.md("bob").GetDataset(m.GetDatasetRequest(name="nope")), grpc.StatusCode.NOT_FOUND, "name")


def _spec(tenant: str, dataset: str) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(name="reader", tenant=tenant, application="cifar10", dataset=dataset, min_gpus=1,
                              max_gpus=1, batch_size=8, sample_budget=8)


def test_a_job_names_only_its_tenants_or_a_shared_dataset(cluster: Cluster) -> None:
    c = cluster
    bob = c.jobs("bob")
    jobs_before = [j.id for j in c.jobs("admin").ListJobs(m.ListJobsRequest()).jobs]
    error = assert_rpc_error(lambda: bob.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=_spec("beta", "a-imgs"))),
                             DENIED, "spec.dataset")
    assert "dataset 'a-imgs' is of tenant 'alpha'" in error.details()
    # carol is in alpha too, but a job of tenant beta still may not read alpha's dataset.
    assert_rpc_error(lambda: c.jobs("carol").SubmitJob(scheduler_pb2.SubmitJobRequest(spec=_spec("beta", "a-imgs"))),
                     DENIED, "spec.dataset")
    assert [j.id for j in c.jobs("admin").ListJobs(m.ListJobsRequest()).jobs] == jobs_before

    own = bob.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=_spec("beta", "b-imgs")))
    shared = bob.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=_spec("beta", "common")))
    try:
        # The job's credential reads its own dataset, and no other (not even a shared one it does not name).
        token = c.admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_JOB, name=own.id)).token
        job = metadata_pb2_grpc.MetadataServiceStub(open_channel(c.md_address, token=token))
        assert job.GetDataset(m.GetDatasetRequest(name="b-imgs")).num_objects == 6
        assert len(job.ListDatasetObjects(m.ListDatasetObjectsRequest(name="b-imgs")).objects) == 6
        for name in ("a-imgs", "common"):
            assert_rpc_error(lambda: job.GetDataset(m.GetDatasetRequest(name=name)), DENIED, "name")
        assert_rpc_error(lambda: job.ListDatasets(m.ListDatasetsRequest()), DENIED, None)
    finally:
        for j in (own, shared):
            bob.CancelJob(scheduler_pb2.CancelJobRequest(job_id=j.id))
