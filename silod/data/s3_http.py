"""A lean S3 client for the read path: GET (ranged, ``If-Match``) and HEAD over ``http.client``,
signed with AWS Signature Version 4, one keep-alive connection per thread.

Why not botocore for these: a cold epoch of 114 KB samples at 100 MB/s is ~900 GETs a second,
and one aiobotocore GET costs ~1.5-3 ms of CPU (parameter validation, event hooks, endpoint
rules, response parsing), more than two cores have to spare. This client does only what a
verified read needs: the same credentials (botocore's provider chain: environment, shared
files, instance role, refreshed when they expire), the same requests.

Why not obstore (Rust ``object_store``), the well-kept library with an equally cheap request
path: it is not fork-safe. Its tokio runtime does not survive ``fork()``: once a process has
made one request, the first request in a forked child hangs for ever, even through a new
store (obstore 0.12.1; its maintainers: "obstore is not fork safe", developmentseed/obstore
PR 441). A DataLoader forks its workers from the process that built the dataset, and this
client must keep working there (``ObjectStore`` opens a new one per process id;
tests/sdk/test_s3_http.py proves it). Measured side by side (``benchmarks/s3_clients.py``,
moto in its own process, 2,000 GETs of 114 KB with If-Match, 16 threads, 2 shared cores):
CPU per GET 0.39-0.44 ms here, 0.43-0.51 ms obstore (1.1x), 2.8-3.3 ms s3fs ``cat_file`` (7x);
one thread: 0.48, 0.44 and 3.3 ms. So obstore would be chosen for speed; fork decides.
:class:`silod.data.store.ObjectStore` uses it when the dataset's storage options say nothing
it does not understand (``endpoint_url``, ``region``); everything else goes through s3fs.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import http.client
import threading
import urllib.parse
from typing import Any

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
OPTIONS = frozenset({"endpoint_url", "region", "region_name"})


class S3HttpError(Exception):
    """A response the caller must interpret: ``status`` and S3's error code (if any)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code


class S3ConnectionError(OSError):
    """The request did not get an answer (connection refused, reset, timed out): transient."""


def usable(options: dict[str, str]) -> bool:
    """Whether this client serves a dataset with these storage options (else s3fs does)."""
    return set(options) <= OPTIONS and bool(options.get("endpoint_url"))


class _Endpoint:
    """One S3 endpoint (path-style: ``<endpoint>/<bucket>/<key>``): its address, region and
    credentials, and request signing (shared by the blocking and the asyncio client)."""

    def __init__(self, endpoint_url: str, region: str = "", timeout_s: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(endpoint_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"endpoint_url must be http(s)://host[:port], got {endpoint_url!r}")
        self.https = parsed.scheme == "https"
        self.host = parsed.hostname
        self.port = parsed.port or (443 if self.https else 80)
        default_port = parsed.port is None or parsed.port == (443 if self.https else 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self.base_path = parsed.path.rstrip("/")
        self.region = region or _default_region()
        self.timeout_s = timeout_s
        self._credentials = _credentials()
        self._keys: dict[tuple[str, str], bytes] = {}

    def _path(self, bucket: str, key: str) -> str:
        return f"{self.base_path}/{urllib.parse.quote(bucket, safe='')}/{urllib.parse.quote(key, safe='/~')}"

    # -- Signature Version 4 ------------------------------------------------------------------------

    def _sign(self, method: str, path: str, now: datetime.datetime | None = None) -> dict[str, str]:
        now = now or datetime.datetime.now(datetime.timezone.utc)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        headers = {"Host": self.host_header, "x-amz-date": amz_date, "x-amz-content-sha256": UNSIGNED_PAYLOAD}
        creds = self._credentials.get_frozen_credentials() if self._credentials is not None else None
        if creds is None or not creds.access_key:
            return headers  # no credentials anywhere: an anonymous request (a public bucket)
        if creds.token:
            headers["x-amz-security-token"] = creds.token
        signed = sorted(k.lower() for k in headers)
        values = {k.lower(): v for k, v in headers.items()}
        canonical = "\n".join([
            method, path, "",
            *(f"{name}:{values[name].strip()}" for name in signed), "",
            ";".join(signed), UNSIGNED_PAYLOAD,
        ])
        day = amz_date[:8]
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(creds.secret_key, day), to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                                    f"SignedHeaders={';'.join(signed)}, Signature={signature}")
        return headers

    def _signing_key(self, secret: str, day: str) -> bytes:
        cached = self._keys.get((secret, day))
        if cached is None:
            key = f"AWS4{secret}".encode()
            for part in (day, self.region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            cached = self._keys[(secret, day)] = key
        return cached



class S3Http(_Endpoint):
    """Blocking requests, one keep-alive connection per thread. Thread-safe."""

    def __init__(self, endpoint_url: str, region: str = "", timeout_s: float = 30.0) -> None:
        super().__init__(endpoint_url, region, timeout_s)
        self._local = threading.local()

    # -- requests -------------------------------------------------------------------------------

    def get(self, bucket: str, key: str, start: int = 0, length: int = -1, if_match: str = "") -> tuple[bytes, str]:
        """(body, ETag without quotes) of ``key``, bytes ``start .. start+length-1`` if ``length`` > 0."""
        status, response_headers, body = self._request("GET", bucket, key, _get_headers(start, length, if_match))
        if status not in (200, 206):
            raise _error(status, body)
        return body, response_headers.get("etag", "").strip('"')

    def head(self, bucket: str, key: str) -> str:
        """The ETag (without quotes) of ``key``."""
        status, headers, _ = self._request("HEAD", bucket, key, {})
        return _head_etag(status, headers)

    def _request(self, method: str, bucket: str, key: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        path = self._path(bucket, key)
        headers = {**headers, **self._sign(method, path)}
        for attempt in (0, 1):
            conn, fresh = self._connection()
            try:
                conn.request(method, path, headers=headers)
                response = conn.getresponse()
                body = response.read()
                got = {k.lower(): v for k, v in response.getheaders()}
                if response.will_close:
                    self._drop()
                return response.status, got, body
            except (http.client.HTTPException, OSError) as exc:
                self._drop()
                # A kept-alive connection the server closed meanwhile fails at once: one fresh try.
                if fresh or attempt:
                    raise S3ConnectionError(f"{method} {self.host_header}{path}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, False
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout_s)
        self._local.conn = conn
        return conn, True

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()


class AsyncS3Http(_Endpoint):
    """The same requests on an asyncio event loop, over keep-alive connections of its own (at
    most ``connections``), with asyncio's streams: for the cache server, whose remote reads then
    need no thread each. Measured against the store emulator (3,000 GETs of 114 KB, 64 at a
    time): ~0.2 ms of CPU a GET here, ~0.3 ms through aiohttp's client (its request and
    response objects, a timer per received chunk), ~0.5 ms with :class:`S3Http` in 64 threads
    (the GIL handed back and forth on every receive). HTTP/1.1 as S3 answers: a body of
    ``Content-Length`` bytes, chunked, or up to the end of the connection. Bound to the loop it
    is first used on; :meth:`close` it on that loop.
    """

    def __init__(self, endpoint_url: str, region: str = "", timeout_s: float = 30.0, connections: int = 128) -> None:
        super().__init__(endpoint_url, region, timeout_s)
        self.connections = connections
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []  # LIFO: the warmest first
        self._slots: asyncio.Semaphore | None = None

    async def get(self, bucket: str, key: str, start: int = 0, length: int = -1,
                  if_match: str = "") -> tuple[bytes, str]:
        """As :meth:`S3Http.get`."""
        status, headers, body = await self._request("GET", bucket, key, _get_headers(start, length, if_match))
        if status not in (200, 206):
            raise _error(status, body)
        return body, headers.get("etag", "").strip('"')

    async def head(self, bucket: str, key: str) -> str:
        """As :meth:`S3Http.head`."""
        status, headers, _ = await self._request("HEAD", bucket, key, {})
        return _head_etag(status, headers)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

    async def _request(self, method: str, bucket: str, key: str,
                       headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        path = self._path(bucket, key)
        head = "".join(f"{name}: {value}\r\n" for name, value in {**headers, **self._sign(method, path)}.items())
        request = f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode("latin-1")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.connections)
        async with self._slots:
            for attempt in (0, 1):
                while self._idle and self._idle[-1][0].at_eof():  # closed by the server while idle
                    self._idle.pop()[1].close()
                reused = bool(self._idle) and not attempt
                try:
                    async with asyncio.timeout(self.timeout_s):
                        reader, writer = self._idle.pop() if reused else await self._connect()
                        try:
                            writer.write(request)
                            status, got, body, keep = await _response(reader, method)
                        except BaseException:
                            writer.close()
                            raise
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                        TimeoutError) as exc:
                    # A kept-alive connection the server closed meanwhile fails at once: one fresh try.
                    if reused and not isinstance(exc, TimeoutError):
                        continue
                    raise S3ConnectionError(f"{method} {self.host_header}{path}: {type(exc).__name__}: {exc}") from exc
                if keep:
                    self._idle.append((reader, writer))
                else:
                    writer.close()
                return status, got, body
        raise AssertionError("unreachable")

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if not self.https:
            return await asyncio.open_connection(self.host, self.port, limit=_BUFFER_LIMIT)
        import ssl

        return await asyncio.open_connection(self.host, self.port, limit=_BUFFER_LIMIT,
                                             ssl=ssl.create_default_context(), server_hostname=self.host)


# Bytes a connection buffers before it stops reading from the socket (asyncio pauses at twice
# this): a coalesced ranged read of a shard (4 MiB) is received without pausing.
_BUFFER_LIMIT = 4 << 20


async def _response(reader: asyncio.StreamReader, method: str) -> tuple[int, dict[str, str], bytes, bool]:
    """(status, headers with lower-case names, body, connection reusable) of one HTTP/1.1 answer."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    version, status_text = lines[0].split(" ", 2)[:2]
    status = int(status_text)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return status, headers, b"", keep
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while size := int((await reader.readline()).split(b";", 1)[0], 16):
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)  # the CRLF after each chunk
        while (await reader.readline()) not in (b"\r\n", b""):  # trailers
            pass
        return status, headers, b"".join(chunks), keep
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"])), keep
    return status, headers, await reader.read(), False  # delimited by the end of the connection


def _get_headers(start: int, length: int, if_match: str) -> dict[str, str]:
    headers = {}
    if length > 0:
        headers["Range"] = f"bytes={start}-{start + length - 1}"
    if if_match:
        headers["If-Match"] = f'"{if_match}"'
    return headers


def _head_etag(status: int, headers: Any) -> str:
    if status != 200:
        raise S3HttpError(status, "NoSuchKey" if status == 404 else "", "HEAD failed")
    return str(headers.get("etag", "")).strip('"')


def _credentials() -> Any:
    import botocore.session

    return botocore.session.get_session().get_credentials()


def _default_region() -> str:
    import botocore.session

    return botocore.session.get_session().get_config_variable("region") or "us-east-1"


def _error(status: int, body: bytes) -> S3HttpError:
    text = body.decode("utf-8", "replace")
    code = _between(text, "<Code>", "</Code>")
    return S3HttpError(status, code, _between(text, "<Message>", "</Message>") or text[:200])


def _between(text: str, start: str, end: str) -> str:
    i = text.find(start)
    if i < 0:
        return ""
    j = text.find(end, i + len(start))
    return text[i + len(start) : j] if j >= 0 else ""
