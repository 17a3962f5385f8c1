"""Job credentials for this node's ranks (auth on).

A rank's SILOD_AUTH_TOKEN is a credential of its own job, minted for this node by the metadata
service (MintJobCredential) when the job's first rank here launches and kept while the job has
tasks here; the cluster token never reaches a rank. Without one the rank is not launched (exit
127, the reason in its log).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

from silod.v1 import access_pb2, metadata_pb2_grpc


class JobCredentialError(Exception):
    """The metadata service would not mint a credential for a job's ranks here."""


class JobCredentials:
    def __init__(self, metadata: metadata_pb2_grpc.MetadataServiceStub, node: str, enabled: bool) -> None:
        self._metadata = metadata
        self._node = node
        self.enabled = enabled
        self._tokens: dict[str, str] = {}  # job id -> the credential its ranks here hold

    async def token(self, job_id: str, jobs_here: Iterable[str]) -> str:
        """The credential this node's ranks of ``job_id`` hold ("" with auth off). ``jobs_here``:
        the jobs with other tasks here, whose credentials are kept; the rest are dropped.
        Raises JobCredentialError when none can be had."""
        if not self.enabled:
            return ""
        held = set(jobs_here)
        for stale in [j for j in self._tokens if j not in held]:
            del self._tokens[stale]
        if job_id in self._tokens:
            return self._tokens[job_id]
        request = access_pb2.MintJobCredentialRequest(job_id=job_id, node=self._node)
        for attempt in range(1, 4):
            try:
                issued = await self._metadata.MintJobCredential(request, timeout=5)
                break
            except grpc.aio.AioRpcError as exc:
                if attempt == 3 or exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise JobCredentialError(f"no job credential: {exc.code().name}: {exc.details()}") from None
                await asyncio.sleep(0.5 * attempt)
        self._tokens[job_id] = issued.token
        return issued.token
