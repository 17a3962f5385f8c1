"""The local lease socket: Lease calls from readers on this host over a Unix socket.

A warm epoch is a Lease call per batch and nothing else from the cache server; on that path
gRPC's own per-call work (HTTP/2 framing, its completion-queue thread, the interceptors) cost
the server ~1 ms and the reader ~0.4 ms a call, as much as leasing the 128 keys themselves.
This socket carries the same ``LeaseRequest`` / ``LeaseResponse`` messages with none of that,
as HDFS's short-circuit local reads use a domain socket beside the DataNode's RPC port. The
reader learns the path from ``LeaseResponse.local_socket`` of a gRPC Lease; everything else
(and every reader that ignores the field) stays on gRPC.

Frames, both ways: a 4-byte big-endian length, then that many bytes: one kind byte and a
payload. Requests: kind 0 = hello (payload: the caller's credential, empty if none; the first
frame of every connection), kind 1 = ``LeaseRequest``, kind 2 = ``ReleaseLeaseRequest`` (a reader's
last lease, when its process ends). Answers: kind 0 = ok (payload: the ``LeaseResponse``;
empty for a hello or a release), any other kind = the gRPC status code of a refusal, the
payload its UTF-8 message (the same message, naming the field, that gRPC would carry). A
connection serves one call at a time; readers open one each.

Who may call, with auth on: the cluster token, and a job's own credential (what its ranks
hold, services/runtime/access_rules.py), for leases of that job and its dataset only: the table's
rule of a gRPC Lease, applied here. A job's
credential is checked again at each call through the directory's cache (credential_cache_s),
so a revoked one stops working on an open connection too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services.runtime import metrics
from services.runtime.directory import Directory
from services.runtime.errors import PermissionDenied, ServiceError, Unauthenticated
from services.runtime.interceptors import check_identifiers
from services.runtime.structured_logging import get_logger
from silod.v1 import cache_pb2

_log = get_logger("silod.cache")

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a Lease of 4,096 keys of 1,024 characters, and room to spare
KIND_HELLO, KIND_LEASE, KIND_RELEASE = 0, 1, 2
OK = 0
# The metrics' method labels of calls on this socket.
METHODS = {KIND_LEASE: "local:/silod.v1.CacheService/Lease", KIND_RELEASE: "local:/silod.v1.CacheService/ReleaseLease"}
# sun_path holds 108 bytes on Linux, the terminating NUL included.
MAX_PATH_BYTES = 107


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload) + 1) + bytes((kind,)) + payload


class LocalLeaseServer:
    """Serves ``answer(LeaseRequest) -> LeaseResponse`` and ``release(lease_id)`` on a Unix socket
    at ``path``. ``"auto"``: ``lease.sock`` in ``beside`` (the first cache tier's directory, which
    every reader on the node sees already: it reads the leased files there), else (no such
    directory, or a path too long for a Unix socket) in a fresh directory under the system's
    temporary directory."""

    def __init__(self, answer: Callable[[cache_pb2.LeaseRequest], Awaitable[cache_pb2.LeaseResponse]],
                 release: Callable[[str], object], path: str, token: str = "", process: str = "cache-server",
                 beside: str = "", directory: Directory | None = None) -> None:
        self._answer = answer
        self._release = release
        self._wanted = path
        self._beside = beside
        self._token = token.encode()
        self._directory = directory  # resolves job credentials; None = only the cluster token
        self._process = process
        self._server: asyncio.AbstractServer | None = None
        self._own_dir = ""
        self._connections: set[asyncio.Task[Any]] = set()
        self.path = ""

    async def start(self) -> str:
        """Bind and listen; returns the socket's path ("" if it could not be bound: logged, and
        readers stay on gRPC)."""
        path = self._wanted
        if path == "auto" and self._beside:
            candidate = os.path.join(self._beside, "lease.sock")
            if len(os.fsencode(candidate)) <= MAX_PATH_BYTES:
                path = candidate
        if path == "auto":
            # Its own directory: no other process's file can be in the way, and stop() removes it.
            self._own_dir = tempfile.mkdtemp(prefix="silod-lease-")
            os.chmod(self._own_dir, 0o755)  # readers may run as other users (the token guards it)
            path = os.path.join(self._own_dir, "sock")
        if len(os.fsencode(path)) > MAX_PATH_BYTES:
            _log.warning("local lease socket path too long for a Unix socket; readers use gRPC only",
                         extra={"path": path, "max_bytes": MAX_PATH_BYTES})
            self._remove_dir()
            return ""
        if os.path.exists(path) and not os.path.isdir(path):
            if _answers(path):
                _log.warning("local lease socket path is in use by another process; readers use gRPC only",
                             extra={"path": path})
                return ""
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a socket left by a cache server that did not stop cleanly
        try:
            self._server = await asyncio.start_unix_server(self._connection, path, limit=1 << 16)
            os.chmod(path, 0o666)
        except OSError as exc:
            _log.warning("local lease socket not available; readers use gRPC only",
                         extra={"path": path, "error": str(exc)})
            self._remove_dir()
            return ""
        self.path = path
        return path

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = ""
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self._own_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = ""

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            kind, payload = await self._read_frame(reader)
            if kind != KIND_HELLO:
                await self._refuse(writer, grpc.StatusCode.INVALID_ARGUMENT, "the first frame must be a hello")
                return
            credential = payload
            try:
                await self._job_of(credential)
            except ServiceError as exc:
                await self._refuse(writer, exc.code, str(exc))
                return
            writer.write(frame(OK, b""))
            await writer.drain()
            while True:
                kind, payload = await self._read_frame(reader)
                if kind not in METHODS:
                    await self._refuse(writer, grpc.StatusCode.INVALID_ARGUMENT, f"unknown frame kind {kind}")
                    return
                writer.write(await self._call(kind, payload, credential))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the reader went away (its process ended): nothing to answer
        except asyncio.CancelledError:
            # stop(): end quietly. A cancelled handler would make asyncio (3.11) log the
            # cancellation as an unhandled exception of the connection's callback.
            pass
        except _FrameTooLarge as exc:
            with contextlib.suppress(ConnectionError):
                await self._refuse(writer, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_frame(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if not 1 <= length <= MAX_FRAME_BYTES:
            raise _FrameTooLarge(f"frame of {length:,} bytes; at most {MAX_FRAME_BYTES:,}")
        data = await reader.readexactly(length)
        return data[0], data[1:]

    async def _refuse(self, writer: asyncio.StreamWriter, code: grpc.StatusCode, message: str) -> None:
        writer.write(frame(code.value[0], message.encode()))
        await writer.drain()

    async def _job_of(self, credential: bytes) -> Any:
        """The job principal whose credential ``credential`` is, None for an admin (the cluster token) or
        with auth off (no cluster token here and no directory); Unauthenticated or PermissionDenied otherwise.
        A cache server with a node credential holds no cluster token: the directory resolves it."""
        if not self._token and self._directory is None:
            return None
        if self._token and hmac.compare_digest(credential, self._token):
            return None
        if self._directory is None or not credential:
            raise Unauthenticated("wrong or missing auth token")
        from services.runtime.principals import CLUSTER_ADMIN
        from silod.v1 import access_pb2

        principal = await self._directory.resolve(credential.decode("utf-8", "replace"))
        if principal == CLUSTER_ADMIN:  # the cluster token, which a node credential's cache server does not hold
            return None
        if principal.kind != access_pb2.PRINCIPAL_KIND_JOB:
            raise PermissionDenied(f"a {principal.kind_name} credential may not lease here; a job's own may")
        return principal

    async def _call(self, kind: int, payload: bytes, credential: bytes = b"") -> bytes:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            job = await self._job_of(credential)  # cached: a dictionary look-up until the TTL passes
            if kind == KIND_RELEASE:
                release = cache_pb2.ReleaseLeaseRequest.FromString(payload)
                check_identifiers(release)
                self._release(release.lease_id)  # unknown or expired ids are fine, as over gRPC
                return frame(OK, b"")
            request = cache_pb2.LeaseRequest.FromString(payload)
            check_identifiers(request)
            if job is not None:  # the access table's rule of a job's gRPC Lease: its own job, its own dataset
                from services.runtime.access_rules import RULES

                check = RULES["/silod.v1.CacheService/Lease"].check_for(job.kind)
                refusal = await check.refuse(job, request, self._directory)
                if refusal is not None:
                    raise PermissionDenied(refusal.reason, field=refusal.field)
            response = await self._answer(request)
            return frame(OK, response.SerializeToString())
        except ServiceError as exc:
            code = exc.code
            return frame(code.value[0], str(exc).encode())
        except Exception as exc:  # noqa: BLE001 -- as the gRPC error mapper: log it, answer INTERNAL
            if type(exc).__name__ == "DecodeError":
                code = grpc.StatusCode.INVALID_ARGUMENT
                return frame(code.value[0], b"the payload is not a " + METHODS[kind].rsplit("/", 1)[1].encode()
                             + b"Request")
            code = grpc.StatusCode.INTERNAL
            _log.exception("unhandled exception in a local Lease call")
            return frame(code.value[0], b"internal error (see the cache server's log)")
        finally:
            method = METHODS[kind]
            metrics.REQUESTS.labels(service_process=self._process, method=method, code=code.name).inc()
            metrics.DURATION.labels(service_process=self._process, method=method).observe(time.perf_counter() - start)


def _answers(path: str) -> bool:
    """Whether a process listens on the Unix socket at ``path``."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


class _FrameTooLarge(Exception):
    pass
