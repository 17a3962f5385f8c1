"""Who is calling: the principal a presented credential stands for, visible to handlers.

The access interceptor (services/runtime/access.py) sets :data:`current_principal` for the
duration of each call; a handler that needs to know the caller reads it, none has to.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

from silod.v1 import access_pb2

ADMIN = access_pb2.PRINCIPAL_KIND_ADMIN
USER = access_pb2.PRINCIPAL_KIND_USER
NODE = access_pb2.PRINCIPAL_KIND_NODE
JOB = access_pb2.PRINCIPAL_KIND_JOB

KIND_NAMES = {ADMIN: "admin", USER: "user", NODE: "node", JOB: "job"}


@dataclass(frozen=True)
class Principal:
    kind: int  # access_pb2.PrincipalKind
    name: str  # user name, node name or job id; an admin's label
    tenants: tuple[str, ...] = field(default=())  # user: member of; job: its tenant
    credential_id: str = ""  # "" for the cluster token

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, "unknown")

    def describe(self) -> str:
        return f"{self.kind_name} {self.name!r}"

    def to_proto(self) -> access_pb2.Principal:
        return access_pb2.Principal(kind=self.kind, name=self.name, tenants=list(self.tenants))

    @classmethod
    def from_proto(cls, message: access_pb2.Principal, credential_id: str = "") -> Principal:
        return cls(message.kind, message.name, tuple(message.tenants), credential_id)


TOKEN_PREFIX = "silod"
TOKEN_ID_HEX = 16  # 64 bits: only has to be unique, it is not the secret
TOKEN_SECRET_HEX = 64  # 256 random bits


def split_token(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed credential token ``silod_<id>_<secret>``, else None."""
    prefix, _, rest = token.partition("_")
    credential_id, _, secret = rest.partition("_")
    if prefix != TOKEN_PREFIX or len(credential_id) != TOKEN_ID_HEX or len(secret) != TOKEN_SECRET_HEX:
        return None
    return credential_id, secret


# The cluster's shared token (settings.auth_token): what every caller was before per-principal
# credentials, so an upgraded single-token cluster keeps working.
CLUSTER_ADMIN = Principal(ADMIN, "cluster-token")

current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("silod_principal", default=None)


# TLS client certificates (services/runtime/server.py with tls_client_ca_file): a verified
# certificate whose subject Common Name is "<kind>:<name>" stands for that principal when the call
# carries no bearer token. Jobs are not among the kinds: their credentials are minted per job.
CERTIFICATE_KINDS = {"admin": ADMIN, "user": USER, "node": NODE}


def certificate_name(common_name: str) -> tuple[int, str] | None:
    """(kind, name) of a certificate Common Name ``admin:<label>``, ``user:<name>`` or ``node:<name>``;
    None for any other."""
    kind, sep, name = common_name.partition(":")
    if not sep or kind not in CERTIFICATE_KINDS or not name or len(name) > 128 or not name.isprintable():
        return None
    return CERTIFICATE_KINDS[kind], name
