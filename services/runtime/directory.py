"""Where a service learns who a token stands for, which tenant (and dataset) a job belongs to, and
whose a dataset is.

The metadata service asks its own store (:class:`LocalDirectory`); every other service asks the
metadata service over gRPC (:class:`RemoteDirectory`, ResolveCredential, GetJob and GetDataset, sent with the
cluster token or the process's node credential) and keeps each answer for ``ttl_s`` seconds: a revoked credential stops working
within that time on every service, with no restart, and a busy service does not ask for each call.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Protocol

import grpc

from services.runtime.errors import ServiceError, Unauthenticated, Unavailable
from services.runtime.principals import USER, Principal, split_token

MAX_CACHED = 10_000  # tokens and job tenants each; the oldest go first


class Directory(Protocol):
    async def resolve(self, token: str) -> Principal:
        """The principal of a credential token; raises Unauthenticated (or Unavailable)."""

    async def job_tenant(self, job_id: str) -> str | None:
        """The tenant of job ``job_id``; None when there is no such job."""

    async def certificate_principal(self, kind: int, name: str) -> Principal:
        """The principal a verified TLS client certificate names (a user with its tenants as of now)."""

    async def job_dataset(self, job_id: str) -> str | None:
        """The dataset job ``job_id`` names ("" for none); None when there is no such job."""

    async def dataset_owner(self, name: str) -> tuple[str, bool] | None:
        """(tenant, shared) of dataset ``name``, as of now; None when there is no such dataset."""


class LocalDirectory:
    """The metadata service's own store (services.metadata.store: AccessStore, and DatasetStore)."""

    def __init__(self, access_store: Any, dataset_store: Any = None) -> None:
        self._store = access_store
        self._datasets = dataset_store

    async def resolve(self, token: str) -> Principal:
        return await asyncio.to_thread(self._store.resolve, token)

    async def job_tenant(self, job_id: str) -> str | None:
        return await asyncio.to_thread(self._store.job_tenant, job_id)

    async def certificate_principal(self, kind: int, name: str) -> Principal:
        if kind != USER:
            return Principal(kind, name)
        tenants = await asyncio.to_thread(self._store.list_tenants, name)
        return Principal(kind, name, tuple(t.name for t in tenants))

    async def job_dataset(self, job_id: str) -> str | None:
        return await asyncio.to_thread(self._datasets.job_dataset, job_id)

    async def dataset_owner(self, name: str) -> tuple[str, bool] | None:
        return await asyncio.to_thread(self._datasets.owner, name)


class _Bounded(collections.OrderedDict):  # type: ignore[type-arg]
    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > MAX_CACHED:
            self.popitem(last=False)


class RemoteDirectory:
    """The metadata service at ``address``, asked with ``token``: the cluster token, or the node
    credential of a node process (worker agent, cache server), which may resolve credentials too.
    ``resolve_any``: the process does not hold the cluster token, so a token that is not shaped like
    a credential is asked about as well (the metadata service knows the cluster token); refusals are
    then kept for ``ttl_s`` too, so that a flood of bad tokens is not a flood of questions."""

    def __init__(self, address: str, token: str, *, tls_ca_file: str = "", ttl_s: float = 5.0,
                 timeout_s: float = 5.0, resolve_any: bool = False) -> None:
        self._address, self._token, self._tls_ca_file = address, token, tls_ca_file
        self._ttl_s, self._timeout_s, self._resolve_any = ttl_s, timeout_s, resolve_any
        self._channel: grpc.aio.Channel | None = None
        self._principals = _Bounded()  # token -> (expires at, Principal)
        self._refused = _Bounded()  # token -> expires at (resolve_any only)
        self._certified = _Bounded()  # (kind, name) -> (expires at, Principal)
        self._tenants = _Bounded()  # job id -> tenant: a job's tenant never changes
        self._datasets = _Bounded()  # job id -> the dataset it names: never changes either

    def _stub(self) -> Any:
        from silod.rpc.channels import open_channel
        from silod.v1 import metadata_pb2_grpc

        if self._channel is None:  # made on first use: an aio channel belongs to the serving loop
            self._channel = open_channel(self._address, token=self._token, tls_ca_file=self._tls_ca_file, aio=True,
                                         default_timeout_s=self._timeout_s)
        return metadata_pb2_grpc.MetadataServiceStub(self._channel)

    async def resolve(self, token: str) -> Principal:
        if split_token(token) is None and not self._resolve_any:  # not a credential at all: no need to ask
            raise Unauthenticated("invalid bearer token")
        now = time.monotonic()
        cached = self._principals.get(token)
        if cached is not None and cached[0] > now:
            return cached[1]
        if self._refused.get(token, 0.0) > now:
            raise Unauthenticated("invalid bearer token")
        from silod.v1 import access_pb2

        try:
            reply = await self._stub().ResolveCredential(access_pb2.ResolveCredentialRequest(token=token))
        except grpc.aio.AioRpcError as exc:
            self._principals.pop(token, None)
            refusal = _refusal(exc, "check the credential")
            if self._resolve_any and isinstance(refusal, Unauthenticated):
                self._refused.put(token, now + self._ttl_s)
            raise refusal from None
        principal = Principal.from_proto(reply.principal, reply.credential_id)
        self._principals.put(token, (now + self._ttl_s, principal))
        return principal

    async def job_tenant(self, job_id: str) -> str | None:
        if job_id in self._tenants:
            return str(self._tenants[job_id])
        job = await self._job(job_id)
        return None if job is None else job.spec.tenant

    async def job_dataset(self, job_id: str) -> str | None:
        if job_id in self._datasets:
            return str(self._datasets[job_id])
        job = await self._job(job_id)
        return None if job is None else job.spec.dataset

    async def _job(self, job_id: str) -> Any:
        from silod.v1 import metadata_pb2

        try:
            job = await self._stub().GetJob(metadata_pb2.GetJobRequest(job_id=job_id))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                return None
            raise _refusal(exc, "find the job's tenant and dataset") from None
        self._tenants.put(job_id, job.spec.tenant)
        self._datasets.put(job_id, job.spec.dataset)
        return job

    async def dataset_owner(self, name: str) -> tuple[str, bool] | None:
        """Asked every time, never kept: who may replace a dataset must not be decided on an old answer."""
        from silod.v1 import metadata_pb2

        try:
            dataset = await self._stub().GetDataset(metadata_pb2.GetDatasetRequest(name=name))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                return None
            raise _refusal(exc, "find the dataset's tenant") from None
        return dataset.spec.tenant, dataset.spec.shared

    async def certificate_principal(self, kind: int, name: str) -> Principal:
        if kind != USER:
            return Principal(kind, name)
        now = time.monotonic()
        cached = self._certified.get((kind, name))
        if cached is not None and cached[0] > now:
            return cached[1]
        from silod.v1 import access_pb2

        try:
            reply = await self._stub().ListTenants(access_pb2.ListTenantsRequest(member=name))
        except grpc.aio.AioRpcError as exc:
            raise _refusal(exc, "find the tenants of the certificate's user") from None
        principal = Principal(kind, name, tuple(t.name for t in reply.tenants))
        self._certified.put((kind, name), (now + self._ttl_s, principal))
        return principal

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def _refusal(exc: grpc.aio.AioRpcError, doing: str) -> ServiceError:
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated("invalid bearer token")
    # Anything else is the metadata service's trouble, not the caller's: retryable, and it says so.
    return Unavailable(f"cannot {doing}: the metadata service answered {exc.code().name}: {exc.details()}")
