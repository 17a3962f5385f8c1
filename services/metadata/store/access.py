"""Tenants and bearer credentials: who a presented token stands for.

A token is ``silod_<id>_<secret>``: the id (not secret) finds the row, the secret is 256
random bits of which only the SHA-256 is stored. A fast hash is enough because the secret is
random, not a password (nothing to brute-force from a dictionary); the comparison is
constant-time so that response times reveal nothing of the stored hash.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

import grpc
from sqlalchemy import delete, select
from silod.v1 import access_pb2, plan_pb2

from services.metadata.clock import to_timestamp, utc_now
from services.metadata.database import Database
from services.metadata.job_states import TERMINAL_STATES, state_name
from services.metadata.models import Credential, Job, Tenant, TenantMember
from services.metadata.store import quotas
from services.metadata.store.quotas import QuotaStore
from services.metadata.validation.access import (
    check_create_credential,
    check_kind,
    check_members,
    check_tenant_name,
    check_ttl,
)
from services.metadata.validation.common import check_text
from services.metadata.validation.jobs import check_job_id
from services.runtime.principals import TOKEN_ID_HEX, TOKEN_PREFIX, TOKEN_SECRET_HEX, Principal, split_token
from services.runtime.errors import AlreadyExists, FailedPrecondition, NotFound, ServiceError, Unauthenticated

def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class AccessStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    # -- credentials ---------------------------------------------------------------------

    def create_credential(self, request: access_pb2.CreateCredentialRequest) -> access_pb2.IssuedCredential:
        check_create_credential(request)
        with self._db.write() as session:
            if request.kind == access_pb2.PRINCIPAL_KIND_JOB and session.scalar(
                    select(Job.id).where(Job.id == request.name)) is None:
                raise NotFound(f"no job {request.name!r}", field="name")
            return self._issue(session, request.kind, request.name, request.description, request.ttl_s)

    def _issue(self, session, kind: int, name: str, description: str, ttl_s: float) -> access_pb2.IssuedCredential:  # type: ignore[no-untyped-def]
        now = utc_now()
        credential_id, secret = secrets.token_hex(TOKEN_ID_HEX // 2), secrets.token_hex(TOKEN_SECRET_HEX // 2)
        row = Credential(id=credential_id, secret_sha256=_digest(secret), kind=kind, name=name,
                         description=description, created_at=now,
                         expires_at=now + timedelta(seconds=ttl_s) if ttl_s else None, revoked_at=None)
        session.add(row)
        session.flush()
        return access_pb2.IssuedCredential(credential=_to_proto(row),
                                           token=f"{TOKEN_PREFIX}_{credential_id}_{secret}")

    def mint_job_credential(self, job_id: str, node: str,
                            latest_plan: Callable[[], plan_pb2.AllocationPlan]) -> access_pb2.IssuedCredential:
        """A credential for job ``job_id``'s ranks on ``node``: only while the latest plan places
        the job on a GPU of that node and the job has not ended (it is revoked when it ends:
        services/metadata/store/jobs.py)."""
        check_job_id(job_id)
        check_text(node, "node", max_chars=128, required=True)
        try:
            plan = latest_plan()
        except NotFound:
            plan = plan_pb2.AllocationPlan()
        placed = any(p.node == node and p.gpu_indices for a in plan.jobs if a.job_id == job_id for p in a.placements)
        if not placed:
            raise ServiceError(f"the latest plan (version {plan.version}) places job {job_id!r} on no GPU of node "
                               f"{node!r}", field="job_id", code=grpc.StatusCode.PERMISSION_DENIED)
        with self._db.write() as session:
            # Locked (PostgreSQL): a concurrent move to a final state, which revokes the job's
            # credentials, waits for this one to commit or is seen here; SQLite writes one at a time.
            state = session.scalar(select(Job.state).where(Job.id == job_id).with_for_update())
            if state is None:
                raise NotFound(f"no job {job_id!r}", field="job_id")
            if state in TERMINAL_STATES:
                raise FailedPrecondition(f"job {job_id!r} has ended ({state_name(state)})", field="job_id")
            return self._issue(session, access_pb2.PRINCIPAL_KIND_JOB, job_id,
                               f"ranks of {job_id} on node {node} (plan {plan.version})", 0.0)

    def list_credentials(self, kind: int = 0, name: str = "", include_revoked: bool = False
                         ) -> list[access_pb2.Credential]:
        check_kind(kind, required=False)
        check_text(name, "name", max_chars=128)
        query = select(Credential).order_by(Credential.created_at, Credential.id)
        if kind:
            query = query.where(Credential.kind == kind)
        if name:
            query = query.where(Credential.name == name)
        now = utc_now()
        with self._db.read() as session:
            rows = session.scalars(query).all()
            return [_to_proto(r) for r in rows if include_revoked or _usable(r, now)]

    def revoke_credential(self, credential_id: str) -> access_pb2.Credential:
        with self._db.write() as session:
            row = self._get(session, credential_id)
            if row.revoked_at is None:
                row.revoked_at = utc_now()
                session.flush()
            return _to_proto(row)

    def rotate_credential(self, credential_id: str, ttl_s: float) -> access_pb2.IssuedCredential:
        """A new credential for the same principal; the old one is revoked in the same transaction."""
        check_ttl(ttl_s)
        with self._db.write() as session:
            row = self._get(session, credential_id)
            if not _usable(row, utc_now()):
                raise FailedPrecondition(f"credential {credential_id!r} is revoked or expired; create a new one",
                                         field="id")
            row.revoked_at = utc_now()
            return self._issue(session, row.kind, row.name, row.description, ttl_s)

    @staticmethod
    def _get(session, credential_id: str) -> Credential:  # type: ignore[no-untyped-def]
        check_text(credential_id, "id", max_chars=64, required=True)
        row = session.get(Credential, credential_id)
        if row is None:
            raise NotFound(f"no credential {credential_id!r}", field="id")
        return row

    def resolve(self, token: str) -> Principal:
        """The principal ``token`` stands for now (a user's tenants as of this call);
        Unauthenticated, without saying which check failed, for anything else."""
        parts = split_token(token)
        if parts is None:
            raise Unauthenticated("invalid bearer token")
        credential_id, secret = parts
        with self._db.read() as session:
            row = session.get(Credential, credential_id)
            stored = row.secret_sha256 if row is not None else "0" * 64
            if not hmac.compare_digest(stored, _digest(secret)) or row is None or not _usable(row, utc_now()):
                raise Unauthenticated("invalid bearer token")
            tenants: Sequence[str] = ()
            if row.kind == access_pb2.PRINCIPAL_KIND_USER:
                tenants = session.scalars(select(TenantMember.tenant).where(TenantMember.user == row.name)
                                          .order_by(TenantMember.tenant)).all()
            elif row.kind == access_pb2.PRINCIPAL_KIND_JOB:
                job = session.execute(select(Job.tenant, Job.state).where(Job.id == row.name)).one_or_none()
                if job is None or job.state in TERMINAL_STATES:  # ended: revoked with the move, but be sure
                    raise Unauthenticated("invalid bearer token")
                tenants = (job.tenant,)
            return Principal(row.kind, row.name, tuple(tenants), row.id)

    def job_tenant(self, job_id: str) -> str | None:
        with self._db.read() as session:
            return session.scalar(select(Job.tenant).where(Job.id == job_id))

    # -- tenants -------------------------------------------------------------------------

    def create_tenant(self, name: str, members: Sequence[str]) -> access_pb2.Tenant:
        check_tenant_name(name)
        members = check_members(members)
        with self._db.write() as session:
            if session.get(Tenant, name) is not None:
                raise AlreadyExists(f"tenant {name!r} exists; change its members with SetTenantMembers", field="name")
            row = Tenant(name=name, created_at=utc_now())
            session.add(row)
            session.add_all(TenantMember(tenant=name, user=m) for m in members)
            session.flush()
            return _tenant(row, members)

    def set_members(self, name: str, members: Sequence[str]) -> access_pb2.Tenant:
        check_tenant_name(name)
        members = check_members(members)
        with self._db.write() as session:
            row = session.get(Tenant, name)
            if row is None:
                raise NotFound(f"no tenant {name!r}", field="name")
            session.execute(delete(TenantMember).where(TenantMember.tenant == name))
            session.add_all(TenantMember(tenant=name, user=m) for m in members)
            session.flush()
            return _tenant(row, members)

    def list_tenants(self, member: str = "") -> list[access_pb2.Tenant]:
        if member:
            check_members([member], "member")
        with self._db.read() as session:
            rows = session.scalars(select(Tenant).order_by(Tenant.name)).all()
            pairs = session.execute(select(TenantMember.tenant, TenantMember.user)).all()
        members: dict[str, list[str]] = {}
        for tenant, user in pairs:
            members.setdefault(tenant, []).append(user)
        tenants = [_tenant(r, sorted(members.get(r.name, []))) for r in rows
                   if not member or member in members.get(r.name, [])]
        return quotas.attach(tenants, QuotaStore(self._db).quotas())  # each tenant's quota, if it has one

    def tenant_exists(self, name: str) -> bool:
        with self._db.read() as session:
            return session.get(Tenant, name) is not None


def _usable(row: Credential, now: datetime) -> bool:
    return row.revoked_at is None and (row.expires_at is None or row.expires_at > now)


def _to_proto(row: Credential) -> access_pb2.Credential:
    return access_pb2.Credential(id=row.id, kind=row.kind, name=row.name, description=row.description,
                                 created_at=to_timestamp(row.created_at), expires_at=to_timestamp(row.expires_at),
                                 revoked_at=to_timestamp(row.revoked_at))


def _tenant(row: Tenant, members: Sequence[str]) -> access_pb2.Tenant:
    return access_pb2.Tenant(name=row.name, members=list(members), created_at=to_timestamp(row.created_at))


__all__ = ["AccessStore"]
