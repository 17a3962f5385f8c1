"""Bootstrap of every silod gRPC process: one place that meets the operational standard.

Health, reflection, auth, error mapping, request logs, metrics, TLS, the ready file and
graceful shutdown are all here, so a service only supplies its servicers
(:class:`ServiceDefinition`) and cannot forget any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from silod.launcher import LAUNCHER_PID_ENV
from silod.rpc.limits import MESSAGE_SIZE_OPTIONS
from silod.rpc.keepalive import SERVER_KEEPALIVE_OPTIONS
from services.runtime import gc_pauses, loop_lag, metrics
from services.runtime.access import AccessInterceptor
from services.runtime.audit import AuditInterceptor, AuditRecorder, AuditSink, recorder_for
from services.runtime.auth import auth_enabled, caller_token
from services.runtime.directory import Directory, RemoteDirectory
from services.runtime.interceptors import ErrorMapper, RequestObserver
from services.runtime.settings import ConfigError, ServiceSettings, split_host_port
from services.runtime.structured_logging import configure_logging, get_logger

_log = get_logger("silod.server")


@dataclass
class ServiceDefinition:
    name: str  # short process name, e.g. "metadata"; used in logs and metrics
    service_names: Sequence[str]  # full gRPC service names, for health and reflection
    register: Callable[[grpc.aio.Server], None]  # adds the servicers to the server
    on_start: Callable[[], Awaitable[None]] | None = None  # awaited before the port opens
    on_stop: Callable[[], Awaitable[None]] | None = None  # awaited after the server stopped
    # Who a credential stands for, when auth is on: the metadata service answers from its store;
    # None = ask the metadata service at settings.metadata_address (services/runtime/directory.py).
    directory: Directory | None = None
    # Where the audit log's events go (services/runtime/audit.py): the metadata service's own store;
    # None = the metadata service at settings.metadata_address (or the log when there is none).
    audit_sink: AuditSink | None = None
    _on_fail: Callable[[ConfigError], None] | None = dataclass_field(default=None, repr=False)

    def fail(self, error: ConfigError) -> None:
        """Stop serving for a configuration error learnt while serving (a setting another process
        refused): the process stops as on SIGTERM, then :func:`run` prints the error on one line
        and returns 2. Before serving (or outside :func:`run`) it is only logged."""
        if self._on_fail is not None:
            self._on_fail(error)
        else:
            _log.error("configuration error", extra={"detail": str(error)})


class StartupError(Exception):
    """The process cannot start for an expected reason; the message is all the user needs."""


class RunningServer:
    """A started server; :meth:`stop` is safe to call more than once and from several tasks."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        definition: ServiceDefinition,
        settings: ServiceSettings,
        address: str,
        port: int,
        remote_directory: RemoteDirectory | None = None,
        audit: AuditRecorder | None = None,
    ) -> None:
        self._audit = audit  # flushed after the last call, before on_stop
        self._remote_directory = remote_directory  # its channel is closed after on_stop
        self._server = server
        self._health = health_servicer
        self._definition = definition
        self._settings = settings
        self.address = address
        self.port = port
        self._stop_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving; ``grace`` (default ``settings.shutdown_grace_s``) is what in-flight calls get.

        Health turns NOT_SERVING first so load balancers and watchers drain us before the
        port closes.
        """
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(
                self._stop(self._settings.shutdown_grace_s if grace is None else grace)
            )
        # shield: a caller cancelled mid-way must not leave the server half-stopped.
        await asyncio.shield(self._stop_task)

    async def _stop(self, grace: float) -> None:
        try:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace)
            if self._audit is not None:
                await self._audit.close()
            if self._definition.on_stop is not None:
                await self._definition.on_stop()
        finally:
            if self._remote_directory is not None:
                await self._remote_directory.close()
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        """Return once :meth:`stop` has finished, on_stop included."""
        await self._stopped.wait()


def _server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    cert, key = settings.tls_cert_file, settings.tls_key_file
    client_ca = getattr(settings, "tls_client_ca_file", "")
    if not cert and not key:
        if client_ca:
            raise ConfigError("tls_client_ca_file: needs TLS on (tls_cert_file and tls_key_file)")
        return None
    if not (cert and key):
        missing = "tls_key_file" if cert else "tls_cert_file"
        raise ConfigError(f"{missing}: must be set together with {'tls_cert_file' if cert else 'tls_key_file'}")
    pems = []
    for field, path in (("tls_key_file", key), ("tls_cert_file", cert), ("tls_client_ca_file", client_ca)):
        try:
            pems.append(Path(path).read_bytes() if path else None)
        except OSError as exc:
            raise ConfigError(f"{field}: cannot read {path!r}: {exc.strerror or exc}") from None
    if pems[2] is None:
        return grpc.ssl_server_credentials([(pems[0], pems[1])])
    # gRPC's Python API either requires and verifies a client certificate or never asks for one.
    return grpc.ssl_server_credentials([(pems[0], pems[1])], root_certificates=pems[2], require_client_auth=True)


def _present_client_certificate(settings: ServiceSettings) -> None:
    """The client certificate the process's own TLS channels present (checked readable now)."""
    from silod.rpc.channels import use_client_certificate

    cert, key = getattr(settings, "tls_client_cert_file", ""), getattr(settings, "tls_client_key_file", "")
    if bool(cert) != bool(key):
        missing = "tls_client_key_file" if cert else "tls_client_cert_file"
        raise ConfigError(f"{missing}: must be set together with {'tls_client_cert_file' if cert else 'tls_client_key_file'}")
    for field, path in (("tls_client_cert_file", cert), ("tls_client_key_file", key)):
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{field}: cannot read {path!r}")
    if cert:
        use_client_certificate(cert, key)


def _bind_problem(listen: str) -> str:
    """Why ``listen`` cannot be bound, in the OS's words; gRPC's exception only says that it failed."""
    host, port = split_host_port(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    family, kind, proto, _, sockaddr = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            sock.bind(sockaddr)
    except OSError as exc:
        return str(exc.strerror or exc)
    return "gRPC refused it (set GRPC_VERBOSITY=debug for details)"


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_server(definition: ServiceDefinition, settings: ServiceSettings) -> RunningServer:
    """Run on_start, bind ``settings.listen`` and serve; raise StartupError/ConfigError if that fails."""
    host, _ = split_host_port(settings.listen)
    credentials = _server_credentials(settings)  # fail on bad TLS settings before on_start does work
    _present_client_certificate(settings)

    interceptors: list[grpc.aio.ServerInterceptor] = [RequestObserver(definition.name)]
    remote = audit = None
    if auth_enabled(settings):  # the cluster token, or a node process's own credential
        directory = definition.directory
        if directory is None and getattr(settings, "metadata_address", ""):
            directory = remote = RemoteDirectory(
                settings.metadata_address, caller_token(settings), ttl_s=settings.credential_cache_s,
                tls_ca_file=getattr(settings, "metadata_tls_ca_file", ""), resolve_any=not settings.auth_token)
        audit = recorder_for(definition.name, settings, definition.audit_sink,
                             directory.job_tenant if directory is not None else None)
        interceptors.append(AuditInterceptor(audit))  # outside access: it records the refusals too
        interceptors.append(AccessInterceptor(settings.auth_token, directory,
                                              client_certificates=bool(getattr(settings, "tls_client_ca_file", ""))))
    interceptors.append(ErrorMapper())
    # so_reuseport=0: otherwise a second process could "bind" a port already taken and
    # silently share its traffic instead of failing.
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.so_reuseport", 0), *MESSAGE_SIZE_OPTIONS, *SERVER_KEEPALIVE_OPTIONS])

    definition.register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*definition.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )

    if definition.on_start is not None:
        try:
            await definition.on_start()
        except (ConfigError, StartupError):
            raise
        except Exception as exc:
            _log.debug("on_start failed", exc_info=True)
            if isinstance(exc, grpc.aio.AioRpcError):  # its str() is a multi-line dump of gRPC internals
                raise StartupError(f"on_start failed: a call was refused: {exc.code().name}: {exc.details()}") from exc
            raise StartupError(f"on_start failed: {type(exc).__name__}: {exc}") from exc

    try:
        try:
            if credentials is None:
                port = server.add_insecure_port(settings.listen)
            else:
                port = server.add_secure_port(settings.listen, credentials)
        except RuntimeError:
            port = 0
        if port == 0:  # older gRPC returned 0, newer raises: treat both alike
            raise StartupError(f"listen: cannot bind {settings.listen}: {_bind_problem(settings.listen)}")
        await server.start()
    except BaseException:
        if definition.on_stop is not None:
            await definition.on_stop()  # on_start's resources (DB pools) must not leak
        raise

    for name in ("", *definition.service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if audit is not None:
        audit.start()
    return RunningServer(server, health_servicer, definition, settings, _format_address(host, port), port, remote,
                         audit)


def write_ready_file(path: str, address: str) -> None:
    # Write-then-rename so a polling launcher never reads a half-written address.
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(address)
        os.replace(tmp, target)
    except OSError as exc:
        raise StartupError(f"ready_file: cannot write {path!r}: {exc.strerror or exc}") from None


def remove_ready_file(path: str) -> None:
    if path:
        Path(path).unlink(missing_ok=True)


async def _serve(definition: ServiceDefinition, settings: ServiceSettings) -> None:
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop_requested.set()

    failures: list[ConfigError] = []

    def on_fail(error: ConfigError) -> None:
        failures.append(error)
        received.append("configuration error")
        stop_requested.set()

    definition._on_fail = on_fail

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    def on_launcher_gone() -> None:
        received.append("launcher gone")
        stop_requested.set()

    launcher_watch = watch_launcher(on_launcher_gone)

    gc_pauses.measure()
    lag_probe = asyncio.ensure_future(loop_lag.probe())
    # A file left by a killed predecessor would announce an address nobody serves.
    remove_ready_file(settings.ready_file)
    metrics_server = None
    if settings.metrics_port:
        try:
            metrics_server = metrics.start_metrics_server(settings.metrics_host, settings.metrics_port)
        except OSError as exc:
            raise StartupError(
                f"metrics_port: cannot bind {settings.metrics_host}:{settings.metrics_port}: {exc.strerror or exc}"
            ) from None
    try:
        running = await _start_unless_stopped(definition, settings, stop_requested)
        if running is None:
            _log.info("stopped before serving", extra={"signal": received[0]})
            if failures:
                raise failures[0]
            return
        if settings.gc_young_threshold:
            gc_pauses.tune(settings.gc_young_threshold)
        try:
            if settings.ready_file:
                write_ready_file(settings.ready_file, running.address)
            _log.info(
                "serving",
                extra={
                    "address": running.address,
                    "services": list(definition.service_names),
                    "tls": bool(settings.tls_cert_file),
                    "auth": auth_enabled(settings),
                    "metrics_port": settings.metrics_port or None,
                    "version": metrics.silod_version(),
                },
            )
            await stop_requested.wait()
            _log.info("shutting down", extra={"signal": received[0], "grace_s": settings.shutdown_grace_s})
        finally:
            await running.stop(settings.shutdown_grace_s)
            remove_ready_file(settings.ready_file)
        _log.info("shutdown complete")
        if failures:
            raise failures[0]
    finally:
        lag_probe.cancel()
        if launcher_watch is not None:
            launcher_watch.cancel()
        if metrics_server is not None:
            metrics_server.shutdown()


def watch_launcher(on_gone: Callable[[], None]) -> asyncio.Future | None:
    """Started by silod.launcher (``LAUNCHER_PID_ENV``): call ``on_gone`` (stop, as on SIGTERM)
    once that process is no longer this one's parent (it died, and this process was handed to
    another). None for a process started some other way. The variable is removed here, so that
    what this process starts does not take the launcher for its own."""
    raw = os.environ.pop(LAUNCHER_PID_ENV, "")
    if not raw.isdigit():
        return None
    launcher = int(raw)

    async def watch() -> None:
        while os.getppid() == launcher:
            await asyncio.sleep(0.5)
        _log.warning("the process that launched this service is gone; stopping", extra={"launcher_pid": launcher})
        on_gone()

    return asyncio.ensure_future(watch())


async def _start_unless_stopped(
    definition: ServiceDefinition, settings: ServiceSettings, stop_requested: asyncio.Event
) -> RunningServer | None:
    """start_server, abandoned (None) if a signal comes first: an orchestrator that gives up on a
    service stuck in on_start (say, waiting for its database) must be able to stop it."""
    starting = asyncio.ensure_future(start_server(definition, settings))
    stopping = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return None
    return starting.result()


def run(definition: ServiceDefinition, settings: ServiceSettings) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code.

    Expected failures print one line on stderr, no traceback (it is logged at debug level):
    bad settings such as TLS files return 2 like the CLI's other configuration errors; a
    port that cannot be bound or a failing on_start return 1. Anything else is a bug: it is
    logged with its traceback and returns 1.
    """
    configure_logging(settings, process=definition.name)
    try:
        asyncio.run(_serve(definition, settings))
    except ConfigError as exc:
        print(f"silod {definition.name}: configuration error: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"silod {definition.name}: cannot start: {exc}", file=sys.stderr)
        return 1
    except Exception:
        _log.exception("fatal error")
        return 1
    return 0
