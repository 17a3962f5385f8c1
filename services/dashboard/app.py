"""``silod dashboard``: a read-only web view of a running cluster (aiohttp).

Routes: ``/`` (the page), ``/job/<job id>`` (one job's page), ``/static/*``, ``/api/overview``
(the JSON the page polls), ``/api/history`` (the charts' series: samples of the overview the
dashboard keeps in memory, see :mod:`services.dashboard.history`), ``/api/job/<job id>`` (one
job's events, GPUs per plan and throughput), ``/healthz`` (liveness, never behind the token) and
``/metrics`` (Prometheus).

Auth: with an ``auth_token`` set, every route but ``/healthz`` and the login form (``/login``,
``/logout``) needs a credential: the cluster token (an admin) or a person's credential, given
as ``Authorization: Bearer <token>``, through the login form, or once as ``?token=<token>`` on
a page URL; the browser then keeps it in an HttpOnly cookie. A user sees their tenants' jobs
only (:mod:`services.dashboard.viewers`); ``/api/whoami`` says who the page is for. The
dashboard itself calls the metadata service and the cache servers with the cluster token.
"""

from __future__ import annotations

import asyncio
import json
import math
import logging
import time
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import Field, field_validator, model_validator

from silod.rpc.channels import open_channel
from services.runtime.settings import ServiceSettings
from services.dashboard import viewers
from services.dashboard.collect import job_detail, overview
from services.dashboard.history import History
from services.dashboard.viewers import Refused, Viewer
from services.runtime.directory import RemoteDirectory
from silod.rpc.identifiers import JOB_ID, show
from silod.v1 import cache_pb2, cache_pb2_grpc, metadata_pb2, metadata_pb2_grpc

STATIC = Path(__file__).parent / "static"
COOKIE = viewers.COOKIE
OPEN_ROUTES = ("/healthz", "/login", "/logout")  # no credential needed
ADMIN_ROUTES = ("/metrics",)  # the process's own figures: for operators
_log = logging.getLogger("services.dashboard")

REQUESTS = Counter("silod_dashboard_requests_total", "HTTP requests served by the dashboard", ["route", "status"])
OVERVIEW_SECONDS = Histogram("silod_dashboard_overview_seconds", "Seconds to gather one /api/overview")


class Settings(ServiceSettings):
    listen: str = Field("127.0.0.1:8080", description="HOST:PORT the dashboard's HTTP server binds; port 0 picks a free one")
    metadata_address: str = Field("", validate_default=True, description="HOST:PORT of the metadata service (required)")
    node_timeout_s: float = Field(15.0, gt=0, description="Seconds since its last heartbeat after which a node shows as down")
    cache_timeout_s: float = Field(1.0, gt=0, description="Seconds a node's cache server gets to answer Stats before it shows as unreachable")
    plan_history: int = Field(20, ge=1, le=100, description="Plans listed in the plan history")
    refresh_s: float = Field(2.0, gt=0, description="Seconds between the page's automatic refreshes")
    history_interval_s: float = Field(5.0, gt=0, le=3600,
                                      description="Seconds between the samples of the cluster the charts draw (kept in memory)")
    history_window_s: float = Field(3600.0, gt=0, le=7 * 86400,
                                    description="Seconds of samples kept for the charts; older ones are dropped "
                                                "(at most history_window_s / history_interval_s samples)")

    @field_validator("metadata_address")
    @classmethod
    def _metadata_required(cls, value: str) -> str:
        if not value:
            raise ValueError("required: HOST:PORT of silod metadata")
        return value

    @model_validator(mode="after")
    def _history_bounded(self) -> "Settings":
        if self.history_window_s / self.history_interval_s > 100_000:
            raise ValueError("history_window_s / history_interval_s: at most 100000 samples are kept, got "
                             f"{self.history_window_s / self.history_interval_s:.0f}")
        return self


@web.middleware
async def _guard(request: web.Request, handler: Any) -> web.StreamResponse:
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
    settings: Settings = request.app["settings"]
    try:
        if not settings.auth_token or route in OPEN_ROUTES:
            request["viewer"] = viewers.NOBODY_CHECKS if not settings.auth_token else None
            response: web.StreamResponse = await handler(request)
        else:
            token = viewers.presented_token(request)
            try:
                viewer = await viewers.identify(request, token)
                if route in ADMIN_ROUTES and not viewer.admin:
                    raise Refused(403, f"{route} is for admins")
            except Refused as exc:
                response = viewers.refused(request, route, exc)
            else:
                request["viewer"] = viewer
                response = await handler(request)
                if request.query.get("token"):
                    viewers.set_cookie(request, response, token)
    except web.HTTPException as exc:
        response = exc
    REQUESTS.labels(route, str(response.status)).inc()
    return response


async def _page(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html")


def _viewer(request: web.Request) -> Viewer:
    return request["viewer"]  # type: ignore[no-any-return]


async def _whoami(request: web.Request) -> web.Response:
    return web.json_response({**_viewer(request).describe(), "auth": bool(request.app["settings"].auth_token)})


async def _overview(request: web.Request) -> web.Response:
    settings: Settings = request.app["settings"]
    started = time.perf_counter()
    try:
        data = await overview(request.app["metadata"], request.app["cache_stats"],
                              liveness_window_s=settings.node_timeout_s, cache_timeout_s=settings.cache_timeout_s,
                              plan_history=settings.plan_history)
    except grpc.aio.AioRpcError as exc:
        _log.warning("metadata service unavailable", extra={"code": exc.code().name, "detail": exc.details()})
        return web.json_response({"error": f"metadata service {settings.metadata_address}: {exc.details()}"},
                                 status=503)
    OVERVIEW_SECONDS.observe(time.perf_counter() - started)
    data = viewers.overview_for(data, _viewer(request))
    data["refresh_s"] = settings.refresh_s
    return web.json_response(data)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _job_id_problem(request: web.Request) -> tuple[str, str | None]:
    job_id = request.match_info["job_id"]
    problem = JOB_ID.problem(job_id)
    return job_id, (f"job_id: {problem}" if problem else None)


def _metadata_error(settings: Settings, job_id: str, exc: grpc.aio.AioRpcError) -> web.Response:
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        return _error(404, f"job_id: no job {show(job_id)} ({exc.details()})")
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return _error(400, f"job_id: {exc.details()}")
    _log.warning("metadata service unavailable", extra={"code": exc.code().name, "detail": exc.details()})
    return _error(503, f"metadata service {settings.metadata_address}: {exc.details()}")


def _not_visible(job_id: str) -> web.Response:
    """A job of another tenant: the answer an unknown job gets, so not even its existence shows."""
    return _error(404, f"job_id: no job {show(job_id)} among your tenants' jobs")


async def _visible_job(request: web.Request, job_id: str) -> web.Response | None:
    """None when the viewer may see job ``job_id``; else the error response."""
    settings: Settings = request.app["settings"]
    viewer = _viewer(request)
    try:
        job = await request.app["metadata"].GetJob(metadata_pb2.GetJobRequest(job_id=job_id))
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND and not viewer.admin:
            return _not_visible(job_id)
        return _metadata_error(settings, job_id, exc)
    return None if viewer.sees_tenant(job.spec.tenant) else _not_visible(job_id)


async def _job_page(request: web.Request) -> web.StreamResponse:
    job_id, problem = _job_id_problem(request)
    if problem:
        return web.Response(status=400, text=problem + "\n")
    refusal = await _visible_job(request, job_id)
    if refusal is not None:
        return web.Response(status=refusal.status, text=json.loads(refusal.text)["error"] + "\n")
    return web.FileResponse(STATIC / "job.html")


async def _job(request: web.Request) -> web.Response:
    settings: Settings = request.app["settings"]
    job_id, problem = _job_id_problem(request)
    if problem:
        return _error(400, problem)
    refusal = await _visible_job(request, job_id)
    if refusal is not None:
        return refusal
    try:
        data = await job_detail(request.app["metadata"], job_id)
    except grpc.aio.AioRpcError as exc:
        return _metadata_error(settings, job_id, exc)
    data["refresh_s"] = settings.refresh_s
    return web.json_response(data)


async def _history(request: web.Request) -> web.Response:
    settings: Settings = request.app["settings"]
    history: History = request.app["history"]
    window = request.query.get("window_s")
    window_s = None
    if window is not None:
        try:
            window_s = float(window)
        except ValueError:
            window_s = math.nan
        if not (window_s > 0 and math.isfinite(window_s)):
            return _error(400, f"window_s: seconds of history, a number > 0, got {show(window)}")
    data = viewers.history_for(history.series(window_s), _viewer(request))
    data["refresh_s"] = settings.refresh_s
    return web.json_response(data)


async def _sample_forever(app: web.Application) -> None:
    """Add a sample of the overview to the history every ``history_interval_s`` seconds."""
    settings: Settings = app["settings"]
    history: History = app["history"]
    while True:
        started = time.monotonic()
        try:
            history.add(await overview(app["metadata"], app["cache_stats"],
                                       liveness_window_s=settings.node_timeout_s,
                                       cache_timeout_s=settings.cache_timeout_s, plan_history=1))
        except grpc.aio.AioRpcError as exc:  # a gap in the charts, not a dead sampler
            _log.warning("history sample skipped: metadata service unavailable",
                         extra={"code": exc.code().name, "detail": exc.details()})
        except Exception:  # noqa: BLE001 -- the sampler must outlive any one bad sample
            _log.exception("history sample failed")
        await asyncio.sleep(max(0.0, settings.history_interval_s - (time.monotonic() - started)))


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "serving"})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(settings: Settings) -> web.Application:
    app = web.Application(middlewares=[_guard])
    app["settings"] = settings
    app["history"] = History(settings.history_window_s, settings.history_interval_s)
    channels: dict[str, grpc.aio.Channel] = {}

    def channel(address: str) -> grpc.aio.Channel:
        if address not in channels:
            channels[address] = open_channel(address, token=settings.auth_token, aio=True,
                                             default_timeout_s=settings.cache_timeout_s * 5)
        return channels[address]

    async def cache_stats(address: str) -> cache_pb2.StatsResponse:
        return await cache_pb2_grpc.CacheServiceStub(channel(address)).Stats(
            cache_pb2.StatsRequest(), timeout=settings.cache_timeout_s)

    async def on_startup(app: web.Application) -> None:
        # aio channels belong to the loop that serves, so they are opened here, not at import.
        app["metadata"] = metadata_pb2_grpc.MetadataServiceStub(channel(settings.metadata_address))
        app["cache_stats"] = cache_stats
        # Who a presented credential stands for: the metadata service, asked with the cluster token.
        app["directory"] = RemoteDirectory(settings.metadata_address, settings.auth_token,
                                           ttl_s=settings.credential_cache_s)
        app["sampler"] = asyncio.get_running_loop().create_task(_sample_forever(app))

    async def on_cleanup(app: web.Application) -> None:
        app["sampler"].cancel()
        try:
            await app["sampler"]
        except asyncio.CancelledError:
            pass
        for ch in channels.values():
            await ch.close()
        await app["directory"].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/", _page)
    app.router.add_get("/login", viewers.login_form)
    app.router.add_post("/login", viewers.login)
    app.router.add_post("/logout", viewers.logout)
    app.router.add_get("/logout", viewers.logout)
    app.router.add_get("/api/whoami", _whoami)
    app.router.add_get("/job/{job_id}", _job_page)
    app.router.add_get("/api/overview", _overview)
    app.router.add_get("/api/history", _history)
    app.router.add_get("/api/job/{job_id}", _job)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_static("/static/", STATIC)
    return app
