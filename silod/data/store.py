"""Reading dataset objects straight from the remote store (``file://`` or ``s3://``), verified.

Used by the cache server for misses and by the SDK when there is no cache server. Every read
is checked against the manifest entry it was asked for:

- ``file://``: the version tag is recomputed from the opened file (size and modification time,
  exactly as :mod:`silod.manifest` computes it) before and after reading; the opened file must
  lie below the dataset root once symlinks are resolved (checked on the open descriptor, so a
  path swapped for a symlink between check and open is caught too).
- ``s3://`` (any S3-compatible endpoint): the GET carries ``If-Match: <manifest ETag>``
  and the ETag of the response itself is compared, so the bytes returned are those of the
  manifest's version or nothing. Reads go through :mod:`silod.data.s3_http` (a GET for a
  tenth of botocore's CPU) when the storage options are just ``endpoint_url`` (and
  ``region``), through s3fs otherwise.

A mismatch raises :class:`ObjectChanged`; it is never retried (the object really changed).
Transient failures (connection errors, timeouts, 5xx) are retried with exponential backoff.
Credentials are never part of the dataset spec: s3fs/botocore take them from the standard AWS
environment (variables, shared config, instance role); options that look like secrets are refused.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from silod.data import s3_http
from silod.data.keys import BadKey, check_key
from silod.data.shards import parse_sample_key
from silod.data.storage_options import BOOL_OPTIONS, parse_bool_option, version_tag

SCHEMES = ("file", "s3")
MAX_POOL_CONNECTIONS = 128
# fsspec/s3fs options that carry credentials: the spec is stored in the metadata database, so
# they must come from the environment instead.
SECRET_OPTIONS = frozenset(
    {"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
)


class StoreError(Exception):
    """Reading an object failed; ``key`` names it (empty for whole-store problems)."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class ObjectChanged(StoreError):
    """The store holds another version of the object than the manifest names."""

    def __init__(self, key: str, expected: str, actual: str) -> None:
        super().__init__(
            f"object {key!r} changed in the store: manifest version tag {expected!r}, store has {actual!r}", key
        )
        self.expected = expected
        self.actual = actual


class ObjectOutsideRoot(StoreError):
    """The key resolves (through symlinks) to a file outside the dataset root."""


class ObjectMissing(StoreError):
    """The store has no object under the key."""


class StoreConfigError(StoreError):
    """The dataset's URI or storage options cannot be used."""


class StoreUnavailable(StoreError):
    """The store did not answer after all retries."""


def file_version_tag(st: os.stat_result) -> str:
    """The ``file://`` version tag of a file, identical to the one in registered manifests."""
    return version_tag({"size": st.st_size, "mtime": st.st_mtime})


def _s3_options(options: Mapping[str, str], timeout_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    client_kwargs: dict[str, Any] = {}
    for name, value in options.items():
        if name.lower() in SECRET_OPTIONS:
            raise StoreConfigError(
                f"storage_options.{name}: credentials are not stored with a dataset; "
                "set them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE ...)"
            )
        if name in ("region", "region_name"):
            client_kwargs["region_name"] = value
        elif name in BOOL_OPTIONS:
            try:
                out[name] = parse_bool_option(value)
            except ValueError as exc:
                raise StoreConfigError(f"storage_options.{name}: {exc}") from None
        else:
            out[name] = value
    out["client_kwargs"] = client_kwargs
    # One attempt per call inside botocore/s3fs: retries and backoff are ours (read()).
    out["config_kwargs"] = {
        "connect_timeout": timeout_s,
        "read_timeout": timeout_s,
        "retries": {"max_attempts": 1},
        # botocore's default pool is 10 connections: with 20 ms per request that caps a reader at
        # ~500 requests/s whatever the number of threads, below a 100 MB/s link of 114 KB objects.
        "max_pool_connections": MAX_POOL_CONNECTIONS,
    }
    out["skip_instance_cache"] = True
    out["use_listings_cache"] = False
    return out


def parse_uri(uri: str) -> tuple[str, str]:
    """(scheme, rest): ``file:///data/x`` -> ("file", "/data/x"); ``s3://b/p`` -> ("s3", "b/p")."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in SCHEMES:
        raise StoreConfigError(f"uri: scheme must be one of file://, s3://, got {uri!r}")
    return scheme, rest


class ObjectStore:
    """Verified reads of one dataset's objects. Thread-safe; safe to use after ``fork``.

    ``timeout_s`` bounds one attempt; ``retries`` more attempts follow a transient failure,
    ``backoff_s * 2**n`` apart (with jitter, at most ``max_backoff_s``). ``max_connections``
    bounds the connections of :meth:`read_async` (the lean ``s3://`` client on an event loop).
    """

    def __init__(
        self,
        uri: str,
        storage_options: Mapping[str, str] | None = None,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        max_connections: int = MAX_POOL_CONNECTIONS,
    ) -> None:
        self.uri = uri
        self.scheme, rest = parse_uri(uri)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep
        self._async_sleep = async_sleep
        self.max_connections = max_connections
        self._options = dict(storage_options or {})
        self._lock = threading.Lock()
        self._fs: Any = None
        self._fs_pid = 0
        self._http: s3_http.S3Http | None = None
        self._http_pid = 0
        self._async: s3_http.AsyncS3Http | None = None
        if self.scheme == "file":
            if not rest.startswith("/"):
                raise StoreConfigError(f"uri: file:// needs an absolute path, got {uri!r}")
            self.root = os.path.realpath(rest)
            self._s3_kwargs: dict[str, Any] = {}
            self.lean = False
        else:
            bucket, _, prefix = rest.partition("/")
            if not bucket:
                raise StoreConfigError(f"uri: no bucket in {uri!r}")
            self.bucket = bucket
            self.prefix = prefix.strip("/")
            self.root = f"{bucket}/{self.prefix}" if self.prefix else bucket
            self._s3_kwargs = _s3_options(self._options, timeout_s)
            self.lean = s3_http.usable(self._options)

    # -- public ----------------------------------------------------------------------------

    def read(self, key: str, size: int = -1, etag: str = "") -> bytes:
        """The bytes of ``key``; if ``etag``/``size`` are given they must match (else ObjectChanged)."""
        obj, start, length = self._locate(key)
        attempt = 0
        while True:
            try:
                if self.scheme == "file":
                    data = self._read_file(obj, etag, start, length)
                else:
                    data = self._read_s3(obj, etag, start, length)
                return _sized(key, data, size)
            except Exception as exc:  # noqa: BLE001 -- _retry_delay re-raises what is final
                delay = self._retry_delay(key, exc, attempt)
            attempt += 1
            self._sleep(delay)

    @property
    def reads_async(self) -> bool:
        """Whether :meth:`read_async` reads on the caller's event loop (``s3://`` through the lean
        client); otherwise call :meth:`read` in a thread."""
        return self.scheme == "s3" and self.lean

    async def read_async(self, key: str, size: int = -1, etag: str = "") -> bytes:
        """:meth:`read` on an asyncio loop, without a thread (only where :attr:`reads_async`): the
        same checks, retries and backoff. Use it from one loop; :meth:`aclose` on that loop."""
        if not self.reads_async:
            raise StoreConfigError(f"{self.uri}: no asyncio reads for this store; call read() in a thread")
        obj, start, length = self._locate(key)
        attempt = 0
        while True:
            try:
                return _sized(key, await self._read_s3_async(obj, etag, start, length), size)
            except Exception as exc:  # noqa: BLE001 -- _retry_delay re-raises what is final
                delay = self._retry_delay(key, exc, attempt)
            attempt += 1
            await self._async_sleep(delay)

    async def current_tag_async(self, key: str) -> str:
        """:meth:`current_tag` on an asyncio loop (only where :attr:`reads_async`)."""
        sample = parse_sample_key(key)
        obj = sample.shard if sample is not None else key
        try:
            return await self._async_http().head(self.bucket, self._s3_key(obj))
        except s3_http.S3HttpError as exc:
            raise self._http_head_failure(obj, exc) from None

    async def aclose(self) -> None:
        """Close the asyncio client's connections (if :meth:`read_async` opened any)."""
        if self._async is not None:
            client, self._async = self._async, None
            await client.close()

    def _locate(self, key: str) -> tuple[str, int, int]:
        """(object, start, length) of ``key``: a sample of a sharded dataset (silod.data.shards) is
        a byte range of its shard, which carries the version tag; anything else a whole object."""
        try:
            check_key(key)
        except BadKey as exc:
            raise ObjectOutsideRoot(f"key {key!r} {exc}", key) from None
        sample = parse_sample_key(key)
        return (sample.shard, sample.offset, sample.length) if sample else (key, 0, -1)

    def _retry_delay(self, key: str, exc: Exception, attempt: int) -> float:
        """Seconds to wait before the next attempt after ``exc``; raises what is final (a changed,
        missing or refused object, a bug, or the last attempt's failure)."""
        if isinstance(exc, (ObjectChanged, ObjectOutsideRoot, ObjectMissing, StoreConfigError)):
            raise exc
        error: Exception = exc
        if isinstance(exc, _ChangedWhileReading):
            error = StoreUnavailable(f"object {key!r} kept changing while being read", key)
        elif isinstance(exc, PermissionError):
            raise StoreError(f"object {key!r}: permission denied: {exc}", key) from exc
        elif not _transient(exc):
            raise exc
        if attempt >= self.retries:
            if isinstance(error, StoreError):
                raise error
            raise StoreUnavailable(
                f"object {key!r}: store unavailable after {attempt + 1} attempts: {type(error).__name__}: {error}",
                key,
            ) from error
        return min(self.max_backoff_s, self.backoff_s * (2**attempt)) * random.uniform(0.5, 1.0)

    def current_tag(self, key: str) -> str:
        """The version tag the store has now for ``key`` (for messages and manifest refresh)."""
        sample = parse_sample_key(key)
        if sample is not None:
            key = sample.shard
        if self.scheme == "file":
            return file_version_tag(os.stat(self._file_path(key)))
        if self.lean:
            return self._http_head(key)
        head = self._s3_sync(self._s3_head, key)
        return str(head.get("ETag", "")).strip('"')

    # -- file:// ---------------------------------------------------------------------------

    def _file_path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _inside_root(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root.rstrip(os.sep) + os.sep)

    def _read_file(self, key: str, etag: str, start: int = 0, length: int = -1) -> bytes:
        path = self._file_path(key)
        if not self._inside_root(os.path.realpath(path)):
            raise ObjectOutsideRoot(f"key {key!r} resolves outside the dataset root {self.root}", key)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ObjectMissing(f"object {key!r} does not exist in {self.uri}", key) from None
        except IsADirectoryError:
            raise ObjectMissing(f"object {key!r} is a directory in {self.uri}", key) from None
        try:
            # The check that counts: what was actually opened (a component may have been swapped
            # for a symlink after realpath above).
            try:
                opened = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                opened = None
            if opened is not None and not self._inside_root(opened):
                raise ObjectOutsideRoot(f"key {key!r} resolves outside the dataset root {self.root}", key)
            before = os.fstat(fd)
            if etag:
                actual = file_version_tag(before)
                if actual != etag:
                    raise ObjectChanged(key, etag, actual)
            chunks = []
            if length >= 0:
                if start + length > before.st_size:
                    raise ObjectChanged(key, f"at least {start + length} bytes", f"{before.st_size} bytes")
                chunks.append(os.pread(fd, length, start))
            else:
                while True:
                    chunk = os.read(fd, max(before.st_size, 1 << 20) + 1)
                    if not chunk:
                        break
                    chunks.append(chunk)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise _ChangedWhileReading()
        return b"".join(chunks)

    # -- s3:// -----------------------------------------------------------------------------

    def _s3_fs(self) -> Any:
        with self._lock:
            if self._fs is None or self._fs_pid != os.getpid():  # s3fs sessions do not survive fork
                import s3fs

                self._fs = s3fs.S3FileSystem(**self._s3_kwargs)
                self._fs_pid = os.getpid()
            return self._fs

    def _s3_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _s3_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        import fsspec.asyn

        fs = self._s3_fs()
        return fsspec.asyn.sync(fs.loop, fn, fs, *args, timeout=self.timeout_s)

    async def _s3_head(self, fs: Any, key: str) -> dict[str, Any]:
        try:
            return dict(await fs._call_s3("head_object", Bucket=self.bucket, Key=self._s3_key(key)))
        except FileNotFoundError:
            raise ObjectMissing(f"object {key!r} does not exist in {self.uri}", key) from None

    async def _s3_get(self, fs: Any, key: str, etag: str, start: int = 0, length: int = -1) -> tuple[bytes, str]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._s3_key(key)}
        if length > 0:
            kwargs["Range"] = f"bytes={start}-{start + length - 1}"
        if etag:
            kwargs["IfMatch"] = f'"{etag}"'
        try:
            response = await fs._call_s3("get_object", **kwargs)
        except FileNotFoundError:
            raise ObjectMissing(f"object {key!r} does not exist in {self.uri}", key) from None
        except Exception as exc:
            if etag and _is_precondition_failed(exc):
                head = await self._s3_head(fs, key)
                raise ObjectChanged(key, etag, str(head.get("ETag", "")).strip('"')) from None
            raise
        body = response["Body"]
        try:
            data = await body.read()
        finally:
            body.close()
        return data, str(response.get("ETag", "")).strip('"')

    def _s3_http(self) -> s3_http.S3Http:
        with self._lock:
            if self._http is None or self._http_pid != os.getpid():  # connections do not survive fork
                self._http = s3_http.S3Http(self._options["endpoint_url"],
                                            self._options.get("region") or self._options.get("region_name", ""),
                                            self.timeout_s)
                self._http_pid = os.getpid()
            return self._http

    def _async_http(self) -> s3_http.AsyncS3Http:
        if self._async is None:
            self._async = s3_http.AsyncS3Http(self._options["endpoint_url"],
                                              self._options.get("region") or self._options.get("region_name", ""),
                                              self.timeout_s, self.max_connections)
        return self._async

    def _http_head(self, key: str) -> str:
        try:
            return self._s3_http().head(self.bucket, self._s3_key(key))
        except s3_http.S3HttpError as exc:
            raise self._http_head_failure(key, exc) from None

    def _http_head_failure(self, key: str, exc: s3_http.S3HttpError) -> Exception:
        if exc.status == 404:
            return ObjectMissing(f"object {key!r} does not exist in {self.uri}", key)
        return self._http_failure(key, exc)

    def _http_failure(self, key: str, exc: s3_http.S3HttpError) -> Exception:
        if exc.status >= 500 or exc.status in (408, 429):
            return _Transient(str(exc))
        if exc.status == 403:
            return StoreError(f"object {key!r}: access denied by the store: {exc}", key)
        return StoreError(f"object {key!r}: the store refused the read: {exc}", key)

    def _read_s3(self, key: str, etag: str, start: int = 0, length: int = -1) -> bytes:
        if self.lean:
            try:
                data, actual = self._s3_http().get(self.bucket, self._s3_key(key), start, length, etag)
            except s3_http.S3HttpError as exc:
                current = self._http_head(key) if exc.status == 412 else ""
                raise self._http_get_failure(key, exc, etag, start, length, current) from None
            return _checked(key, data, etag, actual)
        data, actual = self._s3_sync(self._s3_get, key, etag, start, length)
        return bytes(_checked(key, data, etag, actual))

    async def _read_s3_async(self, key: str, etag: str, start: int = 0, length: int = -1) -> bytes:
        try:
            data, actual = await self._async_http().get(self.bucket, self._s3_key(key), start, length, etag)
        except s3_http.S3HttpError as exc:
            current = await self.current_tag_async(key) if exc.status == 412 else ""
            raise self._http_get_failure(key, exc, etag, start, length, current) from None
        return _checked(key, data, etag, actual)

    def _http_get_failure(self, key: str, exc: s3_http.S3HttpError, etag: str, start: int, length: int,
                          current: str) -> Exception:
        """What a refused GET means; ``current``: the version the store has (read after a 412)."""
        if exc.status == 404:
            return ObjectMissing(f"object {key!r} does not exist in {self.uri}", key)
        if exc.status == 412:
            return ObjectChanged(key, etag, current)
        if exc.status == 416:
            return ObjectChanged(key, f"at least {start + length} bytes", "fewer bytes")
        return self._http_failure(key, exc)


def _sized(key: str, data: bytes, size: int) -> bytes:
    if size >= 0 and len(data) != size:
        raise ObjectChanged(key, f"{size} bytes", f"{len(data)} bytes")
    return data


def _checked(key: str, data: bytes, etag: str, actual: str) -> bytes:
    """``data`` if the store says it sent version ``etag`` (a store that ignores If-Match still
    reports the version it sent)."""
    if etag and actual != etag:
        raise ObjectChanged(key, etag, actual)
    return data


class _ChangedWhileReading(Exception):
    pass


class _Transient(Exception):
    """The store answered with a temporary failure (5xx, throttling): worth another attempt."""


def _transient(exc: BaseException) -> bool:
    """Worth another attempt: I/O and network trouble, timeouts, the storage backends' own errors
    (botocore/aiohttp: throttling, 5xx, resets). Programming errors (TypeError ...) are not."""
    if isinstance(exc, (OSError, TimeoutError, _Transient)):
        return True
    module = type(exc).__module__ or ""
    return module.split(".", 1)[0] in ("botocore", "aiobotocore", "aiohttp", "fsspec", "s3fs", "urllib3")


def _is_precondition_failed(exc: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "412") or status == 412:
                return True
        if "PreconditionFailed" in str(current) or "Precondition Failed" in str(current):
            return True
        if isinstance(current, OSError) and current.errno == errno.EPERM and "412" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False
