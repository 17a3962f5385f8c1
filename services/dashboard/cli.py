"""``silod dashboard``: serve the read-only web view until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import ssl
import sys

from silod.cli.settings_flags import add_settings_flags, settings_overrides

_log = logging.getLogger("services.dashboard")


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from services.dashboard.app import Settings

    p = sub.add_parser(
        "dashboard", help="read-only web dashboard: nodes and GPUs, jobs, cache, plans, charts over time, a page per job",
        description="Serve a read-only web dashboard of a running silod cluster (HTTP). With --auth-token set it "
                    "asks for a credential (a sign-in form at /login; a user sees their tenants' jobs only, an "
                    "admin everything). Every flag can also be set as a "
                    "SILOD_<NAME> environment variable or in --config.")
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file of settings (env SILOD_CONFIG)")
    add_settings_flags(p, Settings)
    # service=: the deployment checks and the config reference treat it like the gRPC services.
    p.set_defaults(handler=_run, service="dashboard")


def _run(args: argparse.Namespace) -> int:
    from services.runtime.settings import ConfigError, load_settings
    from services.dashboard.app import Settings

    try:
        settings = load_settings(Settings, args.config, **settings_overrides(args, Settings))
    except ConfigError as exc:
        print(f"silod dashboard: configuration error: {exc}", file=sys.stderr)
        return 2
    # The shared --help handler made SIGPIPE fatal for client commands; a server must not die of it.
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        return asyncio.run(_serve(settings))
    except OSError as exc:  # a port taken, or an unreadable TLS file
        print(f"silod dashboard: cannot start on {settings.listen}: {exc.strerror or exc}", file=sys.stderr)
        return 1


async def _serve(settings: "Settings") -> int:  # type: ignore[name-defined]  # noqa: F821
    from aiohttp import web

    from services.runtime.metrics import start_metrics_server
    from services.runtime.server import remove_ready_file, watch_launcher, write_ready_file
    from services.runtime.settings import split_host_port
    from services.runtime.structured_logging import configure_logging
    from services.dashboard.app import build_app

    configure_logging(settings, process="dashboard")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    launcher_watch = watch_launcher(stop.set)
    remove_ready_file(settings.ready_file)
    host, port = split_host_port(settings.listen)
    ssl_context = None
    if settings.tls_cert_file:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file or None)
    metrics_server = None
    if settings.metrics_port:  # /metrics is also on the dashboard's own port; this is for uniform scraping
        metrics_server = start_metrics_server(settings.metrics_host, settings.metrics_port)
    runner = web.AppRunner(build_app(settings), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, shutdown_timeout=settings.shutdown_grace_s, ssl_context=ssl_context)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    address = f"{host}:{bound}"
    if settings.ready_file:
        write_ready_file(settings.ready_file, address)
    _log.info("serving", extra={"address": address, "auth": bool(settings.auth_token),
                                "metadata_address": settings.metadata_address})
    try:
        await stop.wait()
    finally:
        _log.info("shutting down")
        if launcher_watch is not None:
            launcher_watch.cancel()
        await runner.cleanup()
        remove_ready_file(settings.ready_file)
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0
