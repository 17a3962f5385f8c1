"""An S3-protocol store emulator over a local directory: the remote store of the data-loading
benchmark, made a tool (``silod store-emulator``).

Every top-level directory under ``root`` is a bucket; the files below it are its objects, keyed
by their path relative to the bucket directory (``ROOT/bench/train/a.jpg`` is ``s3://bench/train/a.jpg``).
It implements the subset of S3 that s3fs and botocore use to list and read: ListBuckets
(``GET /``), HeadBucket, ListObjectsV2 (prefix, delimiter, max-keys, continuation-token,
start-after), HeadObject and GetObject with ``Range`` and ``If-Match``. Objects are read-only
(no PUT): change the files themselves; ETags (MD5 of the content, as S3 gives for single-part
uploads) follow the files, recomputed when a file's size or mtime changes.

The point is the cost model of a remote store:

- **one link shared by all connections** (``bandwidth_bytes_per_s``): every body byte sent
  reserves its share of a single virtual link, so N concurrent readers together get the
  configured rate, not N times it -- what a storage budget is;
- **a latency per request** (``latency_s``) before every S3 answer (list, head, get).

Requests are not authenticated: signed requests (any ``AWS_ACCESS_KEY_ID``/``SECRET``) and
anonymous ones (s3fs ``anon=true``) are served alike. Loopback or a trusted network only.

Also: ``GET /healthz`` (200 while serving), ``GET /metrics`` (Prometheus text: body bytes sent,
requests by operation and status, the configured limits). Those two names can therefore not be
buckets; a root holding such a directory is refused. SIGTERM/SIGINT stop it gracefully:
no new connections, requests in flight get ``shutdown_grace_s`` to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from xml.sax.saxutils import escape

_log = logging.getLogger("silod.store_emulator")

RESERVED_NAMES = ("healthz", "metrics")  # served by the emulator itself, so never buckets
CHUNK_BYTES = 65536  # granularity of the shared link: readers interleave at this size
READ_BYTES = 1 << 20  # file reads off the event loop, this much at a time
S3_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"


class EmulatorConfigError(ValueError):
    """A setting that cannot be used; the message starts with the flag it concerns."""


@dataclass(frozen=True)
class EmulatorConfig:
    root: str
    host: str = "127.0.0.1"
    port: int = 9000
    bandwidth_bytes_per_s: float = 0.0  # 0 = unlimited
    latency_s: float = 0.0
    ready_file: str = ""
    shutdown_grace_s: float = 5.0

    def check(self) -> None:
        if not os.path.isdir(self.root):
            raise EmulatorConfigError(f"--root: {self.root!r} is not a directory")
        for name in RESERVED_NAMES:
            if os.path.isdir(os.path.join(self.root, name)):
                raise EmulatorConfigError(
                    f"--root: {self.root!r} has a directory {name!r}; /{name} is the emulator's own endpoint, "
                    "so it cannot be a bucket: rename it"
                )
        if not (self.bandwidth_bytes_per_s >= 0):  # "not >=" also catches NaN
            raise EmulatorConfigError(f"--bandwidth-mb-s: must be >= 0 (0 = unlimited), got {self.bandwidth_bytes_per_s}")
        if not (self.latency_s >= 0):
            raise EmulatorConfigError(f"--latency-ms: must be >= 0, got {self.latency_s * 1000:g}")


class SharedLink:
    """One link of ``rate`` bytes/s shared by every connection (0 = unlimited).

    Each chunk reserves the next ``nbytes / rate`` seconds of the link and is released when the
    link would have finished sending it, so the total rate over all readers is the configured one
    whatever their number, and even a lone small object costs ``size / rate`` (a request takes
    latency + size / rate on an idle link).

    ``slack_s``: a sender woken late (a busy event loop or machine overshoots every sleep by a
    little) may start its chunk up to this long in the past, so the link does not lose the
    overshoot of every chunk and a lone reader still gets the full rate under load. That is
    also the only credit an idle link accumulates: a burst of at most ``slack_s * rate`` bytes.
    """

    def __init__(self, rate: float, slack_s: float = 0.025) -> None:
        self.rate = rate
        self.slack_s = slack_s
        self._next_free = 0.0

    async def send(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        done = max(self._next_free, now - self.slack_s) + nbytes / self.rate
        self._next_free = done
        await asyncio.sleep(done - now)


@dataclass
class _Object:
    path: str
    size: int
    mtime: float
    etag: str


@dataclass
class _Listing:
    keys: list[str]
    made: float


@dataclass
class _Metrics:
    registry: Any
    sent: Any
    requests: Any
    bandwidth: Any
    latency: Any
    in_flight: Any


def _make_metrics(config: EmulatorConfig) -> _Metrics:
    from prometheus_client import CollectorRegistry, Counter, Gauge

    registry = CollectorRegistry()  # private: one emulator per process, no other metrics mixed in
    m = _Metrics(
        registry=registry,
        sent=Counter("silod_store_emulator_sent_bytes", "Object body bytes sent (rate() = bytes/s served)",
                     registry=registry),
        requests=Counter("silod_store_emulator_requests", "S3 requests answered", ["operation", "status"],
                         registry=registry),
        bandwidth=Gauge("silod_store_emulator_bandwidth_bytes_per_second",
                        "Configured shared bandwidth (0 = unlimited)", registry=registry),
        latency=Gauge("silod_store_emulator_latency_seconds", "Configured latency per request", registry=registry),
        in_flight=Gauge("silod_store_emulator_requests_in_flight", "S3 requests being answered", registry=registry),
    )
    m.bandwidth.set(config.bandwidth_bytes_per_s)
    m.latency.set(config.latency_s)
    return m


class StoreEmulator:
    """The aiohttp application; :meth:`start` binds it, :meth:`stop` drains and closes it."""

    def __init__(self, config: EmulatorConfig) -> None:
        config.check()
        self.config = config
        self.root = os.path.realpath(config.root)
        self.link = SharedLink(config.bandwidth_bytes_per_s)
        self.metrics = _make_metrics(config)
        self._etags: dict[str, tuple[int, int, str]] = {}  # path -> (size, mtime_ns, md5)
        self._listings: dict[tuple[str, str], _Listing] = {}
        self._runner: Any = None
        self.address = ""

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and serve; returns ``HOST:PORT`` (the port the OS chose if the config says 0)."""
        from aiohttp import web

        app = web.Application()
        app.router.add_route("GET", "/healthz", self._healthz)
        app.router.add_route("GET", "/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._s3)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.config.shutdown_grace_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port,
                           shutdown_timeout=self.config.shutdown_grace_s)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise OSError(exc.errno, f"--listen: cannot bind {self.config.host}:{self.config.port}: "
                                     f"{exc.strerror or exc}") from None
        host, port = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # stops accepting, lets requests in flight finish (grace)
            self._runner = None

    # -- own endpoints --------------------------------------------------------------------------------

    async def _healthz(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "serving", "root": self.root,
                                  "bandwidth_bytes_per_s": self.config.bandwidth_bytes_per_s,
                                  "latency_s": self.config.latency_s})

    async def _metrics(self, request: Any) -> Any:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- S3 ----------------------------------------------------------------------------------------------

    async def _s3(self, request: Any) -> Any:
        bucket, _, key = request.path.lstrip("/").partition("/")
        if not bucket:
            operation = "list_buckets"
        elif not key:
            operation = "head_bucket" if request.method == "HEAD" else "list_objects"
        else:
            operation = "head_object" if request.method == "HEAD" else "get_object"
        self.metrics.in_flight.inc()
        status = 500
        try:
            if self.config.latency_s > 0:
                await asyncio.sleep(self.config.latency_s)
            if request.method not in ("GET", "HEAD"):
                response = _error(405, "MethodNotAllowed", f"{request.method}: this emulator is read-only")
            elif operation == "list_buckets":
                response = self._list_buckets()
            elif operation == "head_bucket":
                from aiohttp import web

                response = web.Response(status=200 if self._bucket_dir(bucket) else 404)
            elif operation == "list_objects":
                response = await self._list_objects(bucket, request)
            else:
                response = await self._object(bucket, key, request)
            status = response.status
            return response
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(operation, str(status)).inc()

    def _bucket_dir(self, bucket: str) -> str:
        """The bucket's directory, or "" if there is no such bucket."""
        if bucket in RESERVED_NAMES or bucket.startswith(".") or "/" in bucket or "\\" in bucket:
            return ""
        path = os.path.join(self.root, bucket)
        return path if os.path.isdir(path) else ""

    def _list_buckets(self) -> Any:
        from aiohttp import web

        names = sorted(n for n in os.listdir(self.root) if self._bucket_dir(n))
        xml = [f'<?xml version="1.0" encoding="UTF-8"?><ListAllMyBucketsResult xmlns="{S3_XMLNS}">',
               "<Owner><ID>silod</ID><DisplayName>silod</DisplayName></Owner><Buckets>"]
        for name in names:
            created = _iso(os.stat(os.path.join(self.root, name)).st_mtime)
            xml.append(f"<Bucket><Name>{escape(name)}</Name><CreationDate>{created}</CreationDate></Bucket>")
        xml.append("</Buckets></ListAllMyBucketsResult>")
        return web.Response(body="".join(xml).encode(), content_type="application/xml")

    def _resolve(self, bucket_dir: str, key: str) -> str:
        """The file of ``key``, or "" if the key names none (or would leave the bucket)."""
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts) or "\0" in key:
            return ""
        path = os.path.join(bucket_dir, *parts)
        real = os.path.realpath(path)
        if not real.startswith(bucket_dir + os.sep):  # a symlink out of the bucket is not an object
            return ""
        return real

    def _walk(self, bucket_dir: str, base: str) -> Iterator[str]:
        """Keys of the files below ``base`` (a key prefix ending at a "/" or empty), unsorted."""
        top = os.path.join(bucket_dir, *base.split("/")) if base else bucket_dir
        if not os.path.isdir(top):
            return
        for dirpath, dirnames, names in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, bucket_dir)
            for name in names:
                if name.startswith("."):
                    continue  # editor and partial-write files are not objects
                yield name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"

    async def _etag(self, path: str, st: os.stat_result) -> str:
        cached = self._etags.get(path)
        if cached is not None and cached[:2] == (st.st_size, st.st_mtime_ns):
            return cached[2]
        digest = await asyncio.get_running_loop().run_in_executor(None, _md5, path)
        self._etags[path] = (st.st_size, st.st_mtime_ns, digest)
        return digest

    async def _list_objects(self, bucket: str, request: Any) -> Any:
        from aiohttp import web

        bucket_dir = self._bucket_dir(bucket)
        if not bucket_dir:
            return _error(404, "NoSuchBucket", f"bucket {bucket!r}: no directory {bucket!r} under --root")
        q = request.query
        prefix = q.get("prefix", "")
        delimiter = q.get("delimiter", "")
        try:
            max_keys = max(0, min(1000, int(q.get("max-keys", "1000"))))
        except ValueError:
            return _error(400, "InvalidArgument", "max-keys: not an integer")
        token = q.get("continuation-token", "")
        # Tokens are ours: "K:<last key sent>" or "P:<last common prefix sent>" (its keys are skipped).
        kind, _, value = token.partition(":")
        if token and kind not in ("K", "P"):
            return _error(400, "InvalidArgument", "continuation-token: not one this server issued")
        after = value if token else (q.get("start-after", "") or q.get("marker", ""))
        skip_prefix = value if kind == "P" else ""
        base = prefix.rpartition("/")[0]
        # A continuation page reuses the listing of the first page (one walk per listing, not per
        # page: 1,000-key pages over a large bucket would otherwise walk it once per page).
        cache_key = (bucket, base)
        listing = self._listings.get(cache_key)
        if not token or listing is None or time.monotonic() - listing.made > 300:
            keys = await asyncio.get_running_loop().run_in_executor(None, lambda: sorted(self._walk(bucket_dir, base)))
            listing = self._listings[cache_key] = _Listing(keys, time.monotonic())
        contents: list[tuple[str, os.stat_result]] = []
        prefixes: list[str] = []
        last = ""
        truncated = False
        for key in listing.keys:
            if not key.startswith(prefix) or key <= after or (skip_prefix and key.startswith(skip_prefix)):
                continue
            rest = key[len(prefix):]
            common = prefix + rest.split(delimiter, 1)[0] + delimiter if delimiter and delimiter in rest else ""
            if common and prefixes and prefixes[-1] == common:
                continue  # keys are sorted: a common prefix's keys are adjacent and count once
            if len(contents) + len(prefixes) >= max_keys:
                truncated = max_keys > 0  # max-keys=0 asks for no keys, not for an endless paging
                break
            if common:
                prefixes.append(common)
                last = "P:" + common
                continue
            try:
                st = os.stat(os.path.join(bucket_dir, *key.split("/")))
            except OSError:
                continue  # deleted since the walk
            contents.append((key, st))
            last = "K:" + key
        xml = [f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{S3_XMLNS}">',
               f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>",
               f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>",
               f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        if delimiter:
            xml.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
        for key, st in contents:
            etag = await self._etag(os.path.join(bucket_dir, *key.split("/")), st)
            xml.append(f"<Contents><Key>{escape(key)}</Key><LastModified>{_iso(st.st_mtime)}</LastModified>"
                       f"<ETag>&quot;{etag}&quot;</ETag><Size>{st.st_size}</Size>"
                       "<StorageClass>STANDARD</StorageClass></Contents>")
        for common in prefixes:
            xml.append(f"<CommonPrefixes><Prefix>{escape(common)}</Prefix></CommonPrefixes>")
        if truncated:
            xml.append(f"<NextContinuationToken>{escape(last)}</NextContinuationToken>")
        xml.append("</ListBucketResult>")
        return web.Response(body="".join(xml).encode(), content_type="application/xml")

    async def _object(self, bucket: str, key: str, request: Any) -> Any:
        from aiohttp import web

        bucket_dir = self._bucket_dir(bucket)
        if not bucket_dir:
            return _error(404, "NoSuchBucket", f"bucket {bucket!r}: no directory {bucket!r} under --root",
                          head=request.method == "HEAD")
        path = self._resolve(bucket_dir, key)
        st = None
        if path:
            with contextlib.suppress(OSError):
                st = os.stat(path)
        if st is None or not stat.S_ISREG(st.st_mode):
            return _error(404, "NoSuchKey", f"no object {key!r} in bucket {bucket!r}", head=request.method == "HEAD")
        size = st.st_size
        etag = await self._etag(path, st)
        headers = {"ETag": f'"{etag}"', "Last-Modified": _http_date(st.st_mtime), "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if_match = request.headers.get("If-Match")
        if if_match and if_match.strip() != "*" and if_match.strip().strip('"') != etag:
            return _error(412, "PreconditionFailed", "If-Match: the object's ETag differs",
                          head=request.method == "HEAD")
        if request.method == "HEAD":
            return web.Response(status=200, headers={**headers, "Content-Length": str(size)})
        start, end, status = 0, size - 1, 200
        if "Range" in request.headers:
            parsed = _parse_range(request.headers["Range"], size)
            if parsed is None:
                return _error(416, "InvalidRange", f"Range: {request.headers['Range']!r} is not satisfiable "
                                                   f"for an object of {size} bytes",
                              extra_headers={"Content-Range": f"bytes */{size}"})
            start, end = parsed
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = end - start + 1 if size else 0
        response = web.StreamResponse(status=status, headers={**headers, "Content-Length": str(length)})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        with open(path, "rb") as f:
            f.seek(start)
            remaining = length
            while remaining > 0:
                block = await loop.run_in_executor(None, f.read, min(READ_BYTES, remaining))
                if not block:
                    break  # the file shrank while being sent: the client sees a short body
                remaining -= len(block)
                for offset in range(0, len(block), CHUNK_BYTES):
                    chunk = block[offset : offset + CHUNK_BYTES]
                    await self.link.send(len(chunk))
                    await response.write(chunk)
                    self.metrics.sent.inc(len(chunk))
        await response.write_eof()
        return response


def _md5(path: str) -> str:
    digest = hashlib.md5()  # noqa: S324 -- S3's ETag of a single-part object is its MD5
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a single ``bytes=`` range, or None if it cannot be satisfied."""
    spec = header.strip()
    if not spec.startswith("bytes=") or "," in spec:
        return None
    first, sep, last = spec[len("bytes="):].partition("-")
    try:
        if not sep:
            return None
        if not first:  # suffix: the last N bytes
            n = int(last)
            return (max(0, size - n), size - 1) if n > 0 and size else None
        start = int(first)
        end = min(size - 1, int(last)) if last else size - 1
    except ValueError:
        return None
    return (start, end) if 0 <= start <= end else None


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _http_date(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")


def _error(status: int, code: str, message: str, *, head: bool = False,
           extra_headers: dict[str, str] | None = None) -> Any:
    from aiohttp import web

    if head:  # HEAD answers carry no body
        return web.Response(status=status, headers=extra_headers)
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{escape(message)}</Message></Error>")
    return web.Response(status=status, body=body.encode(), content_type="application/xml", headers=extra_headers)


# -- the process --------------------------------------------------------------------------------------------


@dataclass
class _Stop:
    event: asyncio.Event = field(default_factory=asyncio.Event)
    signal: str = ""


async def serve(config: EmulatorConfig) -> None:
    """Serve until SIGTERM or SIGINT; write ``config.ready_file`` (``HOST:PORT``) once serving."""
    from services.runtime.server import remove_ready_file, watch_launcher, write_ready_file

    stop = _Stop()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        stop.signal = sig.name
        stop.event.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    def on_launcher_gone() -> None:
        stop.signal = "launcher gone"
        stop.event.set()

    launcher_watch = watch_launcher(on_launcher_gone)
    # A file left by a killed predecessor would announce an address nobody serves.
    remove_ready_file(config.ready_file)
    emulator = StoreEmulator(config)
    address = await emulator.start()
    try:
        if config.ready_file:
            write_ready_file(config.ready_file, address)
        buckets = sorted(n for n in os.listdir(emulator.root) if emulator._bucket_dir(n))
        _log.info("serving", extra={"address": address, "root": emulator.root, "buckets": buckets,
                                    "bandwidth_bytes_per_s": config.bandwidth_bytes_per_s,
                                    "latency_s": config.latency_s})
        await stop.event.wait()
        _log.info("shutting down", extra={"signal": stop.signal, "grace_s": config.shutdown_grace_s})
    finally:
        if launcher_watch is not None:
            launcher_watch.cancel()
        remove_ready_file(config.ready_file)
        await emulator.stop()
    _log.info("shutdown complete")

