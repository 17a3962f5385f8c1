"""What each principal of the hostile-tenant suite (test_hostile_tenants.py) sends to each method:
a request about ANOTHER principal's resources (its job, its node, its tenant, its credential, its
lease, the cluster's plan).

Driven by services/runtime/access_rules.RULES: every method of the table gets a case per attacker.
A method the table refuses to the attacker's kind outright may go without a request of its own (the
interceptor refuses before reading it: an empty one is sent). A method the table opens to the kind,
under an ownership rule, needs a request here, or the suite fails naming it; a method the table
opens to the kind on purpose (a cluster-wide read) is in SHARED, with the reason. EXTRA_NODE_CASES
and EXTRA_CASES add variants of a method for one kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import message_factory
from grpc_reflection.v1alpha import reflection_pb2
from silod.v1 import (
    access_pb2 as a,
    allocation_pb2,
    cache_pb2,
    common_pb2,
    estimator_pb2,
    metadata_pb2 as m,
    plan_pb2,
    scheduler_pb2,
    worker_agent_pb2 as w,
)

from services.runtime.access_rules import RULES
from services.runtime.principals import JOB, NODE, USER

SERVICES = {}  # "silod.v1.MetadataService" -> its service descriptor
for _module in (m, scheduler_pb2, allocation_pb2, cache_pb2, w, estimator_pb2):
    SERVICES.update(_module.DESCRIPTOR.services_by_name.items())
SERVICES = {f"silod.v1.{name}": service for name, service in SERVICES.items()}
SERVICES["grpc.reflection.v1alpha.ServerReflection"] = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


@dataclass(frozen=True)
class Target:
    """The other principal's resources an attacker aims at."""

    job: str  # a running job of another tenant
    tenant: str  # that job's tenant
    node: str  # another node (the victim job's)
    own_node: str  # the attacker's own node, for a node attacker ("" otherwise)
    dataset: str  # a dataset of another tenant (not shared)
    keys: tuple[str, ...]  # keys of that dataset
    lease_id: str  # a lease of the victim job (ReleaseLease)
    token: str  # another principal's credential token (ResolveCredential)
    credential_id: str  # another principal's credential id (Revoke/Rotate)
    own_job: str = ""  # the attacker's own job id, for a job attacker
    own_tenant: str = ""  # the attacker's own tenant, for a user attacker


def _evil_plan(t: Target) -> plan_pb2.AllocationPlan:
    return plan_pb2.AllocationPlan(version=1_000_000, policy="attacker", jobs=[plan_pb2.JobAllocation(
        job_id=t.job, placements=[plan_pb2.GpuPlacement(node=t.node, gpu_indices=[0])])])


def _replace(t: Target, tenant: str, shared: bool = False) -> list[m.RegisterDatasetRequest]:
    return [m.RegisterDatasetRequest(
        spec=common_pb2.DatasetSpec(name=t.dataset, uri="file:///nowhere", tenant=tenant, shared=shared), replace=True,
        objects=[common_pb2.DatasetObject(key="evil", size_bytes=1, etag="x")])]


def _spec(t: Target) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(name="intruder", tenant=t.tenant, application="cifar10", min_gpus=1, max_gpus=1,
                              batch_size=8, sample_budget=8)


RUNNING, CANCELLED = common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_CANCELLED

# "Service.Method" -> the hostile request (a list of messages for a client stream).
REQUESTS: dict[str, Any] = {
    # Replace another tenant's dataset (the caller's own tenant filled in: refused at spec.name).
    "MetadataService.RegisterDataset": lambda t: _replace(t, ""),
    "MetadataService.GetDataset": lambda t: m.GetDatasetRequest(name=t.dataset),
    "MetadataService.ListDatasets": lambda t: m.ListDatasetsRequest(tenant=t.tenant),
    "MetadataService.ListDatasetObjects": lambda t: m.ListDatasetObjectsRequest(name=t.dataset),
    "MetadataService.GetJob": lambda t: m.GetJobRequest(job_id=t.job),
    "MetadataService.ListJobs": lambda t: m.ListJobsRequest(tenant=t.tenant),
    "MetadataService.CreateJob": lambda t: m.CreateJobRequest(spec=_spec(t)),
    "MetadataService.TransitionJob": lambda t: m.TransitionJobRequest(job_id=t.job, expected_state=RUNNING,
                                                                      new_state=CANCELLED),
    "MetadataService.UpdateJobProgress": lambda t: m.UpdateJobProgressRequest(
        job_id=t.job, progress=common_pb2.JobProgress(samples_done=10**9)),
    "MetadataService.AppendJobEvent": lambda t: m.AppendJobEventRequest(job_id=t.job, type="forged", message="x"),
    "MetadataService.ListJobEvents": lambda t: m.ListJobEventsRequest(job_id=t.job),
    "MetadataService.UpsertNode": lambda t: m.UpsertNodeRequest(spec=common_pb2.NodeSpec(name=t.node, gpus=64)),
    "MetadataService.Heartbeat": lambda t: m.HeartbeatRequest(node=t.node),
    "MetadataService.GetNode": lambda t: m.GetNodeRequest(node=t.node),
    "MetadataService.ClearGpuFault": lambda t: m.ClearGpuFaultRequest(node=t.node, gpu_index=0),
    "MetadataService.CommitPlan": lambda t: m.CommitPlanRequest(plan=_evil_plan(t)),
    "MetadataService.GetPlan": lambda t: m.GetPlanRequest(version=1),
    "MetadataService.QueryMetrics": lambda t: m.QueryMetricsRequest(job_id=t.job),
    "MetadataService.GetJobModel": lambda t: common_pb2.GetJobModelRequest(job_id=t.job),
    "MetadataService.CreateCredential": lambda t: a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_ADMIN, name="me"),
    "MetadataService.ListCredentials": lambda t: a.ListCredentialsRequest(),
    "MetadataService.RevokeCredential": lambda t: a.RevokeCredentialRequest(id=t.credential_id),
    "MetadataService.RotateCredential": lambda t: a.RotateCredentialRequest(id=t.credential_id),
    "MetadataService.ResolveCredential": lambda t: a.ResolveCredentialRequest(token=t.token),
    "MetadataService.CreateTenant": lambda t: a.CreateTenantRequest(name="squatters", members=["mallory"]),
    "MetadataService.ListTenants": lambda t: a.ListTenantsRequest(),
    "MetadataService.SetTenantMembers": lambda t: a.SetTenantMembersRequest(name=t.tenant, members=["mallory"]),
    "MetadataService.SetTenantQuota": lambda t: a.SetTenantQuotaRequest(name=t.tenant, quota=a.TenantQuota(
        gpus=[a.GpuQuota(gpus=10**6)])),
    "MetadataService.MintJobCredential": lambda t: a.MintJobCredentialRequest(job_id=t.job, node=t.node),
    "JobService.SubmitJob": lambda t: scheduler_pb2.SubmitJobRequest(spec=_spec(t)),
    "JobService.GetJob": lambda t: m.GetJobRequest(job_id=t.job),
    "JobService.ListJobs": lambda t: m.ListJobsRequest(tenant=t.tenant),
    "JobService.CancelJob": lambda t: scheduler_pb2.CancelJobRequest(job_id=t.job),
    "JobService.WatchJob": lambda t: scheduler_pb2.WatchJobRequest(job_id=t.job),
    "JobService.RegisterDataset": lambda t: REQUESTS["MetadataService.RegisterDataset"](t),
    "JobService.GetDataset": lambda t: m.GetDatasetRequest(name=t.dataset),
    "JobService.ListDatasets": lambda t: m.ListDatasetsRequest(tenant=t.tenant),
    "AllocationService.CommitPlan": lambda t: m.CommitPlanRequest(plan=_evil_plan(t)),
    "AllocationService.Watch": lambda t: allocation_pb2.WatchPlanRequest(node=t.node, component=allocation_pb2.PLAN_COMPONENT_WORKER_AGENT),
    "AllocationService.Ack": lambda t: allocation_pb2.AckPlanRequest(node=t.node, component=allocation_pb2.PLAN_COMPONENT_WORKER_AGENT,
                                                                     version=1, ok=False, message="forged"),
    "AllocationService.ReportTasks": lambda t: allocation_pb2.ReportTasksRequest(node=t.node),
    "CacheService.Lease": lambda t: cache_pb2.LeaseRequest(job_id=t.job, dataset=t.dataset, keys=list(t.keys)),
    "CacheService.ReleaseLease": lambda t: cache_pb2.ReleaseLeaseRequest(lease_id=t.lease_id),
    "CacheService.Read": lambda t: cache_pb2.ReadRequest(job_id=t.job, dataset=t.dataset, keys=list(t.keys)),
    "CacheService.Prefetch": lambda t: cache_pb2.PrefetchRequest(job_id=t.job, dataset=t.dataset),
    "CacheService.Stats": lambda t: cache_pb2.StatsRequest(job_id=t.job),
    "WorkerAgentService.ReportProgress": lambda t: w.ReportProgressRequest(
        job_id=t.job, progress=common_pb2.JobProgress(samples_done=10**9)),
    "WorkerAgentService.GetDirective": lambda t: w.GetDirectiveRequest(job_id=t.job),
    "WorkerAgentService.TailLogs": lambda t: w.TailLogsRequest(job_id=t.job, rank=-1),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": lambda t: [
        reflection_pb2.ServerReflectionRequest(list_services="")],
}

# A node asking for a credential of another node's job on ITSELF: the table admits it (its own
# node), the store refuses (the plan places that job elsewhere).
EXTRA_NODE_CASES = {
    "MetadataService.MintJobCredential[own node]": lambda t: a.MintJobCredentialRequest(job_id=t.job,
                                                                                        node=t.own_node),
}

# A user who names the other tenant, or shares a dataset (admins only); a user who submits a job of
# their own tenant that reads another tenant's dataset; a job that leases, reads or prefetches
# another tenant's dataset under its own job id.
EXTRA_CASES = {
    USER: {
        "MetadataService.RegisterDataset[naming its tenant]": lambda t: _replace(t, t.tenant),
        "JobService.RegisterDataset[naming its tenant]": lambda t: _replace(t, t.tenant),
        "MetadataService.RegisterDataset[shared]": lambda t: _replace(t, "", shared=True),
        "JobService.SubmitJob[its tenant, another's dataset]": lambda t: scheduler_pb2.SubmitJobRequest(
            spec=common_pb2.JobSpec(name="reader", tenant=t.own_tenant, application="cifar10", dataset=t.dataset,
                                    min_gpus=1, max_gpus=1,
                                    batch_size=8, sample_budget=8)),
    },
    JOB: {
        "CacheService.Lease[own job]": lambda t: cache_pb2.LeaseRequest(job_id=t.own_job, dataset=t.dataset,
                                                                        keys=list(t.keys)),
        "CacheService.Read[own job]": lambda t: cache_pb2.ReadRequest(job_id=t.own_job, dataset=t.dataset,
                                                                      keys=list(t.keys)),
        "CacheService.Prefetch[own job]": lambda t: cache_pb2.PrefetchRequest(job_id=t.own_job, dataset=t.dataset),
    },
}

# (method, kind) the table opens on purpose, with why: cluster-wide reads, and what a node's services
# need from each other. The suite checks these are admitted (no refusal) and change nothing.
_ALL = (USER, NODE, JOB)
SHARED: dict[tuple[str, int], str] = {
    **{(f"{s}.{meth}", NODE): "a node's cache server reads the manifest of every dataset" for s, meth in [
        ("MetadataService", "GetDataset"), ("MetadataService", "ListDatasets"),
        ("MetadataService", "ListDatasetObjects"), ("JobService", "GetDataset"), ("JobService", "ListDatasets")]},
    ("MetadataService.GetNode", USER): "nodes are cluster-wide (no tenant owns one)",
    ("MetadataService.GetNode", NODE): "a cache server finds a peer's cache address",
    ("MetadataService.ListNodes", USER): "nodes are cluster-wide (no tenant owns one)",
    ("MetadataService.ListNodes", NODE): "nodes are cluster-wide (no tenant owns one)",
    ("MetadataService.GetJob", NODE): "a node's services look up a job's tenant to authorize calls about it",
    ("MetadataService.ResolveCredential", NODE): "a node's services resolve tokens presented to them",
    ("MetadataService.ListTenants", NODE): "a node's services learn a certificate user's tenants",
    ("MetadataService.AppendAuditEvents", NODE): "a node's services append the calls they recorded (the log "
                                                 "trusts a node's word on who called it)",
    ("CacheService.Read", NODE): "peer cache servers serve each other's cached objects (cached_only)",
    ("CacheService.Stats", USER): "per-job cached bytes and hit counts, no samples",
    ("CacheService.Stats", NODE): "per-job cached bytes and hit counts, no samples",
    ("CacheService.ReleaseLease", JOB): "a lease id is unguessable; holding one is the proof",
    ("WorkerAgentService.GetNodeStatus", USER): "a node's tasks and GPUs, as `silod nodes` shows them",
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", USER): "the API, not data",
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", NODE): "the API, not data",
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", JOB): "the API, not data",
}

# (method, kind) the table opens where it should not: a hole the suite shows (xfail, strict: it
# fails once fixed, so that the entry goes). None known.
KNOWN_HOLES: dict[tuple[str, int], str] = {}


def short(method: str) -> str:
    """'/silod.v1.JobService/CancelJob' -> 'JobService.CancelJob'; other services keep their path."""
    if not method.startswith("/silod.v1."):
        return method
    service, _, name = method[len("/silod.v1."):].partition("/")
    return f"{service}.{name}"


def method_descriptor(method: str) -> Any:
    service, _, name = method.lstrip("/").partition("/")
    return SERVICES[service].methods_by_name[name]


@dataclass(frozen=True)
class Case:
    attacker: str  # a key of the suite's principals
    kind: int
    method: str  # the full gRPC path
    name: str  # "Service.Method", or with a [variant]
    expect: str  # "refused", "shared" or "hole"
    why: str
    build: Any  # Target -> request; None: an empty request (the table refuses the kind outright)


def cases(attackers: dict[str, int]) -> list[Case]:
    """Every (attacker, method of RULES) pair, plus the extra node cases. Raises naming each method
    the table opens to an attacker's kind under an ownership rule that has no hostile request here."""
    found, missing = [], []
    for method, rule in RULES.items():
        if rule.public:
            continue
        name = short(method)
        for attacker, kind in attackers.items():
            check = rule.check_for(kind)
            if (name, kind) in SHARED or (method, kind) in SHARED:
                found.append(Case(attacker, kind, method, name, "shared", SHARED.get((name, kind)) or
                                  SHARED[(method, kind)], REQUESTS.get(name)))  # None: an empty request
            elif (name, kind) in KNOWN_HOLES:
                found.append(Case(attacker, kind, method, name, "hole", KNOWN_HOLES[(name, kind)], REQUESTS[name]))
            elif name in REQUESTS:
                found.append(Case(attacker, kind, method, name, "refused", "", REQUESTS[name]))
            elif check is None:
                found.append(Case(attacker, kind, method, name, "refused", "the table refuses this kind", None))
            else:
                missing.append(f"{name} for a {attacker}")
        for kind, extras in ((NODE, EXTRA_NODE_CASES), *EXTRA_CASES.items()):
            if rule.check_for(kind) is None:
                continue
            for extra, build in extras.items():
                if extra.startswith(name + "["):
                    found.extend(Case(att, k, method, extra, "refused", "", build)
                                 for att, k in attackers.items() if k == kind)
    if missing:
        raise AssertionError("methods of the access table with no hostile case (tests/tenancy/hostile_cases.py): "
                             + ", ".join(missing))
    return found


def empty_request(method: str) -> Any:
    descriptor = method_descriptor(method)
    message = message_factory.GetMessageClass(descriptor.input_type)()
    return [message] if descriptor.client_streaming else message
