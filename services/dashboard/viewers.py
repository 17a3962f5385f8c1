"""Who looks at the dashboard, and what of the cluster they may see.

With ``auth_token`` set, every route but ``/healthz`` and the login form needs a credential: the
cluster token (an admin), or a person's ``silod_...`` token, which the metadata service resolves
(ResolveCredential, asked with the cluster token; each answer kept ``credential_cache_s``). A
browser signs in at ``/login``: the token goes into an HttpOnly, SameSite=Strict cookie (Secure
over TLS), so page scripts cannot read it and other sites cannot send it; ``/logout`` clears it.
Scripts may send ``Authorization: Bearer <token>`` instead.

An admin sees everything. A user sees the cluster's nodes and GPU counts, and of jobs only
those of their tenants: the job table, job pages, per-job and per-tenant charts, per-job cache
rows; a GPU another tenant's job holds shows as busy without naming the job, and another
tenant's job page answers exactly as an unknown job does (404), so not even its existence shows.
Node and job credentials are refused (403): the dashboard is for people.
"""

from __future__ import annotations

import copy
import html
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from aiohttp import web

from services.runtime.directory import RemoteDirectory
from services.runtime.errors import ServiceError
from services.runtime.principals import ADMIN, USER, split_token

COOKIE = "silod_token"


@dataclass(frozen=True)
class Viewer:
    kind: str  # "admin" or "user"
    name: str
    tenants: frozenset[str] = field(default_factory=frozenset)  # a user's; an admin sees all

    @property
    def admin(self) -> bool:
        return self.kind == "admin"

    def sees_tenant(self, tenant: str) -> bool:
        return self.admin or (tenant or "default") in self.tenants

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "tenants": sorted(self.tenants), "admin": self.admin}


NOBODY_CHECKS = Viewer("admin", "")  # auth off: everyone sees everything, as before auth existed
CLUSTER_TOKEN = Viewer("admin", "cluster-token")


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def presented_token(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
    return given or request.query.get("token", "") or request.cookies.get(COOKIE, "")


async def identify(request: web.Request, token: str) -> Viewer:
    """The viewer ``token`` stands for; raises :class:`Refused` (401 unknown, 403 not a person, 503)."""
    import hmac

    settings = request.app["settings"]
    if not token:
        raise Refused(401, "unauthenticated: sign in at /login with a credential (silod_...) or the cluster token")
    if hmac.compare_digest(token.encode(), settings.auth_token.encode()):
        return CLUSTER_TOKEN
    if split_token(token) is None:
        raise Refused(401, "unauthenticated: invalid token; sign in at /login")
    directory: RemoteDirectory = request.app["directory"]
    try:
        principal = await directory.resolve(token)
    except ServiceError as exc:
        if exc.code.name == "UNAUTHENTICATED":
            raise Refused(401, "unauthenticated: unknown, revoked or expired credential; sign in at /login") from None
        raise Refused(503, f"cannot check the credential: {exc}") from None
    if principal.kind == ADMIN:
        return Viewer("admin", principal.name)
    if principal.kind == USER:
        return Viewer("user", principal.name, frozenset(principal.tenants))
    raise Refused(403, f"a {principal.kind_name} credential cannot sign in to the dashboard: use a user's or an admin's")


def set_cookie(request: web.Request, response: web.StreamResponse, token: str) -> None:
    response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", secure=request.secure, path="/")


# -- the login form -------------------------------------------------------------------------------

_LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>silod dashboard: sign in</title>
<style>body{{font:15px system-ui,sans-serif;margin:4em auto;max-width:34em;color:#222}}
input[type=password]{{width:100%;padding:.5em;font:inherit;box-sizing:border-box}}button{{margin-top:1em;padding:.5em 1.5em;font:inherit}}
.error{{color:#b00020}}</style></head>
<body><h1>silod</h1>
<p>Sign in with your credential token (<code>silod_...</code>, from <code>silod admin credential create user NAME</code>)
or the cluster token.</p>
{error}
<form method="post" action="/login"><input type="hidden" name="next" value="{next}">
<label for="token">Token</label><br><input type="password" id="token" name="token" autocomplete="off" autofocus>
<br><button type="submit">Sign in</button></form></body></html>
"""


def _safe_next(value: str) -> str:
    """A local path to return to after signing in; anything else (another site) goes to /."""
    return value if value.startswith("/") and not value.startswith("//") and "\\" not in value else "/"


def login_page(status: int, message: str = "", next_path: str = "/") -> web.Response:
    error = f'<p class="error" role="alert">{html.escape(message)}</p>' if message else ""
    return web.Response(status=status, content_type="text/html",
                        text=_LOGIN.format(error=error, next=html.escape(_safe_next(next_path), quote=True)))


async def login_form(request: web.Request) -> web.Response:
    return login_page(200, next_path=request.query.get("next", "/"))


async def login(request: web.Request) -> web.StreamResponse:
    form = await request.post()
    token, next_path = str(form.get("token", "")).strip(), _safe_next(str(form.get("next", "/")))
    if not request.app["settings"].auth_token:
        raise web.HTTPSeeOther(next_path)  # nothing to sign in to
    try:
        await identify(request, token)
    except Refused as exc:
        return login_page(exc.status, str(exc), next_path)
    response = web.HTTPSeeOther(next_path)
    set_cookie(request, response, token)
    return response


async def logout(request: web.Request) -> web.StreamResponse:
    response = web.HTTPSeeOther("/login")
    response.del_cookie(COOKIE, path="/")
    return response


def refused(request: web.Request, route: str, exc: Refused) -> web.Response:
    """Pages get the login form (with the status), the API a JSON error."""
    if exc.status == 401 and route in ("/", "/job/{job_id}"):
        return login_page(401, "" if not presented_token(request) else str(exc), quote(request.path_qs, safe="/?=&"))
    return web.json_response({"error": str(exc)}, status=exc.status)


# -- what a user may see --------------------------------------------------------------------------

def overview_for(data: dict[str, Any], viewer: Viewer) -> dict[str, Any]:
    if viewer.admin:
        return data
    data = copy.deepcopy(data)
    data["jobs"] = [j for j in data["jobs"] if viewer.sees_tenant(j["tenant"])]
    visible = {j["id"] for j in data["jobs"]}
    for node in data["nodes"]:
        for gpu in node["gpus"]:
            if gpu["holder"] and not gpu["holder"].startswith("inference:") and gpu["holder"] not in visible:
                gpu["holder"], gpu["job_name"] = "", ""  # busy, not by whom
        cache = node["cache"]
        if cache.get("reachable"):
            cache["jobs"] = [j for j in cache["jobs"] if j["job_id"] in visible]
    return data


def history_for(data: dict[str, Any], viewer: Viewer) -> dict[str, Any]:
    pending_by_tenant = data.pop("pending_jobs_by_tenant", [])
    if viewer.admin:
        return data
    mine = [row for row in pending_by_tenant if row["tenant"] in viewer.tenants]
    data["pending_jobs"] = [sum(values) for values in zip(*(row["values"] for row in mine))] or \
        [0 for _ in data["times"]]
    for key in ("gpus_by_job", "cache_hit_ratio_by_job", "remote_io_bytes_per_s_by_job", "gpus_by_tenant"):
        data[key] = [row for row in data[key] if row["tenant"] in viewer.tenants]  # "" (unknown): hidden
    return data
