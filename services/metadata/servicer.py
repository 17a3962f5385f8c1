"""MetadataService over gRPC: unpacks requests, runs the store in worker threads, packs replies.

Store calls are blocking SQLAlchemy, so each runs in asyncio.to_thread and the event loop
keeps serving other calls meanwhile. Errors are raised as services.runtime.errors and turned
into statuses by the server's error-mapping interceptor.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from sqlalchemy.exc import OperationalError
from silod.v1 import access_pb2, audit_pb2, common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2

from services.metadata.clock import from_timestamp, to_timestamp, utc_now
from services.metadata.store import MetadataStore
from services.metadata.validation.common import check_timestamp
from services.metadata.validation.common import reject_nul_characters
from services.metadata.validation.datasets import Manifest
from services.runtime.batching import Coalescer
from services.runtime.errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from services.runtime.principals import CLUSTER_ADMIN
from services.runtime.principals import current_principal

MAX_HEARTBEATS = 1000  # heartbeats written in one transaction
MAX_REGISTRATIONS = 1000  # node registrations (UpsertNode) written in one transaction
MAX_TRANSITIONS = 1000  # moves per TransitionJobs call: one round's worth, bounded like every list
MAX_CREATIONS = 1000  # jobs per CreateJobs call
MAX_PROGRESS_UPDATES = 1000  # jobs per UpdateJobsProgress call

T = TypeVar("T")
Context = grpc.aio.ServicerContext


class MetadataServicer(metadata_pb2_grpc.MetadataServiceServicer):
    def __init__(self, store: MetadataStore, cluster_token: str = "") -> None:
        self._store = store
        self._cluster_token = cluster_token.encode()  # ResolveCredential answers for it (to nodes without it)
        # Heartbeats without GPU figures that arrive while others are being written go out
        # together: one thread hop and one transaction for many (a thousand nodes beat every few
        # seconds, and on its own each one cost more than its UPDATE).
        self._heartbeats: Coalescer[tuple[str, int], common_pb2.Node] = Coalescer(self._heartbeat_batch, MAX_HEARTBEATS)
        self._registrations: Coalescer[common_pb2.NodeSpec, common_pb2.Node] = \
            Coalescer(self._registration_batch, MAX_REGISTRATIONS)

    async def _run(self, request: Message | None, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if request is not None:
            reject_nul_characters(request)
        try:
            return await asyncio.to_thread(call, *args, **kwargs)
        except OperationalError as exc:
            # Connection refused, server restarting, lock wait exhausted: the caller may retry.
            raise Unavailable(f"database unavailable: {str(exc.orig).strip()[:200]}") from exc

    # -- datasets ------------------------------------------------------------------------

    async def RegisterDataset(
        self, request_iterator: AsyncIterator[metadata_pb2.RegisterDatasetRequest], context: Context
    ) -> common_pb2.Dataset:
        spec: common_pb2.DatasetSpec | None = None
        replace = False
        manifest = Manifest()
        async for request in request_iterator:
            if spec is None:
                if not request.HasField("spec"):
                    raise InvalidArgument("the first message of the stream must carry the dataset spec", field="spec")
                spec, replace = request.spec, request.replace
                reject_nul_characters(spec, "spec")  # objects are checked by the manifest, with stream-wide indices
                await self._run(None, self._store.datasets.check_registrable, spec, replace)
            if request.objects:
                await asyncio.to_thread(manifest.add, request.objects)
        if spec is None:
            raise InvalidArgument("empty stream: the first message must carry the dataset spec", field="spec")
        return await self._run(None, self._store.datasets.register, spec, manifest, replace=replace)

    async def GetDataset(self, request: metadata_pb2.GetDatasetRequest, context: Context) -> common_pb2.Dataset:
        return await self._run(request, self._store.datasets.get, request.name)

    async def ListDatasets(
        self, request: metadata_pb2.ListDatasetsRequest, context: Context
    ) -> metadata_pb2.ListDatasetsResponse:
        datasets, token = await self._run(request, self._store.datasets.list, request.page_size, request.page_token,
                                          request.tenant)
        return metadata_pb2.ListDatasetsResponse(datasets=datasets, next_page_token=token)

    async def ListDatasetObjects(
        self, request: metadata_pb2.ListDatasetObjectsRequest, context: Context
    ) -> metadata_pb2.ListDatasetObjectsResponse:
        objects, token, version = await self._run(
            request, self._store.datasets.list_objects, request.name, request.page_size, request.page_token
        )
        return metadata_pb2.ListDatasetObjectsResponse(objects=objects, next_page_token=token, manifest_version=version)

    # -- jobs ----------------------------------------------------------------------------

    async def CreateJob(self, request: metadata_pb2.CreateJobRequest, context: Context) -> common_pb2.Job:
        return await self._run(request, self._store.jobs.create, request.spec, request.client_request_id)

    async def CreateJobs(self, request: metadata_pb2.CreateJobsRequest, context: Context) -> metadata_pb2.CreateJobsResponse:
        if not 1 <= len(request.jobs) <= MAX_CREATIONS:
            raise InvalidArgument(f"must hold 1..{MAX_CREATIONS} jobs, got {len(request.jobs)}", field="jobs")
        return await self._run(None, self._create_each, request)

    def _create_each(self, request: metadata_pb2.CreateJobsRequest) -> metadata_pb2.CreateJobsResponse:
        # Each item is refused or created as CreateJob would (same checks, same messages);
        # the creations share one transaction and one commit.
        outcomes: list[common_pb2.Job | ServiceError | None] = [None] * len(request.jobs)
        valid: list[int] = []
        for index, item in enumerate(request.jobs):
            try:
                reject_nul_characters(item)
                valid.append(index)
            except ServiceError as exc:
                outcomes[index] = exc
        created = self._store.jobs.create_many([(request.jobs[i].spec, request.jobs[i].client_request_id) for i in valid])
        for index, outcome in zip(valid, created):
            outcomes[index] = outcome
        reply = metadata_pb2.CreateJobsResponse()
        for outcome in outcomes:
            result = reply.results.add()
            if isinstance(outcome, ServiceError):
                result.error_code = outcome.code.name
                result.error = str(outcome)
            else:
                result.job.CopyFrom(outcome)
        return reply

    async def GetJob(self, request: metadata_pb2.GetJobRequest, context: Context) -> common_pb2.Job:
        return await self._run(request, self._store.jobs.get, request.job_id)

    async def ListJobs(self, request: metadata_pb2.ListJobsRequest, context: Context) -> metadata_pb2.ListJobsResponse:
        since = None
        if request.HasField("state_changed_since"):
            check_timestamp(request.state_changed_since, "state_changed_since")
            since = from_timestamp(request.state_changed_since)
        read_at = utc_now()  # before the read: a change committed during it is at or after this
        jobs, token = await self._run(
            request,
            self._store.jobs.list,
            states=list(request.states),
            tenant=request.tenant,
            application=request.application,
            kind=request.kind,
            page_size=request.page_size,
            page_token=request.page_token,
            state_changed_since=since,
            view=request.view,
            job_ids=list(request.job_ids),
        )
        return metadata_pb2.ListJobsResponse(jobs=jobs, next_page_token=token, read_at=to_timestamp(read_at))

    async def TransitionJob(self, request: metadata_pb2.TransitionJobRequest, context: Context) -> common_pb2.Job:
        return await self._run(
            request, self._store.jobs.transition, request.job_id, request.expected_state, request.new_state, request.message
        )

    async def TransitionJobs(
        self, request: metadata_pb2.TransitionJobsRequest, context: Context
    ) -> metadata_pb2.TransitionJobsResponse:
        if not 1 <= len(request.transitions) <= MAX_TRANSITIONS:
            raise InvalidArgument(f"must hold 1..{MAX_TRANSITIONS} moves, got {len(request.transitions)}",
                                  field="transitions")
        reject_nul_characters(request)
        return await self._run(None, self._transition_each, request)

    def _transition_each(self, request: metadata_pb2.TransitionJobsRequest) -> metadata_pb2.TransitionJobsResponse:
        # One transaction (one commit) for all the moves, each its own compare-and-set.
        outcomes = self._store.jobs.transition_many(
            [(m.job_id, m.expected_state, m.new_state, m.message) for m in request.transitions],
            state_only=request.state_only)
        reply = metadata_pb2.TransitionJobsResponse()
        for index, outcome in enumerate(outcomes):
            result = reply.results.add()
            if isinstance(outcome, ServiceError):  # this move is refused; the others still happen
                result.error_code = outcome.code.name
                result.error = str(outcome.within(f"transitions[{index}]"))
            else:
                result.job.CopyFrom(outcome)
        return reply

    async def UpdateJobProgress(
        self, request: metadata_pb2.UpdateJobProgressRequest, context: Context
    ) -> common_pb2.Job:
        return await self._run(
            request,
            self._store.jobs.update_progress,
            request.job_id,
            request.progress if request.HasField("progress") else None,
            request.allocated if request.HasField("allocated") else None,
        )

    async def UpdateJobsProgress(
        self, request: metadata_pb2.UpdateJobsProgressRequest, context: Context
    ) -> metadata_pb2.UpdateJobsProgressResponse:
        if not 1 <= len(request.updates) <= MAX_PROGRESS_UPDATES:
            raise InvalidArgument(f"must hold 1..{MAX_PROGRESS_UPDATES} updates, got {len(request.updates)}",
                                  field="updates")
        reject_nul_characters(request)
        return await self._run(None, self._update_each, request)

    def _update_each(self, request: metadata_pb2.UpdateJobsProgressRequest) -> metadata_pb2.UpdateJobsProgressResponse:
        outcomes = self._store.jobs.update_progress_many([
            (u.job_id, u.progress if u.HasField("progress") else None, u.allocated if u.HasField("allocated") else None)
            for u in request.updates])
        reply = metadata_pb2.UpdateJobsProgressResponse()
        for index, outcome in enumerate(outcomes):
            result = reply.results.add()
            if outcome is not None:
                result.error_code = outcome.code.name
                result.error = str(outcome.within(f"updates[{index}]"))
        return reply

    async def AppendJobEvent(self, request: metadata_pb2.AppendJobEventRequest, context: Context) -> common_pb2.JobEvent:
        return await self._run(request, self._store.jobs.append_event, request.job_id, request.type, request.message)

    async def ListJobEvents(
        self, request: metadata_pb2.ListJobEventsRequest, context: Context
    ) -> metadata_pb2.ListJobEventsResponse:
        events = await self._run(
            request, self._store.jobs.list_events, request.job_id, request.after_sequence, request.limit
        )
        return metadata_pb2.ListJobEventsResponse(events=events)

    # -- nodes ---------------------------------------------------------------------------

    async def UpsertNode(self, request: metadata_pb2.UpsertNodeRequest, context: Context) -> common_pb2.Node:
        # The nodes of a fleet start together: their registrations go in together (one transaction).
        reject_nul_characters(request)
        return await self._registrations.submit(request.spec)

    async def _registration_batch(self, specs: Sequence[common_pb2.NodeSpec]) -> list[common_pb2.Node | ServiceError]:
        return await self._run(None, self._store.nodes.upsert_many, specs)

    async def Heartbeat(self, request: metadata_pb2.HeartbeatRequest, context: Context) -> common_pb2.Node:
        if request.gpu_telemetry or request.gpu_faults:
            return await self._run(request, self._store.nodes.heartbeat, request.node, request.applied_plan_version,
                                   request.gpu_telemetry, request.gpu_faults)
        reject_nul_characters(request)
        return await self._heartbeats.submit((request.node, request.applied_plan_version))

    async def _heartbeat_batch(self, beats: Sequence[tuple[str, int]]) -> list[common_pb2.Node | ServiceError]:
        return await self._run(None, self._store.nodes.heartbeat_many, beats)

    async def ClearGpuFault(self, request: metadata_pb2.ClearGpuFaultRequest, context: Context) -> common_pb2.Node:
        return await self._run(request, self._store.nodes.clear_gpu_fault, request.node, request.gpu_index)

    async def GetNode(self, request: metadata_pb2.GetNodeRequest, context: Context) -> common_pb2.Node:
        return await self._run(request, self._store.nodes.get, request.node)

    async def ListNodes(self, request: metadata_pb2.ListNodesRequest, context: Context) -> metadata_pb2.ListNodesResponse:
        listing = await self._run(
            request,
            self._store.nodes.listing,
            pool=request.pool,
            alive_only=request.alive_only,
            liveness_window_s=request.liveness_window_s,
            gpu_type=request.gpu_type,
            changed_after=request.changed_after,
        )
        return metadata_pb2.ListNodesResponse(nodes=listing.nodes, cursor=listing.cursor,
                                              not_alive=listing.not_alive, whole=listing.whole)

    # -- plans ---------------------------------------------------------------------------

    async def CommitPlan(self, request: metadata_pb2.CommitPlanRequest, context: Context) -> plan_pb2.AllocationPlan:
        return await self._run(request, self._store.plans.commit, request.plan)

    async def CommitPlanChanges(
        self, request: metadata_pb2.CommitPlanChangesRequest, context: Context
    ) -> plan_pb2.AllocationPlan:
        return await self._run(request, self._store.plans.commit, request.plan, request.changes,
                               header_only=request.header_only)

    async def AcquireLeadership(
        self, request: metadata_pb2.AcquireLeadershipRequest, context: Context
    ) -> metadata_pb2.Leadership:
        if self._store.db.engine.dialect.name == "sqlite":
            # One metadata service on one file: a standby scheduler would buy no availability.
            raise FailedPrecondition(
                "scheduler leader election (--leader-election) needs the metadata store on PostgreSQL; this one is "
                "on SQLite: run one scheduler without --leader-election, or move the store to PostgreSQL "
                "(docs/operators.md, High availability)")
        return await self._run(request, self._store.leadership.acquire, request.holder, request.address, request.ttl_s)

    async def GetLeadership(self, request: metadata_pb2.GetLeadershipRequest, context: Context) -> metadata_pb2.Leadership:
        return await self._run(request, self._store.leadership.get)

    async def GetLatestPlan(
        self, request: metadata_pb2.GetLatestPlanRequest, context: Context
    ) -> plan_pb2.AllocationPlan:
        return await self._run(request, self._store.plans.latest, request.known_version)

    async def GetPlan(self, request: metadata_pb2.GetPlanRequest, context: Context) -> plan_pb2.AllocationPlan:
        return await self._run(request, self._store.plans.get, request.version)

    async def ListPlans(self, request: metadata_pb2.ListPlansRequest, context: Context) -> metadata_pb2.ListPlansResponse:
        plans, token = await self._run(request, self._store.plans.list, request.page_size, request.page_token)
        return metadata_pb2.ListPlansResponse(plans=plans, next_page_token=token)

    # -- metrics and job models ----------------------------------------------------------

    async def AppendMetrics(
        self, request: metadata_pb2.AppendMetricsRequest, context: Context
    ) -> metadata_pb2.AppendMetricsResponse:
        appended = await self._run(request, self._store.metrics.append, list(request.samples))
        return metadata_pb2.AppendMetricsResponse(appended=appended)

    async def QueryMetrics(
        self, request: metadata_pb2.QueryMetricsRequest, context: Context
    ) -> metadata_pb2.QueryMetricsResponse:
        samples = await self._run(
            request,
            self._store.metrics.query,
            request.job_id,
            name=request.name,
            since=request.since if request.HasField("since") else None,
            until=request.until if request.HasField("until") else None,
            limit=request.limit,
        )
        return metadata_pb2.QueryMetricsResponse(samples=samples)

    async def PutJobModel(self, request: metadata_pb2.PutJobModelRequest, context: Context) -> common_pb2.JobModelParams:
        return await self._run(request, self._store.metrics.put_model, request.model)

    async def GetJobModel(self, request: metadata_pb2.GetJobModelRequest, context: Context) -> common_pb2.JobModelParams:
        return await self._run(request, self._store.metrics.get_model, request.job_id)

    # -- identities and access (who may call what: services/runtime/access_rules.py) ------

    async def CreateCredential(
        self, request: access_pb2.CreateCredentialRequest, context: Context
    ) -> access_pb2.IssuedCredential:
        return await self._run(request, self._store.access.create_credential, request)

    async def ListCredentials(
        self, request: access_pb2.ListCredentialsRequest, context: Context
    ) -> access_pb2.ListCredentialsResponse:
        found = await self._run(request, self._store.access.list_credentials, request.kind, request.name,
                                request.include_revoked)
        return access_pb2.ListCredentialsResponse(credentials=found)

    async def RevokeCredential(self, request: access_pb2.RevokeCredentialRequest, context: Context) -> access_pb2.Credential:
        return await self._run(request, self._store.access.revoke_credential, request.id)

    async def RotateCredential(
        self, request: access_pb2.RotateCredentialRequest, context: Context
    ) -> access_pb2.IssuedCredential:
        return await self._run(request, self._store.access.rotate_credential, request.id, request.ttl_s)

    async def ResolveCredential(
        self, request: access_pb2.ResolveCredentialRequest, context: Context
    ) -> access_pb2.ResolveCredentialResponse:
        # A node's services do not hold the cluster token; they ask whom a presented one stands for.
        if self._cluster_token and hmac.compare_digest(request.token.encode(), self._cluster_token):
            return access_pb2.ResolveCredentialResponse(principal=CLUSTER_ADMIN.to_proto())
        principal = await self._run(request, self._store.access.resolve, request.token)
        return access_pb2.ResolveCredentialResponse(principal=principal.to_proto(),
                                                    credential_id=principal.credential_id)

    async def MintJobCredential(
        self, request: access_pb2.MintJobCredentialRequest, context: Context
    ) -> access_pb2.IssuedCredential:
        return await self._run(request, self._store.access.mint_job_credential, request.job_id, request.node,
                               self._store.plans.latest)

    async def CreateTenant(self, request: access_pb2.CreateTenantRequest, context: Context) -> access_pb2.Tenant:
        return await self._run(request, self._store.access.create_tenant, request.name, list(request.members))

    async def ListTenants(self, request: access_pb2.ListTenantsRequest, context: Context) -> access_pb2.ListTenantsResponse:
        return access_pb2.ListTenantsResponse(
            tenants=await self._run(request, self._store.access.list_tenants, request.member))

    async def SetTenantMembers(self, request: access_pb2.SetTenantMembersRequest, context: Context) -> access_pb2.Tenant:
        return await self._run(request, self._store.access.set_members, request.name, list(request.members))

    async def SetTenantQuota(self, request: access_pb2.SetTenantQuotaRequest, context: Context) -> access_pb2.Tenant:
        quota = request.quota if request.HasField("quota") else None
        await self._run(request, self._store.quotas.set_quota, request.name, quota)
        tenants = await self._run(request, self._store.access.list_tenants, "")
        return await self._run(request, self._store.quotas.tenant, request.name, tenants)

    # -- the audit log (services/runtime/audit.py records, services/metadata/store/audit.py keeps) --

    async def ListAuditEvents(
        self, request: audit_pb2.ListAuditEventsRequest, context: Context
    ) -> audit_pb2.ListAuditEventsResponse:
        events, token = await self._run(request, self._store.audit.list, request)
        return audit_pb2.ListAuditEventsResponse(events=events, next_page_token=token)

    async def AppendAuditEvents(
        self, request: audit_pb2.AppendAuditEventsRequest, context: Context
    ) -> audit_pb2.AppendAuditEventsResponse:
        caller = current_principal.get()  # None with auth off: nobody to name
        reporter = f"{caller.kind_name} {caller.name}"[:160] if caller is not None else "unauthenticated"
        for event in request.events:  # whatever was sent: a node cannot speak as another reporter
            event.reporter = reporter
        appended = await self._run(request, self._store.audit.append, list(request.events))
        return audit_pb2.AppendAuditEventsResponse(appended=appended)
