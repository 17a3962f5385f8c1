"""`silod admin` (credentials and tenants, through the metadata service) and `silod login`.

Client commands: they find the metadata service and the caller's token as every client command
does (silod/cli/locate.py). Every change takes effect at once, no service restarts: the services
resolve each presented token through the metadata service (cached a few seconds).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import grpc

from silod.cli import audit, leader, locate, quotas
from silod.cli.client_commands import _fail, call

KINDS = ("admin", "user", "node", "job")


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    admin = sub.add_parser("admin", help="identities and access: credentials, tenants and the audit log; "
                                         "which scheduler leads (needs an admin credential)")
    admin_sub = admin.add_subparsers(dest="admin_command", metavar="WHAT", required=True)

    cred = admin_sub.add_parser("credential", help="bearer credentials of users, nodes, jobs and admins")
    cred_sub = cred.add_subparsers(dest="credential_command", metavar="ACTION", required=True)
    create = cred_sub.add_parser("create", help="make a credential and print its token (shown this once)")
    create.add_argument("kind", choices=KINDS)
    create.add_argument("name", help="user name, node name or job id (admin: a label)")
    create.add_argument("--ttl", type=float, default=0.0, metavar="SECONDS", help="expire after SECONDS (default never)")
    create.add_argument("--description", default="", help="who holds it and why")
    create.set_defaults(handler=_credential_create)
    listing = cred_sub.add_parser("list", help="list credentials (never their tokens)")
    listing.add_argument("--kind", choices=KINDS, default="")
    listing.add_argument("--name", default="", help="only the credentials of this principal")
    listing.add_argument("--all", action="store_true", help="revoked and expired ones too")
    listing.set_defaults(handler=_credential_list)
    revoke = cred_sub.add_parser("revoke", help="revoke a credential: refused by every service within seconds")
    revoke.add_argument("id", help="credential id (see `silod admin credential list`)")
    revoke.set_defaults(handler=_credential_revoke)
    rotate = cred_sub.add_parser("rotate", help="replace a credential: a new token for the same principal, "
                                               "the old one revoked")
    rotate.add_argument("id", help="credential id")
    rotate.add_argument("--ttl", type=float, default=0.0, metavar="SECONDS", help="expire after SECONDS (default never)")
    rotate.set_defaults(handler=_credential_rotate)

    tenant = admin_sub.add_parser("tenant", help="tenants (teams) and their members")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", metavar="ACTION", required=True)
    t_create = tenant_sub.add_parser("create", help="make a tenant")
    t_create.add_argument("name")
    t_create.add_argument("members", nargs="*", metavar="USER", help="its first members")
    t_create.set_defaults(handler=_tenant_create)
    t_list = tenant_sub.add_parser("list", help="list tenants and their members")
    t_list.add_argument("--member", default="", help="only the tenants of this user")
    t_list.set_defaults(handler=_tenant_list)
    members = tenant_sub.add_parser("members", help="show or change a tenant's members")
    members.add_argument("name")
    members.add_argument("--add", action="append", default=[], metavar="USER", help="add USER (repeatable)")
    members.add_argument("--remove", action="append", default=[], metavar="USER", help="remove USER (repeatable)")
    members.add_argument("--set", nargs="*", default=None, metavar="USER", help="replace the members by these")
    members.set_defaults(handler=_tenant_members)
    quota = quotas.add_parser(tenant_sub)
    audit.add_parser(admin_sub)  # `silod admin audit` (silod/cli/audit.py)
    leader.add_parser(admin_sub)  # `silod admin leader` (silod/cli/leader.py)
    for parser in (create, listing, revoke, rotate, t_create, t_list, members, quota):
        locate.add_flags(parser, "metadata")

    login = sub.add_parser("login", help="store a credential for every client command of this user "
                                         f"(file mode 0600; default {locate.login_path()})")
    login.add_argument("--token-file", default="", metavar="FILE", help="read the token from FILE (default: stdin)")
    login.set_defaults(handler=_login)
    logout = sub.add_parser("logout", help="forget the credential `silod login` stored")
    logout.set_defaults(handler=_logout)


def _stub(channel: grpc.Channel):  # type: ignore[no-untyped-def]
    from silod.v1 import metadata_pb2_grpc

    return metadata_pb2_grpc.MetadataServiceStub(channel)


def _kind(name: str) -> int:
    from silod.v1 import access_pb2

    return access_pb2.PrincipalKind.Value(f"PRINCIPAL_KIND_{name.upper()}") if name else 0


def _when(stamp, never: str = "-") -> str:  # type: ignore[no-untyped-def]
    if not stamp.seconds and not stamp.nanos:
        return never
    return datetime.fromtimestamp(stamp.seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _print_issued(issued) -> None:  # type: ignore[no-untyped-def]
    c = issued.credential
    print(f"credential {c.id} for {KINDS[c.kind - 1]} {c.name!r} (expires {_when(c.expires_at, 'never')})",
          file=sys.stderr)
    print("the token below is shown this once; give it to its holder (`silod login`):", file=sys.stderr)
    print(issued.token)


def _credential_create(args: argparse.Namespace) -> int:
    from silod.v1 import access_pb2

    def body(channel: grpc.Channel) -> int:
        _print_issued(_stub(channel).CreateCredential(access_pb2.CreateCredentialRequest(
            kind=_kind(args.kind), name=args.name, ttl_s=args.ttl, description=args.description), timeout=30))
        return 0

    return call(args, "metadata", body)


def _credential_list(args: argparse.Namespace) -> int:
    from silod.v1 import access_pb2

    def body(channel: grpc.Channel) -> int:
        reply = _stub(channel).ListCredentials(access_pb2.ListCredentialsRequest(
            kind=_kind(args.kind), name=args.name, include_revoked=args.all), timeout=30)
        print(f"{'ID':<16}  {'KIND':<5}  {'NAME':<24}  {'CREATED':<20}  {'EXPIRES':<20}  {'REVOKED':<20}  DESCRIPTION")
        for c in reply.credentials:
            print(f"{c.id:<16}  {KINDS[c.kind - 1]:<5}  {c.name:<24}  {_when(c.created_at):<20}  "
                  f"{_when(c.expires_at, 'never'):<20}  {_when(c.revoked_at):<20}  {c.description}")
        return 0

    return call(args, "metadata", body)


def _credential_revoke(args: argparse.Namespace) -> int:
    from silod.v1 import access_pb2

    def body(channel: grpc.Channel) -> int:
        c = _stub(channel).RevokeCredential(access_pb2.RevokeCredentialRequest(id=args.id), timeout=30)
        print(f"credential {c.id} of {KINDS[c.kind - 1]} {c.name!r} revoked at {_when(c.revoked_at)}")
        return 0

    return call(args, "metadata", body)


def _credential_rotate(args: argparse.Namespace) -> int:
    from silod.v1 import access_pb2

    def body(channel: grpc.Channel) -> int:
        _print_issued(_stub(channel).RotateCredential(access_pb2.RotateCredentialRequest(id=args.id, ttl_s=args.ttl),
                                                      timeout=30))
        print(f"credential {args.id} is revoked", file=sys.stderr)
        return 0

    return call(args, "metadata", body)


def _print_tenant(tenant) -> None:  # type: ignore[no-untyped-def]
    print(f"{tenant.name:<24}  {', '.join(tenant.members) or '-'}")
    if tenant.HasField("quota"):
        print(f"{'':<24}  quota: {quotas.describe(tenant.quota)}")


def _tenant_create(args: argparse.Namespace) -> int:
    from silod.v1 import access_pb2

    def body(channel: grpc.Channel) -> int:
        _print_tenant(_stub(channel).CreateTenant(access_pb2.CreateTenantRequest(name=args.name, members=args.members),
                                                  timeout=30))
        return 0

    return call(args, "metadata", body)


def _tenant_list(args: argparse.Namespace) -> int:
    from silod.v1 import access_pb2

    def body(channel: grpc.Channel) -> int:
        print(f"{'TENANT':<24}  MEMBERS")
        for tenant in _stub(channel).ListTenants(access_pb2.ListTenantsRequest(member=args.member), timeout=30).tenants:
            _print_tenant(tenant)
        return 0

    return call(args, "metadata", body)


def _tenant_members(args: argparse.Namespace) -> int:
    from silod.v1 import access_pb2

    def body(channel: grpc.Channel) -> int:
        stub = _stub(channel)
        current = next((t for t in stub.ListTenants(access_pb2.ListTenantsRequest(), timeout=30).tenants
                        if t.name == args.name), None)
        if current is None:
            return _fail(f"NOT_FOUND: name: no tenant {args.name!r} (see `silod admin tenant list`)")
        members = list(current.members) if args.set is None else list(args.set)
        if args.set is None and not (args.add or args.remove):
            _print_tenant(current)
            return 0
        members = [m for m in dict.fromkeys(members + args.add) if m not in set(args.remove)]
        _print_tenant(stub.SetTenantMembers(access_pb2.SetTenantMembersRequest(name=args.name, members=members),
                                            timeout=30))
        return 0

    return call(args, "metadata", body)


def _login(args: argparse.Namespace) -> int:
    try:
        text = Path(args.token_file).read_text() if args.token_file else sys.stdin.read()
    except OSError as exc:
        return _fail(f"--token-file: cannot read {args.token_file}: {exc.strerror}")
    token = text.strip()
    if not token or any(ch.isspace() for ch in token):
        return _fail("expected one token (no spaces), e.g. from `silod admin credential create`")
    path = locate.login_path()
    try:
        _write_private(path, token + "\n")
    except OSError as exc:
        return _fail(f"cannot store the credential in {path}: {exc.strerror}")
    print(f"stored the credential in {path}; client commands use it unless --token or SILOD_AUTH_TOKEN says otherwise")
    return 0


def _write_private(path: Path, text: str) -> None:
    """Write-then-rename, the file created 0600 from the start: the secret is never readable by others,
    not even for a moment, and a crash leaves the old file or the new one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a file that already existed
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _logout(args: argparse.Namespace) -> int:
    path = locate.login_path()
    path.unlink(missing_ok=True)
    print(f"removed {path}")
    return 0
