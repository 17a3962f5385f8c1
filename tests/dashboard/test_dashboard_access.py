"""`silod dashboard` with auth on, as real processes (an auth-enabled `silod metadata` and the
dashboard), two tenants: who signs in how, and what each principal's HTTP answers hold. A user
sees their tenants' jobs, job pages and chart series only, and nothing of another tenant's job
(not its id, not its name, not whether it exists); an admin credential and the cluster token see
all; node credentials, bad tokens and revoked credentials are refused."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from silod.v1 import access_pb2 as a, common_pb2, metadata_pb2 as m, metadata_pb2_grpc, plan_pb2

from tests.support.procs import ServiceProcess, start_service

CLUSTER_TOKEN = "dashboard-access-cluster-token"


@dataclass
class Site:
    address: str  # HOST:PORT of the dashboard
    tokens: dict[str, str]  # alice, bob (users), ops (admin credential), node (a node credential)
    jobs: dict[str, common_pb2.Job]  # vision, speech
    admin: metadata_pb2_grpc.MetadataServiceStub
    metadata: str  # HOST:PORT of the metadata service


def request(site: Site, method: str, path: str, *, token: str = "", cookie: str = "", form: dict[str, str] | None = None,
            ) -> tuple[int, dict[str, str], str]:
    """One HTTP request, redirects not followed: (status, headers, body)."""
    host, port = site.address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if cookie:
        headers["Cookie"] = cookie
    body = None
    if form is not None:
        body = urllib.parse.urlencode(form)
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    try:
        connection.request(method, path, body=body, headers=headers)
        reply = connection.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read().decode()
    finally:
        connection.close()


def get_json(site: Site, path: str, token: str) -> dict:  # type: ignore[type-arg]
    status, _, body = request(site, "GET", path, token=token)
    assert status == 200, (path, status, body)
    return json.loads(body)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    work = tmp_path_factory.mktemp("dash-access")
    auth = ("--auth-token", CLUSTER_TOKEN, "--log-level", "warning")
    with start_service("metadata", "--db", f"sqlite:///{work / 'm.db'}", *auth, workdir=work / "md") as md:
        admin = _stub(md)
        admin.CreateTenant(a.CreateTenantRequest(name="vision", members=["alice"]))
        admin.CreateTenant(a.CreateTenantRequest(name="speech", members=["bob"]))
        tokens = {name: admin.CreateCredential(a.CreateCredentialRequest(kind=kind, name=name)).token
                  for name, kind in (("alice", a.PRINCIPAL_KIND_USER), ("bob", a.PRINCIPAL_KIND_USER),
                                     ("ops", a.PRINCIPAL_KIND_ADMIN), ("node", a.PRINCIPAL_KIND_NODE))}
        admin.UpsertNode(m.UpsertNodeRequest(spec=common_pb2.NodeSpec(
            name="node", gpus=2, pool=common_pb2.NODE_POOL_TRAINING, gpu_model="emulated", agent_address="127.0.0.1:1")))
        jobs = {tenant: admin.CreateJob(m.CreateJobRequest(spec=common_pb2.JobSpec(
            name=f"{tenant}-secret-name", tenant=tenant, application="cifar10", min_gpus=1, max_gpus=1,
            batch_size=16, sample_budget=1000))) for tenant in ("vision", "speech")}
        plan = plan_pb2.AllocationPlan(version=1, policy="fifo", cache_mode="silod", reason="arrival")
        for index, tenant in enumerate(("vision", "speech")):
            plan.jobs.add(job_id=jobs[tenant].id, batch_size=16, generation=1).placements.add(
                node="node", gpu_indices=[index])
        plan.created_at.GetCurrentTime()
        admin.CommitPlan(m.CommitPlanRequest(plan=plan))
        with start_service("dashboard", "--metadata-address", md.address, *auth, "--credential-cache-s", "0.5",
                           "--history-interval-s", "0.2", "--cache-timeout-s", "0.5", workdir=work / "dash") as dash:
            yield Site(dash.address, tokens, jobs, admin, md.address)


def _stub(md: ServiceProcess) -> metadata_pb2_grpc.MetadataServiceStub:
    from silod.rpc.channels import open_channel

    return metadata_pb2_grpc.MetadataServiceStub(open_channel(md.address, token=CLUSTER_TOKEN))


def test_without_a_credential_the_pages_ask_for_one(site: Site) -> None:
    status, headers, body = request(site, "GET", "/")
    assert status == 401 and '<form method="post" action="/login">' in body and 'name="token"' in body
    status, _, body = request(site, "GET", f"/job/{site.jobs['vision'].id}")
    assert status == 401 and f'value="/job/{site.jobs["vision"].id}"' in body, "the form returns to the job page"
    for path in ("/api/overview", "/api/history", "/api/whoami", f"/api/job/{site.jobs['vision'].id}", "/static/app.js"):
        status, _, body = request(site, "GET", path)
        assert status == 401 and "sign in" in json.loads(body)["error"], path
    assert request(site, "GET", "/login")[0] == 200
    assert request(site, "GET", "/healthz")[0] == 200


def test_signing_in_sets_a_strict_http_only_cookie_and_signing_out_clears_it(site: Site) -> None:
    status, headers, _ = request(site, "POST", "/login", form={"token": site.tokens["alice"], "next": "/"})
    assert status == 303 and headers["location"] == "/"
    cookie = headers["set-cookie"]
    assert cookie.startswith(f"silod_token={site.tokens['alice']};")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    jar = f"silod_token={site.tokens['alice']}"
    status, _, body = request(site, "GET", "/api/whoami", cookie=jar)
    assert status == 200 and json.loads(body) == {"kind": "user", "name": "alice", "tenants": ["vision"],
                                                 "admin": False, "auth": True}
    assert request(site, "GET", "/", cookie=jar)[0] == 200

    # Somewhere else to return to is refused: only a local path.
    assert request(site, "POST", "/login", form={"token": site.tokens["alice"], "next": "//evil.example/"})[1][
        "location"] == "/"
    status, headers, _ = request(site, "POST", "/logout", cookie=jar)
    assert status == 303 and headers["location"] == "/login"
    assert headers["set-cookie"].startswith('silod_token="";') and "Max-Age=0" in headers["set-cookie"]

    status, _, body = request(site, "POST", "/login", form={"token": "silod_" + "0" * 16 + "_" + "0" * 64})
    assert status == 401 and "unknown, revoked or expired" in body and 'name="token"' in body
    status, _, body = request(site, "POST", "/login", form={"token": site.tokens["node"]})
    assert status == 403 and "a node credential cannot sign in" in body
    status, _, body = request(site, "GET", "/api/overview", token="not-a-token")
    assert status == 401 and "invalid token" in body


def test_a_user_sees_only_their_tenants_jobs(site: Site) -> None:
    vision, speech = site.jobs["vision"], site.jobs["speech"]
    alice = site.tokens["alice"]
    overview = get_json(site, "/api/overview", alice)
    assert [j["id"] for j in overview["jobs"]] == [vision.id]
    gpus = overview["nodes"][0]["gpus"]
    assert [(g["use"], g["holder"]) for g in gpus] == [("training", vision.id), ("training", "")], \
        "the GPU of the other tenant's job is busy, not named"
    assert overview["gpu_totals"]["training"] == 2, "cluster capacity is not a tenant's secret"

    deadline = time.monotonic() + 15
    while not (history := get_json(site, "/api/history", alice))["gpus_by_tenant"]:
        assert time.monotonic() < deadline, "the charts never got a sample"
        time.sleep(0.2)
    assert [row["tenant"] for row in history["gpus_by_tenant"]] == ["vision"]
    assert [row["id"] for row in history["gpus_by_job"]] == [vision.id]
    assert "pending_jobs_by_tenant" not in history

    assert get_json(site, f"/api/job/{vision.id}", alice)["job"]["name"] == "vision-secret-name"
    status, _, theirs = request(site, "GET", f"/api/job/{speech.id}", token=alice)
    unknown_id = "job-000000000000"
    status_unknown, _, unknown = request(site, "GET", f"/api/job/{unknown_id}", token=alice)
    assert (status, status_unknown) == (404, 404)
    assert json.loads(theirs)["error"].replace(speech.id, "ID") == json.loads(unknown)["error"].replace(unknown_id, "ID"), \
        "another tenant's job answers exactly as an unknown one"
    status, _, page = request(site, "GET", f"/job/{speech.id}", token=alice)
    assert status == 404 and "secret" not in page

    listings = "".join(request(site, "GET", path, token=alice)[2] for path in ("/api/overview", "/api/history"))
    assert "speech" not in listings and speech.id not in listings, "nothing of the other tenant leaks"
    assert "speech" not in theirs + page and "secret" not in theirs + page
    assert request(site, "GET", "/metrics", token=alice)[0] == 403

    bob = get_json(site, "/api/overview", site.tokens["bob"])
    assert [j["id"] for j in bob["jobs"]] == [speech.id]


@pytest.mark.parametrize("who", ["ops", "cluster-token"])
def test_admins_see_every_tenant(site: Site, who: str) -> None:
    token = CLUSTER_TOKEN if who == "cluster-token" else site.tokens["ops"]
    overview = get_json(site, "/api/overview", token)
    assert sorted(j["id"] for j in overview["jobs"]) == sorted(j.id for j in site.jobs.values())
    assert [g["holder"] for g in overview["nodes"][0]["gpus"]] == [site.jobs["vision"].id, site.jobs["speech"].id]
    assert get_json(site, f"/api/job/{site.jobs['speech'].id}", token)["job"]["tenant"] == "speech"
    assert get_json(site, "/api/whoami", token)["admin"] is True
    assert request(site, "GET", "/metrics", token=token)[0] == 200


def test_a_revoked_credential_is_refused_within_the_cache_ttl(site: Site) -> None:
    issued = site.admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="alice"))
    assert request(site, "GET", "/api/overview", token=issued.token)[0] == 200
    site.admin.RevokeCredential(a.RevokeCredentialRequest(id=issued.credential.id))
    deadline = time.monotonic() + 5
    while (status := request(site, "GET", "/api/overview", token=issued.token)[0]) == 200:
        assert time.monotonic() < deadline, "the revoked credential still works past the cache TTL (0.5 s)"
        time.sleep(0.1)
    assert status == 401


def test_in_chromium_a_user_sees_who_they_are_and_their_jobs_only(site: Site) -> None:
    from tests.dashboard import browser

    chromium = browser.chromium()
    url = f"http://{site.address}/?token={site.tokens['alice']}"  # sets the cookie the page's polls carry
    for _ in range(5):
        dom = browser.run(chromium, url, "--dump-dom").stdout
        if 'data-loaded="true"' in dom and site.jobs["vision"].id in dom:
            break
    assert "user alice · tenants: vision" in dom
    assert '<form id="logout" method="post" action="/logout">' in dom, "the sign-out button shows (no longer hidden)"
    assert site.jobs["vision"].id in dom and site.jobs["speech"].id not in dom and "speech" not in dom


def test_without_auth_nothing_asks_for_a_credential(site: Site, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with start_service("dashboard", "--metadata-address", site.metadata, "--log-level", "warning",
                       workdir=tmp_path) as dash:
        open_site = Site(dash.address, {}, {}, site.admin, site.metadata)
        status, _, body = request(open_site, "GET", "/")
        assert status == 200 and 'action="/login"' not in body and 'id="jobs"' in body  # the page, no sign-in
        assert json.loads(request(open_site, "GET", "/api/whoami")[2]) == {
            "kind": "admin", "name": "", "tenants": [], "admin": True, "auth": False}
        status, headers, _ = request(open_site, "POST", "/login", form={"token": "anything"})
        assert status == 303 and "set-cookie" not in headers
