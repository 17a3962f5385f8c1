"""``silod dashboard``: a read-only web view of a running cluster (aiohttp).

Routes: ``/`` (the page), ``/static/*``, ``/api/overview`` (the JSON the page polls),
``/healthz`` (liveness, never behind the token) and ``/metrics`` (Prometheus).

Auth: with an ``auth_token`` set, every route but ``/healthz`` needs the token, given as
``Authorization: Bearer <token>``, or once as ``?token=<token>`` on the page URL; the page
then keeps it in an HttpOnly cookie so the browser's API polls carry it. The dashboard uses
the same token to call the metadata service and the cache servers.
"""

from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import Field, field_validator

from silod.rpc.channels import open_channel
from services.runtime.settings import ServiceSettings
from services.dashboard.collect import overview
from silod.v1 import cache_pb2, cache_pb2_grpc, metadata_pb2_grpc

STATIC = Path(__file__).parent / "static"
COOKIE = "silod_token"
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

    @field_validator("metadata_address")
    @classmethod
    def _metadata_required(cls, value: str) -> str:
        if not value:
            raise ValueError("required: HOST:PORT of silod metadata")
        return value


def _authorized(request: web.Request, token: str) -> bool:
    if not token:
        return True
    header = request.headers.get("Authorization", "")
    given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
    given = given or request.query.get("token", "") or request.cookies.get(COOKIE, "")
    return hmac.compare_digest(given.encode(), token.encode())


@web.middleware
async def _guard(request: web.Request, handler: Any) -> web.StreamResponse:
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
    settings: Settings = request.app["settings"]
    try:
        if route != "/healthz" and not _authorized(request, settings.auth_token):
            response: web.StreamResponse = web.json_response(
                {"error": "unauthenticated: give the dashboard token as ?token=... or 'Authorization: Bearer ...'"},
                status=401)
        else:
            response = await handler(request)
            if settings.auth_token and request.query.get("token"):
                response.set_cookie(COOKIE, settings.auth_token, httponly=True, samesite="Strict")
    except web.HTTPException as exc:
        response = exc
    REQUESTS.labels(route, str(response.status)).inc()
    return response


async def _page(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html")


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
    data["refresh_s"] = settings.refresh_s
    return web.json_response(data)


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "serving"})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(settings: Settings) -> web.Application:
    app = web.Application(middlewares=[_guard])
    app["settings"] = settings
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

    async def on_cleanup(app: web.Application) -> None:
        for ch in channels.values():
            await ch.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/", _page)
    app.router.add_get("/api/overview", _overview)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_static("/static/", STATIC)
    return app
