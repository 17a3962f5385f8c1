"""Who may call what: THE table of every gRPC method of every silod process.

Each row names the principal kinds (services/runtime/principals.py) that may call the method and,
per kind, the ownership rule its request must pass. An admin may call every method in the table;
a method missing from it may be called by nobody (deny by default; tests/runtime fail when a
method of the contracts has no row). services/runtime/access.py enforces the table in one
interceptor whenever the process has auth configured; docs/api.md renders it (`make proto`).

Rules read request fields only, plus lookups the metadata service answers (services/runtime/directory.py):
the tenant and the dataset of a job, the owner of a dataset. A rule may narrow a listing (TenantScope
fills in the caller's tenant), never widen it. Of a client stream (RegisterDataset) a rule reads the
first message, which carries what the call is about (services/runtime/access.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from services.runtime.directory import Directory
from services.runtime.principals import JOB, NODE, USER, Principal

DEFAULT_TENANT = "default"  # what an empty JobSpec.tenant means (services/metadata/validation/jobs.py)


@dataclass(frozen=True)
class Refusal:
    field: str  # the request field the refusal is about; "" = the call itself
    reason: str


def _values(message: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(concrete path, value) of each value at ``path``: "spec.tenant", "samples[].job_id"."""
    head, _, rest = path.partition(".")
    repeated = head.endswith("[]")
    name = head.removesuffix("[]")
    value = getattr(message, name)
    items = [(f"{name}[{i}]", v) for i, v in enumerate(value)] if repeated else [(name, value)]
    for where, item in items:
        if rest:
            for sub, found in _values(item, rest):
                yield f"{where}.{sub}", found
        else:
            yield where, item


class Check:
    """An ownership rule one principal kind's request must pass (of a client stream: its first message)."""

    reads_request = True  # False: the rule admits any request (the interceptor then reads no stream)

    def describe(self) -> str:
        raise NotImplementedError

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        raise NotImplementedError


class Any_(Check):
    reads_request = False

    def describe(self) -> str:
        return "any"

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        return None


ANY = Any_()


@dataclass(frozen=True)
class Itself(Check):
    """Every value at ``field`` must be the caller's own name: its node, its job id."""

    field: str

    def describe(self) -> str:
        return f"`{self.field}` is the caller's own"

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        for where, value in _values(request, self.field):
            if value != principal.name:
                return Refusal(where, f"{principal.describe()} may act only for itself, not {value!r}")
        return None


def _not_member(principal: Principal, tenant: str) -> str:
    member = ", ".join(principal.tenants) or "no tenant"
    return f"{principal.describe()} is not a member of tenant {tenant!r} (member of: {member})"


@dataclass(frozen=True)
class JobOfTenant(Check):
    """The job at ``field`` must belong to one of the caller's tenants. An unknown job passes, so
    that the service answers NOT_FOUND as it would anyone; ``optional``: an empty field passes."""

    field: str
    optional: bool = False

    def describe(self) -> str:
        return f"the job `{self.field}` is of a tenant of the caller" + (" (or empty)" if self.optional else "")

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        for where, job_id in _values(request, self.field):
            if not job_id and self.optional:
                continue
            if directory is None:
                return Refusal(where, "this service cannot look up the tenant of a job (no metadata_address)")
            tenant = await directory.job_tenant(job_id) if job_id else None
            if tenant is not None and tenant not in principal.tenants:
                return Refusal(where, f"job {job_id!r} is of tenant {tenant!r}; " + _not_member(principal, tenant))
        return None


@dataclass(frozen=True)
class TenantOf(Check):
    """The tenant named at ``field`` (empty: the default tenant) must be one of the caller's."""

    field: str

    def describe(self) -> str:
        return f"`{self.field}` is a tenant of the caller"

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        for where, tenant in _values(request, self.field):
            if (tenant or DEFAULT_TENANT) not in principal.tenants:
                return Refusal(where, _not_member(principal, tenant or DEFAULT_TENANT))
        return None


def _scope(principal: Principal, message: Any, name: str, where: str) -> Refusal | None:
    """``message.<name>`` (at ``where``) must be a tenant of the caller; empty: their only one is filled in."""
    tenant = getattr(message, name)
    if tenant:
        return None if tenant in principal.tenants else Refusal(where, _not_member(principal, tenant))
    if len(principal.tenants) == 1:
        setattr(message, name, principal.tenants[0])
        return None
    if not principal.tenants:
        return Refusal(where, f"{principal.describe()} is a member of no tenant")
    return Refusal(where, f"name one of your tenants ({', '.join(principal.tenants)})")


@dataclass(frozen=True)
class TenantScope(Check):
    """A listing filtered by tenant at ``field``: a tenant of the caller; when empty, the caller's
    only tenant is filled in (a member of several must name one)."""

    field: str

    def describe(self) -> str:
        return f"`{self.field}` is a tenant of the caller (empty: filled in with the caller's only tenant)"

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        return _scope(principal, request, self.field, self.field)


async def _dataset_owner(directory: Directory | None, name: str, where: str) -> tuple[str, bool] | Refusal | None:
    if directory is None:
        return Refusal(where, "this service cannot look up the owner of a dataset (no metadata_address)")
    return await directory.dataset_owner(name) if name else None


@dataclass(frozen=True)
class DatasetOfTenant(Check):
    """The dataset named at ``field`` is shared, or of a tenant of the caller; with ``tenant_field``,
    of the tenant named there instead (a job's, empty: the default tenant). An empty field or an
    unknown dataset passes, so that the service answers as it would anyone (NOT_FOUND)."""

    field: str
    tenant_field: str = ""

    def describe(self) -> str:
        whose = f"the tenant `{self.tenant_field}`" if self.tenant_field else "a tenant of the caller"
        return f"the dataset `{self.field}` is shared or of {whose}"

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        for where, name in _values(request, self.field):
            owner = await _dataset_owner(directory, name, where)
            if owner is None or isinstance(owner, Refusal):
                return owner
            tenant, shared = owner
            if shared:
                continue
            if self.tenant_field:
                wanted = next(v for _, v in _values(request, self.tenant_field)) or DEFAULT_TENANT
                if tenant != wanted:
                    return Refusal(where, f"dataset {name!r} is of tenant {tenant!r} and not shared; a job of "
                                          f"tenant {wanted!r} may name only its tenant's datasets or shared ones")
            elif tenant not in principal.tenants:
                return Refusal(where, f"dataset {name!r} is of tenant {tenant!r}; " + _not_member(principal, tenant))
        return None


@dataclass(frozen=True)
class DatasetRegistration(Check):
    """Registering or replacing a dataset (the first message of the stream): ``spec.tenant`` is a
    tenant of the caller (empty: filled in with their only one), ``spec.shared`` is not set (admins
    share datasets), and a dataset already of that name is of a tenant of the caller, not shared."""

    field: str = "spec.name"

    def describe(self) -> str:
        return ("in the stream's first message: `spec.tenant` is a tenant of the caller (empty: their only one), "
                "`spec.shared` unset, and an existing dataset `spec.name` is of that tenant and not shared")

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        spec = request.spec
        refusal = _scope(principal, spec, "tenant", "spec.tenant")
        if refusal is not None:
            return refusal
        if spec.shared:
            return Refusal("spec.shared", "only an admin may share a dataset with every tenant")
        owner = await _dataset_owner(directory, spec.name, self.field)
        if owner is None or isinstance(owner, Refusal):
            return owner
        tenant, shared = owner
        if shared:
            return Refusal(self.field, f"dataset {spec.name!r} is shared with every tenant: only an admin may replace it")
        if tenant not in principal.tenants:
            return Refusal(self.field, f"dataset {spec.name!r} is of tenant {tenant!r}; " + _not_member(principal, tenant))
        if tenant != spec.tenant:
            return Refusal("spec.tenant", f"dataset {spec.name!r} is of tenant {tenant!r}: a replacement keeps its tenant")
        return None


@dataclass(frozen=True)
class OwnDataset(Check):
    """A job reads only the dataset its spec names: the dataset at ``field`` (when not empty)."""

    field: str

    def describe(self) -> str:
        return f"`{self.field}` is the job's own dataset (or empty)"

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        for where, name in _values(request, self.field):
            if not name:
                continue
            if directory is None:
                return Refusal(where, "this service cannot look up the dataset of a job (no metadata_address)")
            own = await directory.job_dataset(principal.name)
            if name != own:
                return Refusal(where, f"{principal.describe()} reads only its own dataset {own!r}, not {name!r}")
        return None


@dataclass(frozen=True)
class All(Check):
    """Every one of ``checks`` passes (the first refusal answers)."""

    checks: tuple[Check, ...]

    @property
    def reads_request(self) -> bool:  # type: ignore[override]
        return any(c.reads_request for c in self.checks)

    def describe(self) -> str:
        return "; and ".join(c.describe() for c in self.checks)

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        for check in self.checks:
            refusal = await check.refuse(principal, request, directory)
            if refusal is not None:
                return refusal
        return None


@dataclass(frozen=True)
class OwnNodeOfJob(Check):
    """A node acting for a job's ranks on itself: ``node_field`` must be the caller's own name;
    the metadata store then checks, for every caller (an admin too), that the latest plan places
    the job at ``job_field`` on that node and that the job has not ended."""

    node_field: str
    job_field: str

    def describe(self) -> str:
        return (f"`{self.node_field}` is the caller's own, and the latest plan places the job `{self.job_field}` "
                "there (checked by the store, for admins too)")

    async def refuse(self, principal: Principal, request: Any, directory: Directory | None) -> Refusal | None:
        return await Itself(self.node_field).refuse(principal, request, directory)


@dataclass(frozen=True)
class Rule:
    """Who besides an admin may call a method, and on what condition; public: no credential at all."""

    user: Check | None = None
    node: Check | None = None
    job: Check | None = None
    public: bool = False

    def check_for(self, kind: int) -> Check | None:
        return {USER: self.user, NODE: self.node, JOB: self.job}.get(kind)


ADMIN_ONLY = Rule()
PUBLIC = Rule(public=True)
READ_BY_ALL = Rule(user=ANY, node=ANY, job=ANY)
READ_DATASET = Rule(user=DatasetOfTenant("name"), node=ANY, job=OwnDataset("name"))


def _service(name: str, rows: dict[str, Rule]) -> dict[str, Rule]:
    return {f"/{name}/{method}": rule for method, rule in rows.items()}


RULES: dict[str, Rule] = {
    **_service("silod.v1.MetadataService", {
        # Datasets belong to a tenant, or are shared with all (by an admin). A node's cache server reads
        # every manifest; a job reads only the dataset its spec names.
        "RegisterDataset": Rule(user=DatasetRegistration()),
        "GetDataset": READ_DATASET,
        "ListDatasets": Rule(user=TenantScope("tenant"), node=ANY),
        "ListDatasetObjects": READ_DATASET,
        # Jobs are created and moved by the scheduler (the cluster token): users submit through JobService.
        "CreateJob": ADMIN_ONLY,
        "CreateJobs": ADMIN_ONLY,
        "GetJob": Rule(user=JobOfTenant("job_id"), node=ANY, job=Itself("job_id")),
        "ListJobs": Rule(user=TenantScope("tenant")),
        "TransitionJob": ADMIN_ONLY,
        "TransitionJobs": ADMIN_ONLY,
        # A job's ranks report through their worker agent; the scheduler writes what they report.
        "UpdateJobProgress": ADMIN_ONLY,
        "UpdateJobsProgress": ADMIN_ONLY,
        "AppendJobEvent": ADMIN_ONLY,
        "ListJobEvents": Rule(user=JobOfTenant("job_id"), job=Itself("job_id")),
        "UpsertNode": Rule(node=Itself("spec.name")),
        "Heartbeat": Rule(node=Itself("node")),
        # node: a cache server finds a peer's cache address (ListNodes shows every node to a node anyway).
        "GetNode": Rule(user=ANY, node=ANY),
        "ListNodes": Rule(user=ANY, node=ANY),
        "ClearGpuFault": ADMIN_ONLY,
        "CommitPlan": ADMIN_ONLY,
        "CommitPlanChanges": ADMIN_ONLY,
        # Whole plans name every tenant's jobs: the scheduler and the dashboard (admins) read them; a
        # node reads only its own view, through AllocationService.Watch.
        "GetLatestPlan": ADMIN_ONLY,
        "GetPlan": ADMIN_ONLY,
        "ListPlans": ADMIN_ONLY,
        "AppendMetrics": ADMIN_ONLY,
        "QueryMetrics": Rule(user=JobOfTenant("job_id"), job=Itself("job_id")),
        "PutJobModel": ADMIN_ONLY,
        "GetJobModel": Rule(user=JobOfTenant("job_id"), job=Itself("job_id")),
        "CreateCredential": ADMIN_ONLY,
        "ListCredentials": ADMIN_ONLY,
        "RevokeCredential": ADMIN_ONLY,
        "RotateCredential": ADMIN_ONLY,
        # The other services ask: the scheduler with the cluster token, a node's agent and cache server
        # with their node credential. Only who already holds a token learns whom it stands for.
        "ResolveCredential": Rule(node=ANY),
        "CreateTenant": ADMIN_ONLY,
        # node: a node's services learn the tenants of a user whose TLS client certificate calls them.
        "ListTenants": Rule(node=ANY),
        "SetTenantMembers": ADMIN_ONLY,
        "SetTenantQuota": ADMIN_ONLY,
        # What a worker agent hands its ranks as SILOD_AUTH_TOKEN instead of the cluster token.
        "MintJobCredential": Rule(node=OwnNodeOfJob("node", "job_id")),
        # Scheduler leadership: the schedulers (cluster token) only.
        "AcquireLeadership": ADMIN_ONLY,
        "GetLeadership": ADMIN_ONLY,
        # The audit log: admins read it; the other services append what they recorded, a node's with its
        # node credential (the metadata service stamps each event's reporter with the caller).
        "ListAuditEvents": ADMIN_ONLY,
        "AppendAuditEvents": Rule(node=ANY),
    }),
    **_service("silod.v1.JobService", {
        "SubmitJob": Rule(user=All((TenantOf("spec.tenant"), DatasetOfTenant("spec.dataset", "spec.tenant")))),
        "GetJob": Rule(user=JobOfTenant("job_id"), job=Itself("job_id")),
        "ListJobs": Rule(user=TenantScope("tenant")),
        "CancelJob": Rule(user=JobOfTenant("job_id")),
        "WatchJob": Rule(user=JobOfTenant("job_id"), job=Itself("job_id")),
        "RegisterDataset": Rule(user=DatasetRegistration()),
        "GetDataset": READ_DATASET,
        "ListDatasets": Rule(user=TenantScope("tenant"), node=ANY),
    }),
    **_service("silod.v1.AllocationService", {
        "CommitPlan": ADMIN_ONLY,
        "GetLatestPlan": ADMIN_ONLY,  # the whole plan; a node watches its own view
        "Watch": Rule(node=Itself("node")),
        "Ack": Rule(node=Itself("node")),
        "ReportTasks": Rule(node=Itself("node")),
    }),
    # The allocation servers (silod allocation) with the cluster token: whole plans, every node's reports.
    **_service("silod.v1.PlanFeedService", {
        "WatchPlans": ADMIN_ONLY,
        "Relay": ADMIN_ONLY,
    }),
    **_service("silod.v1.CacheService", {
        "Lease": Rule(job=All((Itself("job_id"), OwnDataset("dataset")))),
        "ReleaseLease": Rule(job=ANY),  # lease ids are unguessable: holding one is the proof
        # node: a peer cache server's cached_only read
        "Read": Rule(node=ANY, job=All((Itself("job_id"), OwnDataset("dataset")))),
        "Prefetch": Rule(user=All((JobOfTenant("job_id", optional=True), DatasetOfTenant("dataset"))),
                         job=All((Itself("job_id"), OwnDataset("dataset")))),
        "Stats": Rule(user=ANY, node=ANY, job=Itself("job_id")),
    }),
    **_service("silod.v1.WorkerAgentService", {
        "GetNodeStatus": Rule(user=ANY),
        "ReportProgress": Rule(job=Itself("job_id")),
        "GetDirective": Rule(job=Itself("job_id")),
        "TailLogs": Rule(user=JobOfTenant("job_id"), job=Itself("job_id")),
    }),
    **_service("silod.v1.EstimatorService", {
        "Predict": ADMIN_ONLY,
        "Observe": ADMIN_ONLY,
        "GetJobModel": ADMIN_ONLY,
    }),
    # Probes need no secret; reflection reveals the API (not data) to any holder of a credential.
    "/grpc.health.v1.Health/Check": PUBLIC,
    "/grpc.health.v1.Health/Watch": PUBLIC,
    "/grpc.health.v1.Health/List": PUBLIC,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": READ_BY_ALL,
}


# Methods that change something (the rest only read): the audit log records every call of these
# (services/runtime/audit.py), and every refused call of any method. tests/runtime checks that each
# method of the table whose name does not say it reads (Get, List, Query, Watch, ...) is here.
MUTATING: frozenset[str] = frozenset(
    [f"/silod.v1.MetadataService/{m}" for m in (
        "RegisterDataset", "CreateJob", "CreateJobs", "TransitionJob", "TransitionJobs", "UpdateJobProgress",
        "UpdateJobsProgress",
        "AppendJobEvent", "UpsertNode", "Heartbeat", "ClearGpuFault", "CommitPlan", "CommitPlanChanges",
        "AppendMetrics", "PutJobModel",
        "CreateCredential", "RevokeCredential", "RotateCredential", "CreateTenant", "SetTenantMembers", "SetTenantQuota",
        "MintJobCredential", "AcquireLeadership", "AppendAuditEvents")]
    + [f"/silod.v1.JobService/{m}" for m in ("SubmitJob", "CancelJob", "RegisterDataset")]
    + [f"/silod.v1.AllocationService/{m}" for m in ("CommitPlan", "Ack", "ReportTasks")]
    + ["/silod.v1.PlanFeedService/Relay"]
    + [f"/silod.v1.CacheService/{m}" for m in ("Lease", "ReleaseLease", "Prefetch")]
    + ["/silod.v1.WorkerAgentService/ReportProgress", "/silod.v1.EstimatorService/Observe"])

# Of those, the control plane's own steady traffic (heartbeats, acks, plan commits every round,
# progress and metric reports, cache leases): recorded when a person (a user or an admin credential)
# makes the call, or when it is refused, not when the cluster token, a node or a job makes it
# routinely (docs/operators.md "Audit log" says why).
ROUTINE: frozenset[str] = frozenset(
    [f"/silod.v1.MetadataService/{m}" for m in (
        "CreateJob", "CreateJobs", "TransitionJob", "TransitionJobs", "UpdateJobProgress", "UpdateJobsProgress", "AppendJobEvent",
        "Heartbeat", "CommitPlan", "CommitPlanChanges", "AppendMetrics", "PutJobModel", "AcquireLeadership",
        "AppendAuditEvents")]
    + [f"/silod.v1.AllocationService/{m}" for m in ("CommitPlan", "Ack", "ReportTasks")]
    + ["/silod.v1.PlanFeedService/Relay"]
    + [f"/silod.v1.CacheService/{m}" for m in ("Lease", "ReleaseLease")]
    + ["/silod.v1.WorkerAgentService/ReportProgress", "/silod.v1.EstimatorService/Observe"])


def audited(method: str) -> str:
    """What the audit log records of ``method``'s calls, as docs/api.md says it."""
    if method in ROUTINE:
        return "by people; refusals"
    return "every call" if method in MUTATING else "refusals"


def markdown() -> str:
    """The table as docs/api.md shows it."""
    rows = ["| method | admin | user | node | job | audit log |", "|---|---|---|---|---|---|"]
    for method, rule in RULES.items():
        if rule.public:
            cells = ["no credential needed"] * 4
        else:
            cells = ["yes"] + [c.describe() if c is not None else "—" for c in (rule.user, rule.node, rule.job)]
        rows.append(f"| `{method}` | " + " | ".join([*cells, audited(method)]) + " |")
    return "\n".join(rows)
